"""Everything that keeps the course from reading wholly in one language, notebook by notebook and cell by cell.

    python -m parlab.i18n.review                        # every notebook of the course, in Chinese
    python -m parlab.i18n.review lessons/02_data_parallel.ipynb

For each notebook with prose (`notebooks.course_sources`): cells with no translation or a stale one
(`notebooks.problems`), a display string whose translation changed its fields, numbers the translation lost
(`checks.lost_numbers`), English sentences it kept (`checks.english_left`) and Chinese sentences split by a
line break (`checks.broken_lines`). ``parlab course i18n check``
prints the same and tests/test_i18n.py requires it empty.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from parlab.i18n import checks, notebooks

__all__ = ["review_notebook", "review", "counts"]


def review_notebook(notebook: Path, lang: str, root: Path) -> list[str]:
    import nbformat
    notebook = Path(notebook)
    nb = nbformat.read(notebook, as_version=4)
    catalog = notebooks.load(notebooks.po_path(notebook, lang, root), lang)
    code_strings = notebook.parent.name == "lessons"
    name = f"{notebook.parent.name}/{notebook.name}"
    out = notebooks.problems(nb, catalog, name, code_strings)
    terms = checks.glossary_terms(Path(root) / "translations" / "GLOSSARY.md")
    for cell_id, english in notebooks.entries(nb, code_strings):
        m = catalog.get(english, context=cell_id)
        if m is None or not m.string or "fuzzy" in m.flags or m.string == english:
            continue
        literal = bool(re.match(r"[rRbBuUfF]*['\"]", english))
        where = f"{name} cell {cell_id}" + (f" string {english[:40]!r}" if literal else "")
        # a literal's fields ({PSI:,}) are checked apart: its numbers are the text's, outside the fields
        strip = (lambda s: re.sub(r"\{[^{}]*\}", " ", s)) if literal else (lambda s: s)
        lost = checks.lost_numbers(strip(english), strip(m.string))
        if lost:
            out.append(f"{where}: numbers missing from the translation: {', '.join(lost)}")
        broken = [] if literal else checks.broken_lines(m.string)
        if broken:
            out.append(f"{where}: a line break inside a Chinese sentence (drawn as a space): {', '.join(broken[:4])}")
        left = checks.english_left(m.string, terms)
        if left:
            out.append(f"{where}: English left in the translation: {'; '.join(left[:3])}")
    return out


def review(root: Path, lang: str = "zh_CN", paths=None) -> dict[str, list[str]]:
    """{notebook: [problem, ...]} for the course (or `paths`), only notebooks with problems."""
    out = {}
    for nb in (paths or notebooks.course_sources(root)):
        found = review_notebook(Path(nb), lang, root)
        if found:
            out[str(nb)] = found
    return out


def counts(root: Path, lang: str = "zh_CN") -> dict[str, int]:
    """{"cells": prose cells, "translated": with a current translation, "stale": fuzzy, "strings": display
    strings, "strings_translated": ...} over the whole course."""
    import nbformat
    c = {"cells": 0, "translated": 0, "stale": 0, "strings": 0, "strings_translated": 0, "labels": 0,
         "labels_translated": 0}
    for path in notebooks.course_sources(root):
        nb = nbformat.read(path, as_version=4)
        catalog = notebooks.load(notebooks.po_path(path, lang, root), lang)
        for cell_id, english in notebooks.entries(nb, path.parent.name == "lessons"):
            kind = ("labels" if cell_id.endswith(notebooks.DOCSTRING) else
                    "strings" if re.match(r"[rRbBuUfF]*['\"]", english) else "cells")
            c[kind] += 1
            m = catalog.get(english, context=cell_id)
            if m is not None and m.string and "fuzzy" not in m.flags:
                c["translated" if kind == "cells" else f"{kind}_translated"] += 1
            elif m is not None and "fuzzy" in m.flags:
                c["stale"] += 1
    return c


def main(argv=None) -> int:
    from parlab.i18n.catalogue import PACKAGE
    root = PACKAGE.parent
    argv = sys.argv[1:] if argv is None else argv
    found = review(root, "zh_CN", [Path(a) for a in argv] or None)
    for nb, problems in found.items():
        print("\n".join(problems))
    n = sum(map(len, found.values()))
    print(f"{n} problem(s)" if n else "every cell translated, current and checked")
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main())
