"""The course in a language: the English notebooks with their translations applied (`parlab.i18n.notebooks`).

    write_course(root, "zh_CN", dest)    # dest/lessons/*.ipynb, dest/exercises/*.ipynb,
                                         # dest/exercises/solutions/*.ipynb, dest/GLOSSARY.md

Nothing here is kept in git: a translated notebook is made from its English source and its PO file whenever it
is needed (``parlab course open --lang zh``, ``parlab course html --lang zh``, ``parlab course i18n build``, the
tests). A lesson's Chinese copy has its markdown and its display strings translated; an exercise's has its
markdown translated only, and is generated from the translated solution by the same `make_exercise` as the
English one, so every code cell, grade id, point value and lock, and the checksum of every code cell, is the
English exercise's (nbgrader's checksum covers a cell's source, so a translated markdown cell has its own).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from parlab.course.notebooks import ROOT, dumps, make_exercise, make_source, read
from parlab.i18n import normalize
from parlab.i18n import notebooks as po

__all__ = ["translated_lesson", "translated_solution", "write_course"]


def translated_lesson(path: Path, lang: str, root: Path = ROOT):
    """The lesson at `path` in `lang` (a copy; the English itself for "en")."""
    nb = read(path)
    if lang == "en":
        return nb
    return po.translate(nb, po.load(po.po_path(Path(path), lang, root), lang), code_strings=True)


def translated_solution(path: Path, lang: str, root: Path = ROOT):
    """The solution notebook at `path` as an nbgrader source notebook in `lang` (markdown translated)."""
    nb = make_source(read(path), Path(path).name)
    if lang == "en":
        return nb
    return po.translate(nb, po.load(po.po_path(Path(path), lang, root), lang), code_strings=False)


def write_course(root: str | Path = ROOT, lang: str = "zh_CN", dest: str | Path | None = None) -> Path:
    """Write the whole course in `lang` under `dest` (the same folder layout as the repository); returns dest."""
    root, lang = Path(root), normalize(lang) or "en"
    dest = Path(dest)
    (dest / "lessons").mkdir(parents=True, exist_ok=True)
    (dest / "exercises" / "solutions").mkdir(parents=True, exist_ok=True)
    for path in sorted((root / "lessons").glob("*.ipynb")):
        _write(dest / "lessons" / path.name, dumps(translated_lesson(path, lang, root)))
    for path in sorted((root / "exercises" / "solutions").glob("*.ipynb")):
        source = translated_solution(path, lang, root)
        _write(dest / "exercises" / "solutions" / path.name, dumps(source))
        _write(dest / "exercises" / path.name, dumps(make_exercise(source, path.name)))
    glossary = root / "translations" / "GLOSSARY.md"
    if glossary.is_file():
        shutil.copyfile(glossary, dest / "GLOSSARY.md")
    return dest


def _write(path: Path, text: str) -> None:
    if not (path.exists() and path.read_text(encoding="utf-8") == text):
        path.write_text(text, encoding="utf-8")
