"""Which language parlab speaks: an explicit choice, else ``PARLAB_LANG``, else the locale, else English.

The language is a property of the process, like the locale it follows (gettext's rule: ``LANGUAGE``, ``LC_ALL``,
``LC_MESSAGES``, ``LANG``, the first one set). ``parlab course open --lang zh`` starts JupyterLab with
``PARLAB_LANG=zh_CN``, so every kernel it starts, and every rank a kernel forks, prints and draws in Chinese;
``parlab grade --lang zh`` does the same for the kernels that grade. `set_language` overrides both inside one
process (a notebook cell, a test); `use_language` does it for a ``with`` block.
"""
from __future__ import annotations

import contextlib
import os

__all__ = ["LANGUAGES", "normalize", "language", "set_language", "use_language"]

#: the course's languages: code -> its own name
LANGUAGES = {"en": "English", "zh_CN": "简体中文"}
_chosen: str | None = None


def normalize(code: str | None) -> str | None:
    """"zh", "zh-CN", "zh_CN.UTF-8", "zh-Hans" -> "zh_CN"; "en", "en_US.UTF-8", "C", "POSIX" -> "en"; "" or
    None -> None. Raises ValueError for a language the course does not have, naming the ones it has."""
    if not code:
        return None
    base = code.split(".")[0].split("@")[0].replace("-", "_")
    low = base.lower()
    if low.startswith("zh"):
        if low in ("zh", "zh_cn", "zh_hans", "zh_sg", "zh_hans_cn"):
            return "zh_CN"
        raise ValueError(f"language {code!r}: the course has Simplified Chinese (zh_CN), not {base}; "
                         f"choose one of {', '.join(LANGUAGES)}")
    if low in ("c", "posix") or low.startswith("en"):
        return "en"
    raise ValueError(f"language {code!r} is not one of the course's: {', '.join(LANGUAGES)} "
                     f"(zh, zh-CN and zh_CN all mean Simplified Chinese)")


def _from_locale() -> str:
    for var in ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        value = os.environ.get(var, "")
        if value:
            first = value.split(":")[0]        # LANGUAGE may list several: zh_CN:en
            try:
                return normalize(first) or "en"
            except ValueError:
                return "en"                    # a locale the course does not speak (de_DE): English
    return "en"


def language() -> str:
    """The language in force now: "en" or "zh_CN"."""
    if _chosen:
        return _chosen
    env = os.environ.get("PARLAB_LANG", "")
    if env:
        try:
            return normalize(env) or "en"
        except ValueError:
            return "en"         # the CLI refuses a bad PARLAB_LANG with its reason (cli.py); printing stays English
    return _from_locale()


def set_language(code: str | None) -> None:
    """Speak `code` ("en", "zh", "zh_CN", ...) in this process from now on; None goes back to PARLAB_LANG and
    the locale."""
    global _chosen
    _chosen = normalize(code)


@contextlib.contextmanager
def use_language(code: str | None):
    """``with use_language("zh"): ...``: the language for a block, the previous one restored after it."""
    global _chosen
    before = _chosen
    set_language(code)
    try:
        yield
    finally:
        _chosen = before
