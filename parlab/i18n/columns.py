"""Text tables that line up in Chinese too: pad by display width, not by characters.

Python's format widths (``f"{label:<34}"``) count characters, and a Chinese character takes two columns of a
monospaced terminal or of a CJK monospaced font (Unicode's East Asian Width: *wide* and *fullwidth* characters),
so a column after a Chinese label starts late by one column per character. `pad` counts columns instead::

    from parlab.i18n.columns import pad
    print(pad(_("schedule"), 20), pad(_("bubble"), 8, ">"))     # the same columns in English and in Chinese

`width` is the number of columns a string takes (combining marks take none); `pad` fills with spaces to a width,
aligned left ``"<"``, right ``">"`` or centred ``"^"`` as `format` does, and leaves a longer string as it is.
"""
from __future__ import annotations

import unicodedata

__all__ = ["width", "pad"]


def width(text: str) -> int:
    """Columns `text` takes in a monospaced font: 2 for East Asian wide and fullwidth characters, 0 for combining
    marks, 1 for the rest."""
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def pad(text, columns: int, align: str = "<") -> str:
    """`text` (any object, as `str` writes it) padded with spaces to `columns` display columns."""
    text = str(text)
    fill = max(0, columns - width(text))
    if align == ">":
        return " " * fill + text
    if align == "^":
        return " " * (fill // 2) + text + " " * (fill - fill // 2)
    if align != "<":
        raise ValueError(f"align is '<', '>' or '^', got {align!r}")
    return text + " " * fill
