"""The prose of a notebook in another language: one PO file per notebook, keyed by nbformat cell id.

For ``lessons/02_data_parallel.ipynb`` the Chinese lives in ``translations/zh_CN/lessons/02_data_parallel.po``;
for the exercise ``exercises/02_ddp.ipynb`` (and its solution, which shares its cell ids) in
``translations/zh_CN/exercises/02_ddp.po``. Each entry is

    msgctxt "l02-05"                   the cell's id (nbformat 4.5)
    msgid   "Replayed from the trace..." the English cell, whole
    msgstr  "根据第二次更新的 trace 回放..."

and, for a lesson, one entry per **display string** of a code cell: a string literal that holds words (a
printed sentence, a figure title; `_is_display`), its ``msgid`` the literal as written
(``f"{n} ranks sent {mb:.2f} MB"``), its ``msgstr`` the literal to put there instead
(``f"{n} 个 rank 共发送 {mb:.2f} MB"``, the same fields, checked), or the same literal where it must stay (a trace label the code looks up). The Chinese notebook is the English one
with those replacements: the same code, cells, ids and nbgrader metadata. Exercises translate their markdown
only, so that every graded and solution cell, with its checksum, is the English one.

`update` merges the current notebook into its PO file as gettext's ``msgmerge`` does: an entry whose English
changed keeps its old translation marked *fuzzy* with the old English as ``#| msgid``, and counts as stale until
a translator redoes it. `translate` applies a catalogue; `problems` lists what is missing or stale, by notebook
and cell id.
"""
from __future__ import annotations

import ast
import copy
import difflib
import functools
import io
import re
import tokenize
from pathlib import Path

__all__ = ["po_path", "course_sources", "entries", "cell_docstring", "docstring_translation", "DOCSTRING", "update",
           "load", "fill", "translate", "problems", "check_literal", "display_strings"]

#: a word a person reads: three letters or more
_WORD = re.compile(r"[A-Za-z]{3,}")
#: text that is a key, not prose: one token of identifier characters ("forward", "plotly_white", "tp-pp")
_KEYLIKE = re.compile(r"[\w.\-+/:%<>=*]*")


def _is_display(literal: str) -> bool:
    """A string literal holds text for a person: a word of three letters or more in more than one
    identifier-like token (a sentence, a title, a label with a space or punctuation), its fields left out."""
    node = ast.parse(literal, mode="eval").body
    if isinstance(node, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else "" for v in node.values)
    else:
        text = node.value if isinstance(node.value, str) else ""
    words = re.sub(r"<[^<>]*>", " ", text)                    # "memory</sup>": a title's end, in HTML
    return bool(_WORD.search(words)) and (words != text or not _KEYLIKE.fullmatch(text.strip()))


def po_path(notebook: Path, lang: str, root: Path) -> Path:
    """Where the translation of `notebook` (a lesson, an exercise or its solution) lives."""
    kind = "lessons" if notebook.parent.name == "lessons" else "exercises"
    return Path(root) / "translations" / lang / kind / (notebook.stem + ".po")


def course_sources(root: Path) -> list[Path]:
    """The notebooks that carry prose: every lesson and every exercise solution (an exercise's own cells are
    its solution's)."""
    root = Path(root)
    return sorted((root / "lessons").glob("*.ipynb")) + sorted((root / "exercises" / "solutions").glob("*.ipynb"))


def _docstring_lines(source: str) -> set[int]:
    """Line numbers where a docstring starts (a student reads those as code, in English)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            out.add(body[0].lineno)
    return out


def _string_tokens(source: str):
    """(start, end, text) of every string literal token of `source`, or [] where it does not tokenize."""
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return []
    return [(t.start, t.end, t.string) for t in toks if t.type == tokenize.STRING]


def display_strings(source: str) -> list[str]:
    """The display strings of a code cell, in order, each once."""
    skip = _docstring_lines(source)
    out: list[str] = []
    for start, _end, text in _string_tokens(source):
        if start[0] in skip or text in out:
            continue
        if _is_display(text):
            out.append(text)
    return out


#: the context suffix of a code cell's docstring: an exercise's graded cell says what it checks in one, and
#: `parlab grade` shows that sentence in its feedback (translated there; the cell itself keeps its code)
DOCSTRING = ":docstring"


def cell_docstring(source: str) -> str | None:
    """What a code cell says it does: the text of the docstring it opens with (``parlab grade``'s rule)."""
    return source.split('"""')[1].strip() if source.startswith('"""') else None


def entries(nb, code_strings: bool) -> list[tuple[str, str]]:
    """[(cell id, English)] of a notebook: each non-empty markdown cell, and each display string of each code
    cell (`code_strings`: a lesson) or else each code cell's docstring (an exercise's graded cells, under the
    context ``ID:docstring``)."""
    out = []
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.strip():
            out.append((cell.id, cell.source))
        elif cell.cell_type == "code" and code_strings:
            out += [(cell.id, s) for s in display_strings(cell.source)]
        elif cell.cell_type == "code" and cell_docstring(cell.source):
            out.append((cell.id + DOCSTRING, cell_docstring(cell.source)))
    return out


@functools.lru_cache(maxsize=64)
def _catalog(path: str, mtime: float, lang: str):
    return load(Path(path), lang)


def docstring_translation(root: Path, lang: str, exercise: str, cell_id: str, english: str) -> str:
    """`english`, the docstring of cell `cell_id` of exercise `exercise`, in `lang` (itself where there is no
    current translation, or for English)."""
    if lang == "en":
        return english
    path = po_path(Path(root) / "exercises" / f"{exercise}.ipynb", lang, root)
    if not path.is_file():
        return english
    m = _lookup(_catalog(str(path), path.stat().st_mtime, lang), cell_id + DOCSTRING, english)
    return m.string if m is not None else english


def load(path: Path, lang: str = "zh_CN"):
    """The Babel Catalog in `path` (an empty one for `lang` when the file does not exist yet)."""
    from babel.messages.catalog import Catalog
    from babel.messages.pofile import read_po
    path = Path(path)
    if not path.is_file():
        return Catalog(locale=lang, project="parlab", fuzzy=False)
    with path.open("rb") as f:
        catalog = read_po(f, locale=lang)
    for m in catalog:            # Babel 2.x reads gettext's "#| msgid" (the previous English) as a comment
        previous = [c[1:].strip() for c in m.user_comments if c.startswith("|")]
        if previous:
            from babel.messages.pofile import denormalize
            m.user_comments = [c for c in m.user_comments if not c.startswith("|")]
            m.previous_id = [denormalize("\n".join([previous[0].removeprefix("msgid").strip(), *previous[1:]]))]
    return catalog


def _save(catalog, path: Path) -> None:
    from babel.messages.pofile import write_po
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    # width 0: no wrapping, one PO line per line of the cell, so a diff shows what a translator changed
    write_po(buf, catalog, width=0, omit_header=False, sort_output=False, include_previous=True,
             include_lineno=False)
    path.write_bytes(buf.getvalue())


def update(notebook: Path, lang: str, root: Path, write: bool = True):
    """Merge the notebook's current English into its PO file (msgmerge's rule) and return the catalogue:
    new cells get an empty entry, an English that changed keeps its translation as fuzzy with the previous
    English, cells that are gone are dropped (git keeps them)."""
    from babel.messages.catalog import Catalog
    import nbformat
    nb = nbformat.read(notebook, as_version=4)
    path = po_path(notebook, lang, root)
    old = load(path, lang)
    by_context: dict[str, list] = {}
    for m in old:
        if m.id:
            by_context.setdefault(m.context, []).append(m)
    new = Catalog(locale=lang, project="parlab", fuzzy=False)
    new.header_comment = (f"# {lang} translation of {notebook.parent.name}/{notebook.name}: one entry per cell "
                          f"(msgctxt = cell id).\n# Update with `parlab course i18n update`; "
                          f"see parlab/i18n/notebooks.py.")
    code_strings = notebook.parent.name == "lessons"
    current = entries(nb, code_strings)
    kept = set(current)
    for cell_id, english in current:
        same = old.get(english, context=cell_id)
        if same is not None:
            new.add(english, same.string, context=cell_id, flags=same.flags, previous_id=same.previous_id)
            continue
        # the English changed: the closest entry of this cell that is gone from the notebook keeps its old
        # translation for the translator, marked stale (msgmerge's fuzzy match, within one cell)
        gone = [m for m in by_context.get(cell_id, []) if m.string and (cell_id, m.id) not in kept
                and _same_kind(m.id, english)]
        best = max(gone, key=lambda m: difflib.SequenceMatcher(None, m.id, english).ratio(), default=None)
        if best is not None and difflib.SequenceMatcher(None, best.id, english).ratio() >= 0.5:
            new.add(english, best.string, context=cell_id, flags={"fuzzy"}, previous_id=best.id)
        else:
            new.add(english, "", context=cell_id)
    if write:
        _save(new, path)
    return new


def _same_kind(a: str, b: str) -> bool:
    """Two entries of one cell are the same text in two versions: both markdown (not literals) or both
    literals with the same prefix kind."""
    def kind(s):
        m = re.match(r"([rRbBuUfF]*)(['\"])", s)
        return ("lit", "f" in m.group(1).lower()) if m else ("md", False)
    return kind(a) == kind(b)


def fill(path: Path, translations: dict, lang: str = "zh_CN") -> int:
    """Write translations into the PO file at `path`: {cell id: markdown translation} and
    {(cell id, literal): replacement literal}. Clears the fuzzy mark of what it fills; returns how many it
    filled. Raises KeyError naming an id or literal the file does not hold (run `update` first)."""
    catalog = load(path, lang)
    n = 0
    for key, text in translations.items():
        cell_id, msgid = key if isinstance(key, tuple) else (key, None)
        hits = [m for m in catalog if m.context == cell_id and m.id and (msgid is None or m.id == msgid)
                and (msgid is not None or not re.match(r"[rRbBuUfF]*['\"]", m.id))]
        if len(hits) != 1:
            raise KeyError(f"{path.name}: {key!r} matches {len(hits)} entries (cell ids: "
                           f"{sorted({m.context for m in catalog if m.id})[:40]})")
        hits[0].string = text
        hits[0].flags.discard("fuzzy")
        hits[0].previous_id = []
        n += 1
    _save(catalog, path)
    return n


def _fields(literal: str) -> list[str] | None:
    """The replacement fields of an f-string literal (their source, sorted), [] for a plain string; None when
    `literal` is not one string literal."""
    try:
        node = ast.parse(literal.strip(), mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return sorted(re.findall(r"(?<!\{)\{[A-Za-z_][^{}]*\}(?!\})", node.value))   # str.format fields
    if isinstance(node, ast.JoinedStr):
        return sorted(ast.unparse(v) for v in node.values if isinstance(v, ast.FormattedValue))
    return None


def check_literal(english: str, translated: str) -> str | None:
    """Why `translated` cannot replace the literal `english` (not one literal, another kind, other fields),
    or None when it can."""
    want, got = _fields(english), _fields(translated)
    if got is None:
        return f"the translation is not one Python string literal: {translated[:80]!r}"
    if ("f" in re.match(r"[rRbBuUfF]*", english).group(0).lower()) != \
            ("f" in re.match(r"[rRbBuUfF]*", translated).group(0).lower()):
        return "the translation must keep the literal's kind (f-string or plain string)"
    if want != got:
        return f"the translation's fields {got} differ from the English's {want}"
    return None


def _lookup(catalog, cell_id: str, english: str):
    m = catalog.get(english, context=cell_id)
    return m if m is not None and m.string and "fuzzy" not in m.flags else None


def translate(nb, catalog, code_strings: bool = True):
    """A copy of `nb` with every translated markdown cell and display string replaced (what has no current
    translation stays English), its ``metadata.parlab.lang`` set to the catalogue's language."""
    out = copy.deepcopy(nb)
    for cell in out.cells:
        if cell.cell_type == "markdown" and cell.source.strip():
            m = _lookup(catalog, cell.id, cell.source)
            if m is not None:
                cell.source = m.string
        elif cell.cell_type == "code" and code_strings:
            cell.source = _replace_literals(cell, catalog)
    loc = catalog.locale          # Babel's Locale: zh_CN reads back as zh_Hans_CN; the course's code is zh_CN
    lang = f"{loc.language}_{loc.territory}" if loc is not None and loc.territory else "zh_CN"
    out.metadata.setdefault("parlab", {})["lang"] = lang
    return out


def _replace_literals(cell, catalog) -> str:
    wanted = set(display_strings(cell.source))
    if not wanted:
        return cell.source
    lines = cell.source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    pieces, last = [], 0
    for start, end, text in _string_tokens(cell.source):
        m = _lookup(catalog, cell.id, text) if text in wanted else None
        if m is None or m.string == text or check_literal(text, m.string):
            continue
        a, b = offsets[start[0] - 1] + start[1], offsets[end[0] - 1] + end[1]
        pieces += [cell.source[last:a], m.string]
        last = b
    return "".join(pieces) + cell.source[last:]


def problems(nb, catalog, name: str, code_strings: bool = True) -> list[str]:
    """What keeps `nb` from reading wholly in the catalogue's language: "NAME cell ID: missing|stale|..."."""
    out = []
    for cell_id, english in entries(nb, code_strings):
        m = catalog.get(english, context=cell_id)
        what = "markdown" if not re.match(r"[rRbBuUfF]*['\"]", english) else f"string {english[:50]!r}"
        what = "docstring (the check's name in parlab grade)" if cell_id.endswith(DOCSTRING) else what
        if m is None or not m.string:
            out.append(f"{name} cell {cell_id}: {what} missing")
        elif "fuzzy" in m.flags:
            out.append(f"{name} cell {cell_id}: {what} stale (the English changed; the old one is #| msgid)")
        elif what.startswith("string") and check_literal(english, m.string):
            out.append(f"{name} cell {cell_id}: {what}: {check_literal(english, m.string)}")
    return out
