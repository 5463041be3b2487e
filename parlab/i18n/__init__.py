"""The course in two languages: English (the source) and Simplified Chinese (简体中文), from one source.

Two kinds of text are translated, each with the field's standard tool, gettext's PO files (Babel reads, updates
and compiles them; Poedit and Weblate open them):

    language.py    which language is in force: `set_language` > ``PARLAB_LANG`` > the locale (``LANGUAGE``,
                   ``LC_ALL``, ``LC_MESSAGES``, ``LANG``) > English; `normalize` ("zh", "zh-CN" -> "zh_CN")
    catalogue.py   what parlab itself prints and draws (figure titles, grading feedback, CLI messages): ``_()``
                   marks a message; ``locale/zh_CN/LC_MESSAGES/parlab.po`` beside this file holds its translation,
                   compiled in memory on first use (no .mo files in git); `runtime_messages` extracts every
                   ``_()`` of the package with Babel, so a test can require each one translated
    notebooks.py   the prose of the lessons and exercises: one PO file per notebook
                   (``translations/zh_CN/lessons/NN_topic.po``), each entry keyed by the nbformat cell id
                   (``msgctxt``), its ``msgid`` the English cell. A change to the English leaves the entry's
                   ``msgid`` behind, so the translation reads as stale (gettext's *fuzzy*, with the previous English
                   kept as ``#| msgid`` for the translator) until it is redone. Code cells are never duplicated:
                   a lesson's Chinese copy changes only the string literals its PO file lists (printed sentences,
                   figure titles), each checked to keep the f-string's fields.
    columns.py     text tables that line up in Chinese too: `pad` fills to a display width (a Chinese character
                   takes two columns of a monospaced font; format widths such as ``:<34`` count it as one)
    checks.py      what a translation must keep: every number of the English, no English sentence left
    args.py        the argument parser of every parlab command line (``parlab``, the labs, ``parlab grade``): the
                   error first, in the language in force, then where the usage is
    review.py      everything missing or stale, notebook by notebook and cell by cell
                   (``python -m parlab.i18n.review``, ``parlab course i18n check``)

Why PO and not a home-made JSON: the stale-marking (fuzzy + previous msgid), merging (``Catalog.update``) and
editing tools already exist and every translator knows them (d2l-zh translates whole files instead, and drifts).
"""
from parlab.i18n.catalogue import _, gettext, runtime_messages
from parlab.i18n.language import LANGUAGES, language, normalize, set_language, use_language

__all__ = ["_", "gettext", "runtime_messages", "LANGUAGES", "language", "normalize", "set_language",
           "use_language"]
