"""What a translation must keep: every number of the English, and no English sentence left behind.

Pure text checks (no notebook, no catalogue), used by ``parlab course i18n check`` and tests/test_i18n.py:

* `lost_numbers`: the numbers of the English text (``18186``, ``0.25``, ``2(N-1)/N``'s 2 and 1) that the
  translation does not contain. A translation may add numbers ("two ranks" -> "2 个 rank"), never drop one.
* `broken_lines`: a line break between two Chinese characters outside code and math. A browser draws it as a
  space in the middle of a sentence ("大多 位于"), so Chinese paragraphs are not wrapped the way English ones are.
* `english_left`: runs of four or more English words in the translation outside code (fenced and inline),
  math (``$...$``, ``$$...$$``), link targets, HTML tags, quotations (a paper's title stays in English, quoted)
  and the glossary's English terms: what a reader would see as an untranslated sentence.
"""
from __future__ import annotations

import re
from pathlib import Path

__all__ = ["numbers", "lost_numbers", "english_left", "glossary_terms", "broken_lines"]

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def numbers(text: str) -> set[str]:
    """The numbers in `text`, thousands separators dropped ("18,186" -> "18186")."""
    out = set()
    for n in _NUMBER.findall(text):
        if re.fullmatch(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?", n):
            n = n.replace(",", "")
        out |= set(re.split(r",", n)) if re.search(r",\d{1,2}(?!\d)|,\d{4,}", n) else {n}
    return {n for n in out if n}


def lost_numbers(english: str, translated: str) -> list[str]:
    """Numbers of `english` missing from `translated`, sorted."""
    have = numbers(translated)
    return sorted(n for n in numbers(english) if n not in have)


_STRIP = [
    re.compile(r"```.*?```", re.S),             # fenced code
    re.compile(r"\$\$.*?\$\$", re.S),           # display math
    re.compile(r"\$[^$\n]+\$"),                  # inline math
    re.compile(r"`[^`\n]+`"),                    # inline code
    re.compile(r"\]\([^)]*\)"),                  # a link's target
    re.compile(r"<[^>\n]+>"),                    # HTML tags
    re.compile(r"https?://\S+"),                 # bare URLs
    re.compile(r"\"[^\"\n]+\""),                 # "a quoted title"
    re.compile(r"“[^”\n]+”"),                    # “引号中的标题”
    re.compile(r"\{[^{}\n]*\}"),                 # an f-string's fields
]
_RUN = re.compile(r"[A-Za-z][A-Za-z'’-]*(?:[ \t]+[A-Za-z][A-Za-z0-9'’-]*){3,}")


def glossary_terms(path: Path) -> list[str]:
    """The English column of the glossary table (``translations/GLOSSARY.md``), longest first, each term also
    without its parenthesised abbreviation."""
    terms: set[str] = set()
    if Path(path).is_file():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("|") and len(cells) >= 2 and cells[0] not in ("English", "---"):
                for part in re.split(r"\s*/\s*", cells[0]):
                    terms.add(part)
                    terms.add(re.sub(r"\s*\(.*?\)", "", part))
    return sorted((t for t in terms if t), key=len, reverse=True)


def english_left(translated: str, terms: list[str] = ()) -> list[str]:
    """The runs of four or more English words `translated` still holds as prose."""
    text = translated
    for pattern in _STRIP:
        text = pattern.sub(" ", text)
    for term in terms:
        text = re.sub(re.escape(term), " ", text, flags=re.I)
    return [m.group(0) for m in _RUN.finditer(text)]


_CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef"      # CJK punctuation, ideographs, full-width forms
_BREAK = re.compile(f"([{_CJK}])\n(?![ \t]*(?:[-*+>|#]|\\d+\\.|\\$\\$))[ \t]*([{_CJK}])")


def broken_lines(translated: str) -> list[str]:
    """The places (a few characters either side) where a line break splits a Chinese sentence."""
    text = _STRIP[0].sub(" ", translated)               # fenced code
    text = _STRIP[1].sub(" ", text)                     # display math
    return [m.group(0).replace("\n", "⏎") for m in _BREAK.finditer(text)]
