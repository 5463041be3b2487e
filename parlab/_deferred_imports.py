"""A third-party import that costs every notebook two seconds, deferred until it is used.

A plotly figure shown in Jupyter loads plotly's renderers, which import nbformat, which imports jsonschema; since
jsonschema 4.25 that imports ``rfc3987_syntax`` (its IRI format check, the ``format-nongpl`` extra that
jupyter-events asks for), and rfc3987-syntax 1.1 compiles 38 Lark grammars at import: about 2.2 s of CPU in every
kernel, grader and ``parlab`` command, for a check that notebooks and plotly never make (nbformat validates with
draft 4, which has no IRI format). Upstream: python-jsonschema/jsonschema#1392 (the slowness) and #1521 (moving
to the lazily loading fork rfc3987-syntax2).

`defer_iri_grammars` puts a stand-in under that module's name before anything imports it: jsonschema takes the
stand-in's ``is_valid_syntax``, and the first call (or any other attribute asked of the module) imports the real
package and hands over to it, so every validation gives the answer the real module gives.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = ["defer_iri_grammars"]

_NAME = "rfc3987_syntax"


def defer_iri_grammars() -> None:
    """Install the stand-in, unless the real module is already imported or is not installed."""
    if _NAME in sys.modules or importlib.util.find_spec(_NAME) is None:
        return
    stand_in = types.ModuleType(_NAME, "Stand-in for rfc3987_syntax until it is used (parlab._deferred_imports).")

    def real() -> types.ModuleType:
        if sys.modules.get(_NAME) is stand_in:
            del sys.modules[_NAME]
            try:
                importlib.import_module(_NAME)
            except BaseException:
                sys.modules[_NAME] = stand_in
                raise
        return sys.modules[_NAME]

    def is_valid_syntax(term: str, value: str) -> bool:
        return real().is_valid_syntax(term, value)

    def attribute(name: str):                                      # PEP 562: anything else, from the real one
        if name.startswith("__"):                                  # import machinery probing (__path__, __file__)
            raise AttributeError(name)
        return getattr(real(), name)

    stand_in.is_valid_syntax = is_valid_syntax
    stand_in.__getattr__ = attribute
    sys.modules[_NAME] = stand_in
