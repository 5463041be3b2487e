"""What parlab prints and draws, in the language in force: gettext's ``_()`` over a PO catalogue.

A message is marked where it is written, with named fields filled after the lookup, so that the translation may
put them in its own order::

    from parlab.i18n import _
    raise ValueError(_("world_size {world} is not divisible by tp*pp = {n}").format(world=w, n=tp * pp))

The translations live in ``locale/<lang>/LC_MESSAGES/parlab.po`` beside this file. Babel compiles the PO file
into gettext's binary form in memory on first use (so no generated ``.mo`` file is kept in git) and the standard
library's `gettext.GNUTranslations` looks messages up. A message with no current translation (missing, or
*fuzzy*: its English changed since it was translated) comes out in English. `runtime_messages` lists every
``_()`` in the package with Babel's Python extractor, the catalogue's template (``pybabel extract -k _``).
"""
from __future__ import annotations

import functools
import gettext as _gettext
import io
from pathlib import Path

from parlab.i18n.language import language

__all__ = ["_", "gettext", "LOCALE_DIR", "DOMAIN", "catalogue_path", "translations", "runtime_messages",
           "update_catalogue", "missing_messages"]

LOCALE_DIR = Path(__file__).resolve().parent / "locale"
DOMAIN = "parlab"
PACKAGE = Path(__file__).resolve().parents[1]


def catalogue_path(lang: str) -> Path:
    return LOCALE_DIR / lang / "LC_MESSAGES" / f"{DOMAIN}.po"


@functools.lru_cache(maxsize=None)
def translations(lang: str) -> _gettext.NullTranslations:
    """The compiled catalogue of `lang` (a NullTranslations, which returns the English, for "en" or when the
    catalogue or Babel is missing)."""
    path = catalogue_path(lang)
    if lang == "en" or not path.is_file():
        return _gettext.NullTranslations()
    try:
        from babel.messages.mofile import write_mo
        from babel.messages.pofile import read_po
    except ImportError:         # Babel is a dependency; without it the course stays readable, in English
        return _gettext.NullTranslations()
    with path.open("rb") as f:
        catalog = read_po(f)
    buf = io.BytesIO()
    write_mo(buf, catalog, use_fuzzy=False)     # a fuzzy (stale) translation is not used: the English is
    buf.seek(0)
    return _gettext.GNUTranslations(buf)


def gettext(message: str) -> str:
    """`message` in the language in force (the English itself where no current translation exists)."""
    return translations(language()).gettext(message)


_ = gettext


def runtime_messages(package: str | Path = PACKAGE) -> dict[str, list[str]]:
    """{message: ["parlab/viz/grid.py:42", ...]} for every ``_("...")`` under `package`, as Babel's
    ``pybabel extract -k _`` finds them."""
    from babel.messages.extract import extract_from_dir
    package = Path(package)
    out: dict[str, list[str]] = {}
    method_map = [("**.py", "python")]
    for filename, lineno, message, _comments, _context in extract_from_dir(
            str(package), method_map=method_map, keywords={"_": None}, comment_tags=(), strip_comment_tags=True):
        if isinstance(message, tuple):      # plural forms: the course has none yet
            message = message[0]
        out.setdefault(message, []).append(f"{package.name}/{filename}:{lineno}")
    return out


def update_catalogue(lang: str, package: str | Path = PACKAGE):
    """Merge the package's current messages into `lang`'s PO file (``pybabel update``: a new message gets an
    empty entry, a changed one keeps its old translation marked fuzzy, a gone one is dropped); returns the
    catalogue."""
    from babel.messages.catalog import Catalog
    from babel.messages.pofile import read_po, write_po
    template = Catalog(project="parlab")
    for message, where in runtime_messages(package).items():
        template.add(message, locations=[(w.rsplit(":", 1)[0], int(w.rsplit(":", 1)[1])) for w in where])
    path = catalogue_path(lang)
    if path.is_file():
        with path.open("rb") as f:
            catalog = read_po(f, locale=lang)
    else:
        catalog = Catalog(locale=lang, project="parlab", fuzzy=False)
    catalog.update(template)
    catalog.obsolete.clear()
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    write_po(buf, catalog, width=0, include_previous=True, sort_output=False, include_lineno=False)
    path.write_bytes(buf.getvalue())
    translations.cache_clear()
    return catalog


def missing_messages(lang: str, package: str | Path = PACKAGE) -> list[str]:
    """The package's messages with no current translation in `lang` ("where: message (missing|stale)")."""
    from babel.messages.pofile import read_po
    path = catalogue_path(lang)
    catalog = None
    if path.is_file():
        with path.open("rb") as f:
            catalog = read_po(f, locale=lang)
    out = []
    for message, where in runtime_messages(package).items():
        m = catalog.get(message) if catalog is not None else None
        if m is None or not m.string:
            out.append(f"{where[0]}: {message[:70]!r} missing")
        elif m.fuzzy:
            out.append(f"{where[0]}: {message[:70]!r} stale (its English changed)")
    return out
