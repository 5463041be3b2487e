"""Recognising code for the grader: a function's bytecode fingerprint, and what a student's code can see.

* `_fingerprint`: what a copy of a function keeps wherever it was compiled (``importlib.reload``, ``exec`` of
  ``inspect.getsource``, ``types.FunctionType``): its normalised instructions, names and constants. Recognising a
  copy by a normalised form of its code is what plagiarism detectors do (MOSS; Schleimer, Wilkerson and Aiken,
  "Winnowing", SIGMOD 2003); here the match is exact, on CPython bytecode (``dis``).
* `student_cells`, `student_namespaces`: the closure cells and global namespaces a student's function or class
  sees, searched by `parlab.course.grading.unavailable` for aliases of guarded functions.
"""
from __future__ import annotations

import sys
import types

__all__ = ["student_cells", "student_namespaces"]


_SKIP_OPS = {"CACHE", "PRECALL", "PUSH_NULL", "RESUME", "NOP", "EXTENDED_ARG", "KW_NAMES"}


def _key(code: types.CodeType) -> tuple:
    """A cheap first filter: the names a function uses."""
    return (code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount)


def _fingerprint(code: types.CodeType) -> tuple:
    """What a copy of a function keeps, wherever it was compiled (importlib.reload, exec of inspect.getsource,
    types.FunctionType): its instructions (method calls normalised: the compiler may emit LOAD_METHOD or
    LOAD_ATTR for the same source), names and constants (the docstring included, so that a student's own
    function written the same natural way is not taken for a copy), nested functions included; not the file,
    the line numbers or the qualified name."""
    import dis
    ops = []
    for ins in dis.get_instructions(code):
        if ins.opname in _SKIP_OPS:
            continue
        name = "LOAD_ATTR" if ins.opname == "LOAD_METHOD" else ins.opname
        arg = ins.argrepr.replace("NULL + ", "").replace(" + NULL", "") if isinstance(ins.argrepr, str) else ""
        if isinstance(ins.argval, types.CodeType):
            arg = _fingerprint(ins.argval)
        elif "JUMP" in name or name.startswith(("POP_JUMP", "FOR_ITER", "SEND")):
            arg = ""                                                # offsets shift with the instructions
        ops.append((name, arg))
    consts = tuple(repr(c) for c in code.co_consts if not isinstance(c, types.CodeType))   # the docstring too:
    return _key(code), tuple(ops), consts       # a student's own function that happens to match has another


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:                                          # an empty cell
        return None


def _functions(obj) -> list:
    """`obj` and, for a class, the functions defined in it (static and class methods unwrapped)."""
    if not isinstance(obj, type):
        return [obj]
    out = []
    for v in vars(obj).values():
        v = getattr(v, "__func__", v)
        if callable(v) and hasattr(v, "__code__"):
            out.append(v)
    return out


def student_cells(*objs) -> list:
    """The closure cells of a student's function or of the methods of a student's class."""
    return [c for obj in objs for f in _functions(obj) for c in (getattr(f, "__closure__", None) or ())]


def student_namespaces(*objs) -> list[dict]:
    """The global namespaces a student's function or class sees (a notebook's __main__)."""
    out = []
    for obj in objs:
        g = getattr(obj, "__globals__", None)
        if g is None and isinstance(obj, type):
            g = vars(sys.modules.get(obj.__module__, object)) if obj.__module__ in sys.modules else None
        if isinstance(g, dict) and all(g is not o for o in out):
            out.append(g)
    return out
