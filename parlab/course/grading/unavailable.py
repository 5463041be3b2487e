"""Parlab's own answer made unavailable to the student's code while a check runs (`references`), for
`parlab.course.grading.guard`'s `graded` decorator.

Each target (``'module:function'``, ``'module:Class'``) refuses to run for the student, however it is reached:

* **in place**: a function's code is swapped (`_swap`), so every alias of it (a default argument, a
  ``functools.partial``, a dict, a private name, ``sys.modules``) runs the guard; a class has its constructor and
  every method swapped (an instance made before the check is refused too); an autograd Function its ``apply``,
  ``forward`` and ``backward``;
* **by its bytecode**: a copy of the code (``importlib.reload``, a freshly imported module, ``inspect.getsource`` +
  ``exec``, ``types.FunctionType``) is recognised when it runs, by a profile hook (`_copies_watched`) that
  compares each new code object's instructions, names and constants with the targets';
* **by the stack** (`student_call`): a call is the student's when student code (outside parlab and the Python
  installation: a notebook cell, a test, exec'd code) stands between it and the check, so the grader computing
  its reference passes while parlab code called by the student (a wrapper, a subclass) does not.

The data-moving collectives of ``torch.distributed`` are also refused to code outside parlab (`_block_untraced`):
they would bypass ``parlab.comm``'s trace, which the checks read. Every refusal is recorded in a file (`_Usage`),
so catching the exception does not help, in forked ranks either.

In-process Python can always be subverted (exercises/README.md says what is and is not covered). Recognising a
copy by a normalised form of its code is what plagiarism detectors do (MOSS; Schleimer, Wilkerson and Aiken,
"Winnowing", SIGMOD 2003); here the match is exact, on CPython bytecode.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import tempfile
import types
from pathlib import Path

from parlab.i18n import _
from parlab.course.grading.codeid import _fingerprint, _key, student_cells, student_namespaces

__all__ = ["ReferenceUsed", "references", "student_call", "student_namespaces", "student_cells", "PARLAB_DIR",
           "UNTRACED_PREFIX"]

PARLAB_DIR = str(Path(__file__).resolve().parents[2]) + os.sep         # .../parlab/


class ReferenceUsed(BaseException):
    """Raised by a reference stub. A BaseException, so `except Exception` in student code does not hide it
    (and the call is recorded anyway)."""


# ---------------------------------------------------------------------- parlab's answer made unavailable
GUARD_FILE = str(Path(__file__).resolve().with_name("guard.py"))   # where `graded` runs checks
THIS_FILE = str(Path(__file__).resolve())
_LIBRARY = tuple(p for p in {str(f(p)).rstrip(os.sep) + os.sep
                              for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.__file__))
                              for f in (Path, lambda q: Path(q).resolve())}
                 if p != os.sep)          # a Python installed at / would otherwise make every file a library's
_GENERATED = ("parlab", "torch", "dataclasses", "collections", "typing")   # modules whose code may be exec'd
#: the data-moving collectives of torch.distributed: called from student code they bypass parlab.comm's trace
UNTRACED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
            "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend",
            "irecv", "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "gather_object",
            "scatter_object_list", "send_object_list", "recv_object_list", "all_reduce_coalesced")
UNTRACED_PREFIX = "torch.distributed."


def _resolve(target: str):
    """'parlab.parallel.topology:ParallelGrid.groups' -> (owner object, attribute name, original value)."""
    import importlib
    mod, _sep, path = target.partition(":")
    owner = importlib.import_module(mod)
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    return owner, attr, getattr(owner, attr)


def _from_parlab(frame) -> bool:
    f = frame.f_code.co_filename
    return f.startswith(PARLAB_DIR)


def _is_check_entry(frame) -> bool:
    return frame.f_code.co_filename == GUARD_FILE and frame.f_code.co_name == "run_check"


def student_call(frame) -> bool:
    """Does student code stand between `frame` (the caller of a guarded function) and the check running it?
    Walks up the stack to the `graded` wrapper: parlab's own frames and library frames (torch, the standard
    library, IPython) are looked through; any other frame (a notebook cell, a test, exec'd code) is the student's.
    So the grader computing its reference passes, while student code calling parlab's answer, directly or through
    another parlab function (a wrapper, a subclass, an autograd Function), fails."""
    while frame is not None:
        if _is_check_entry(frame):
            return False
        f = frame.f_code.co_filename
        if f.startswith("<") and not f.startswith("<frozen"):           # exec'd: a dataclass __init__, or a cheat
            if str(frame.f_globals.get("__name__", "")).split(".")[0] not in _GENERATED:
                return True
        elif not (f.startswith(PARLAB_DIR) or f.startswith(_LIBRARY) or f.startswith("<frozen")):
            return True
        frame = frame.f_back
    return False


class _Usage:
    """Where stubs record a call: a file, so forked ranks' calls are seen by the parent too."""

    def __init__(self):
        fd, self.path = tempfile.mkstemp(prefix="parlab-guard-")
        os.close(fd)
        self.originals: dict[int, str] = {}         # id of a guarded function or class -> its name
        self.classes: dict[type, str] = {}          # guarded classes (a subclass handed in counts as the class)
        self.added: set[str] = set()
        self.watch: dict[tuple, str] = {}           # fingerprints of the guarded code (`_watched`)
        self.keys: set = set()

    def add(self, name: str) -> None:
        if name in self.added:                      # once per process is enough (a copy called in a loop)
            return
        self.added.add(name)
        with open(self.path, "a") as f:
            f.write(name + "\n")

    def names(self) -> list[str]:
        try:
            return sorted(set(Path(self.path).read_text().split()))
        except OSError:
            return []

    def handed_in(self, obj) -> str | None:
        """The guarded name if `obj` is parlab's answer itself, handed to the check as the student's: the
        function or class, a functools.partial of it, a subclass, or a copy of its code (fingerprint)."""
        while isinstance(obj, functools.partial):
            obj = obj.func
        obj = getattr(obj, "__func__", obj)                                 # a bound method
        if id(obj) in self.originals:
            return self.originals[id(obj)]
        if isinstance(obj, type):
            found = next((n for c, n in self.classes.items() if issubclass(obj, c)), None)
            fns = [getattr(v, "__func__", v) for v in vars(obj).values()]
        else:
            found, fns = None, [obj]
        for fn in fns:
            with contextlib.suppress(ValueError):
                fn = inspect.unwrap(fn)
            if found is None and isinstance(fn, types.FunctionType) and _key(fn.__code__) in self.keys:
                found = self.watch.get(_fingerprint(fn.__code__))
        return found

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _refuse(name: str, usage: _Usage):
    usage.add(name)
    if name.startswith(UNTRACED_PREFIX):
        raise ReferenceUsed(_("you called {name} directly; communicate through parlab.comm so that it is traced")
                            .format(name=name))
    raise ReferenceUsed(_("you called parlab's {name}; write your own").format(name=name))


def _stub(original, name: str, usage: _Usage, direct: bool = False):
    """A wrapper around `original` that refuses student callers (`direct`: judge only the immediate caller)."""
    @functools.wraps(original)
    def stub(*args, **kwargs):
        caller = sys._getframe(1)
        if (not _from_parlab(caller)) if direct else student_call(caller):
            _refuse(name, usage)
        return original(*args, **kwargs)
    stub.__parlab_stub__ = original
    return stub


_SWAPPED: dict[int, tuple] = {}                 # key -> (a copy running the original code, name, usage)
_STUB_CODES: set = set()


def _dispatch(key: int, args, kwargs):
    """Body of a swapped function: refuse a student caller, else run the original code."""
    original, name, usage = _SWAPPED[key]
    if student_call(sys._getframe(2)):          # 0: here, 1: the swapped function, 2: its caller
        _refuse(name, usage)
    return original(*args, **kwargs)


def _stub_code(fn: types.FunctionType, key: int) -> types.CodeType:
    """Code for `fn` that calls `_dispatch(key, ...)`; it has as many free variables as fn's (Python requires it)."""
    free = [f"_free{i}" for i in range(len(fn.__code__.co_freevars))]
    src = ("def outer():\n" + "".join(f"    {v} = None\n" for v in free)
           + "    def stub(*args, **kwargs):\n"
           + (f"        if args is None:\n            ({', '.join(free)},)\n" if free else "")
           + "        import sys\n"
           + f"        return sys.modules['parlab.course.grading.unavailable']._dispatch({key}, args, kwargs)\n"
           + "    return stub\n")
    ns: dict = {}
    exec(compile(src, THIS_FILE, "exec"), ns)                              # noqa: S102  (a fixed template)
    code = ns["outer"]().__code__
    return code.replace(co_name=fn.__code__.co_name, co_qualname=fn.__code__.co_qualname)


def _swap(fn: types.FunctionType, name: str, usage: _Usage, undo: list) -> None:
    """Guard `fn` in place by swapping its code: every alias of it (a default argument, a partial, a list, a
    private name) runs the guard; `undo` puts the original code back."""
    if fn.__code__ in _STUB_CODES:                                          # already guarded (a nested check)
        return
    code = fn.__code__
    copy_ = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy_.__kwdefaults__ = fn.__kwdefaults__
    copy_.__qualname__ = fn.__qualname__
    copy_.__dict__.update(fn.__dict__)
    key = id(fn)
    _SWAPPED[key] = (copy_, name, usage)
    stub = _stub_code(fn, key)
    _STUB_CODES.add(stub)
    fn.__code__ = stub

    def restore(fn=fn, code=code, stub=stub, key=key):
        fn.__code__ = code
        _STUB_CODES.discard(stub)
        _SWAPPED.pop(key, None)
    undo.append(restore)


def _set_attr(owner, attr: str, value, undo: list) -> None:
    had = attr in vars(owner)
    old = vars(owner).get(attr)
    setattr(owner, attr, value)
    undo.append(lambda: setattr(owner, attr, old) if had else delattr(owner, attr))


def _guard_class(cls: type, short: str, usage: _Usage, undo: list) -> None:
    """A class: its constructor; an autograd Function: its apply, forward and backward."""
    usage.classes[cls] = short
    import torch
    if issubclass(cls, torch.autograd.Function):
        apply = getattr(cls.apply, "__func__", None)           # torch's classmethod, bound at each call
        if apply is not None:
            _set_attr(cls, "apply", classmethod(_stub(apply, short, usage)), undo)
        for meth in ("forward", "backward"):
            fn = vars(cls).get(meth)
            fn = getattr(fn, "__func__", fn)
            if isinstance(fn, types.FunctionType):
                _swap(fn, short, usage, undo)
        return
    init = vars(cls).get("__init__")
    if not isinstance(init, types.FunctionType):
        _set_attr(cls, "__init__", _stub(cls.__init__, short, usage), undo)
    for value in list(vars(cls).values()):      # the constructor and every method: an instance made before the
        fn = getattr(value, "__func__", value)  # check (or a bare object.__new__) is refused too
        if isinstance(fn, types.FunctionType):
            _swap(fn, short, usage, undo)


def _block_untraced(usage: _Usage, namespaces, undo: list) -> None:
    """torch.distributed's collectives, called from outside parlab, fail (they would bypass the trace)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    for op in UNTRACED:
        original = getattr(dist, op, None)
        if original is None or getattr(original, "__parlab_stub__", None) is not None:
            continue
        stub = _stub(original, UNTRACED_PREFIX + op, usage, direct=True)
        _set_attr(dist, op, stub, undo)
        for ns in namespaces:
            for key, value in list(ns.items()):
                if value is original:
                    ns[key] = stub
                    undo.append(lambda ns=ns, key=key, original=original: ns.__setitem__(key, original))


def _watched(targets) -> dict[tuple, str]:
    """fingerprint -> name, for the code of every guarded function (a class: its constructor or its autograd
    forward and backward)."""
    out = {}
    for target in targets:
        _owner, _attr, original = _resolve(target)
        short = target.split(":")[1]
        fns = [original]
        if isinstance(original, type):          # its methods, but not the trivial ones a student's may equal
            fns = [f for k, f in ((k, getattr(v, "__func__", v)) for k, v in vars(original).items())
                   if isinstance(f, types.FunctionType)
                   and (k in ("__init__", "forward", "backward") or len(f.__code__.co_code) >= 60)]
        for fn in fns:
            fn = getattr(fn, "__func__", fn)
            with contextlib.suppress(ValueError):                   # a decorator's wrapper: the function inside
                fn = inspect.unwrap(fn)
            if (isinstance(fn, types.FunctionType) and fn.__code__ not in _STUB_CODES
                    and fn.__code__.co_filename.startswith(PARLAB_DIR)):   # not torch's shared wrapper code
                out[_fingerprint(fn.__code__)] = short
    return out


@contextlib.contextmanager
def _copies_watched(watch: dict, usage: _Usage):
    """A profile hook (this thread, and the ranks forked from it) that records any run of code equal to a guarded
    function's, called from student code: copies the code swap cannot reach (importlib.reload, exec of the
    source, types.FunctionType). The copy runs, but the check fails."""
    if not watch:
        yield
        return
    seen: dict[int, tuple] = {}
    keys = {fp[0] for fp in watch}

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        hit = seen.get(id(code))
        if hit is None or hit[0] is not code:
            hit = seen[id(code)] = (code, watch.get(_fingerprint(code)) if _key(code) in keys else None)
        if hit[1] is not None and student_call(frame.f_back):
            usage.add(hit[1])

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(old)


@contextlib.contextmanager
def references(targets, namespaces=(), cells=()):
    """While inside, each target ('module:name' or 'module:Class.method'; a class means its constructor, an
    autograd Function its apply, forward and backward) is unavailable to student code (`student_call`), however
    it is reached: the function's code is swapped in place, so every alias of it is guarded too. The data-moving
    collectives of torch.distributed are unavailable to code outside parlab (use parlab.comm, which is traced).
    `namespaces` (dicts) are searched for aliases of those collectives; `cells` is kept for compatibility.
    Yields the usage record (`.names()`, `.handed_in(obj)`)."""
    usage = _Usage()
    undo: list = []
    watch = _watched(targets)
    usage.watch, usage.keys = watch, {fp[0] for fp in watch}
    try:
        for target in targets:
            owner, attr, original = _resolve(target)
            short = target.split(":")[1]
            usage.originals[id(original)] = short
            if isinstance(original, type):
                _guard_class(original, short, usage, undo)
            elif isinstance(original, types.FunctionType):
                _swap(original, short, usage, undo)
            else:                                                           # a bound or builtin method
                _set_attr(owner, attr, _stub(original, short, usage), undo)
        _block_untraced(usage, [ns for ns in namespaces if isinstance(ns, dict)], undo)
        with _copies_watched(watch, usage):
            yield usage
    finally:
        for u in reversed(undo):
            u()
        usage.close()
