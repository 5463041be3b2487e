"""What keeps a check honest: the student's own work is tested, and a failure reads as feedback.

Every ``check_*`` of `parlab.grading` is wrapped by `graded` (a decorator), which, each time the check runs:

* **verifies nothing was rebound** (`tampered`): the identities of the grading functions and of the parlab
  internals a check relies on (``parlab.launch.run``, ``parlab.comm``, ``parlab.trace``, ``torch.equal`` ...)
  are snapshotted when ``parlab.grading`` is imported; a check that finds one replaced fails as *tampered*;
* **makes parlab's own answer unavailable** (`references`): while it runs, parlab's implementation of the
  piece under test (``ParallelGrid`` in the group exercises, ``assign_buckets`` in the bucket exercise, ...)
  is replaced, in every parlab module and in the student's namespace, by a stub that lets parlab's own code
  through (a caller whose file lies inside the parlab package) and fails the check when student code calls
  it: "you called parlab's X; write your own". A call is also recorded in a file, so catching the stub's
  exception does not help, in forked ranks either;
* **draws fresh inputs** (`fresh_seed`): the seed comes from ``os.urandom`` at check time, so an answer
  precomputed from a public seed fails;
* **bounds CPU time** (`cpu_limit`): a runaway loop in the student's code is stopped by a CPU-time timer
  (SIGPROF, ``ITIMER_PROF``) and fails its own check, so the notebook goes on to the next cell;
* **renders failures briefly** (`CheckFailed`): the message (what, expected vs got, hint) is all Jupyter
  shows (``_render_traceback_``), the grader's frames are hidden; the full traceback is kept in the record
  that `graded` writes for ``parlab grade``.

In a kernel, a cell that still says ``raise NotImplementedError`` prints one line, "not written yet"
(`install_ipython_hooks`).

In-process Python can always be subverted by a determined student (the guard itself can be rebound);
exercises/README.md says what is protected and what a lecturer should do about the rest. The design follows
nbgrader's locked cells + checksums and otter-grader's separate grading run.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

__all__ = ["CheckFailed", "ReferenceUsed", "CpuTimeExceeded", "graded", "references", "fresh_seed", "cpu_limit",
           "protect", "tampered", "configure", "results", "install_ipython_hooks", "PARLAB_DIR", "not_written"]

PARLAB_DIR = str(Path(__file__).resolve().parent.parent) + os.sep       # .../parlab/
CPU_LIMIT = 60.0          # CPU seconds a student's code may use in one call (in process or per rank)
_STATE = {"cpu_limit": CPU_LIMIT, "results_path": None, "records": []}


# ---------------------------------------------------------------------- failures that read as feedback
class CheckFailed(AssertionError):
    """A check failed. In Jupyter only the message is shown (no grader frames); `kind` says how:
    'fail' (wrong answer), 'reference' (called parlab's answer), 'tampered', 'cpu' (runaway loop)."""

    def __init__(self, message: str, kind: str = "fail"):
        super().__init__(message)
        self.kind = kind

    def _render_traceback_(self) -> list[str]:        # IPython's hook: these lines replace the traceback
        lines = str(self).splitlines() or [""]
        return [f"\x1b[0;31mAssertionError\x1b[0m: {lines[0]}", *lines[1:],
                "(the grader's own traceback is hidden; `parlab grade` keeps it in the gradebook)"]


class ReferenceUsed(BaseException):
    """Raised by a reference stub. A BaseException, so `except Exception` in student code does not hide it
    (and the call is recorded anyway)."""


class CpuTimeExceeded(BaseException):
    """Raised by the CPU-time timer inside a runaway loop."""


def not_written(what: str) -> str:
    return f"{what} is not written yet: replace the `raise NotImplementedError` line with your code."


def install_ipython_hooks() -> None:
    """In IPython, show a `raise NotImplementedError` left in a cell as one line saying 'not written yet'."""
    ip = sys.modules.get("IPython") and getattr(sys.modules["IPython"], "get_ipython", lambda: None)()
    if ip is None or getattr(ip, "_parlab_hooks", False):
        return

    def handler(shell, etype, value, tb, tb_offset=None):
        where = ""
        for frame, line in traceback.walk_tb(tb):
            where = f" (line {line} of this cell)" if frame.f_code.co_filename.startswith(("<", "/tmp")) else where
        stb = [f"\x1b[0;31mNotImplementedError\x1b[0m: not written yet{where}: replace "
               f"`raise NotImplementedError` with your code."]
        shell._showtraceback(etype, value, stb)
        return stb

    ip.set_custom_exc((NotImplementedError,), handler)
    ip._parlab_hooks = True


# ---------------------------------------------------------------------- fresh inputs, CPU time
def fresh_seed() -> int:
    """A seed drawn at check time from the operating system; never a public constant."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def _cpu_handler(signum, frame):
    raise CpuTimeExceeded()


@contextlib.contextmanager
def cpu_limit(seconds: float | None = None):
    """Raise CpuTimeExceeded in this (main) thread once the process used `seconds` more CPU time.
    The timer re-fires every second, so a loop that catches it once is stopped again."""
    seconds = _STATE["cpu_limit"] if seconds is None else seconds
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGPROF, _cpu_handler)
    signal.setitimer(signal.ITIMER_PROF, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, old)


def cpu_message(what: str, seconds: float | None = None) -> str:
    seconds = _STATE["cpu_limit"] if seconds is None else seconds
    return (f"{what} used more than {seconds:g} s of CPU time and was stopped: a loop that never ends? "
            f"(A correct solution needs well under a second.) Check every loop's exit condition.")


# ---------------------------------------------------------------------- tamper detection
_SNAPSHOT: dict[tuple[str, str], object] = {}


def protect(module_name: str, names=None) -> None:
    """Remember the current identity of `names` (default: every public function and class) of a module."""
    mod = sys.modules[module_name]
    for name in names if names is not None else [n for n in vars(mod) if not n.startswith("__")]:
        obj = getattr(mod, name, None)
        if names is not None or callable(obj):
            _SNAPSHOT[(module_name, name)] = obj


def tampered() -> list[str]:
    """The protected names whose current value is not the one snapshotted at import."""
    bad = []
    for (mod, name), obj in _SNAPSHOT.items():
        now = getattr(sys.modules.get(mod), name, None)
        if now is not obj and getattr(now, "__parlab_stub__", None) is not obj:   # a guard's own stub is fine
            bad.append(f"{mod}.{name}")
    return bad


# ---------------------------------------------------------------------- parlab's answer made unavailable
def _resolve(target: str):
    """'parlab.topology:ParallelGrid.groups' -> (owner object, attribute name, original value)."""
    import importlib
    mod, _, path = target.partition(":")
    owner = importlib.import_module(mod)
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    return owner, attr, getattr(owner, attr)


def _from_parlab(frame) -> bool:
    f = frame.f_code.co_filename
    return f.startswith(PARLAB_DIR)


class _Usage:
    """Where stubs record a call: a file, so forked ranks' calls are seen by the parent too."""

    def __init__(self):
        fd, self.path = tempfile.mkstemp(prefix="parlab-guard-")
        os.close(fd)

    def add(self, name: str) -> None:
        with open(self.path, "a") as f:
            f.write(name + "\n")

    def names(self) -> list[str]:
        try:
            return sorted(set(Path(self.path).read_text().split()))
        except OSError:
            return []

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _stub(original, name: str, usage: _Usage):
    @functools.wraps(original)
    def stub(*args, **kwargs):
        if _from_parlab(sys._getframe(1)):
            return original(*args, **kwargs)
        usage.add(name)
        raise ReferenceUsed(f"you called parlab's {name}; write your own")
    stub.__parlab_stub__ = original
    return stub


@contextlib.contextmanager
def references(targets, namespaces=(), cells=()):
    """While inside, each target ('module:name' or 'module:Class.method'; a class means its constructor)
    is unavailable to code outside the parlab package: replaced in every parlab module, in `namespaces`
    (dicts) and in `cells` (closure cells of the student's functions). Yields the usage record (`.names()`,
    `.originals`)."""
    usage = _Usage()
    usage.originals = {}
    undo = []
    try:
        for target in targets:
            owner, attr, original = _resolve(target)
            short = target.split(":")[1]
            usage.originals[id(original)] = short
            if isinstance(original, type):                       # a class: guard its constructor
                cls = original
                had = "__init__" in vars(cls)
                init = cls.__init__
                setattr(cls, "__init__", _stub(init, short, usage))
                undo.append(lambda cls=cls, had=had, init=init:
                            setattr(cls, "__init__", init) if had else delattr(cls, "__init__"))
                continue
            stub = _stub(original, short, usage)
            if isinstance(owner, type):                         # a method
                setattr(owner, attr, stub)
                undo.append(lambda owner=owner, attr=attr, original=original: setattr(owner, attr, original))
                continue
            spaces = [vars(m) for n, m in list(sys.modules.items()) if n.startswith("parlab") and m is not None]
            for ns in spaces + [ns for ns in namespaces if isinstance(ns, dict)]:
                for key, value in list(ns.items()):
                    if value is original:
                        ns[key] = stub
                        undo.append(lambda ns=ns, key=key, original=original: ns.__setitem__(key, original))
            for cell in cells:
                if _cell_value(cell) is original:
                    cell.cell_contents = stub
                    undo.append(lambda cell=cell, original=original: setattr(cell, "cell_contents", original))
        yield usage
    finally:
        for u in reversed(undo):
            u()
        usage.close()


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


# ---------------------------------------------------------------------- the decorator every check wears
def configure(results_path: str | None = None, cpu_limit_s: float | None = None) -> None:
    """Set by ``parlab grade`` in the kernel: append one JSON line per check run to `results_path`."""
    if results_path is not None:
        _STATE["results_path"] = results_path
    if cpu_limit_s is not None:
        _STATE["cpu_limit"] = float(cpu_limit_s)


def results() -> list[dict]:
    return list(_STATE["records"])


def _record(check: str, passed: bool, kind: str, message: str, tb: str) -> None:
    rec = {"check": check, "passed": passed, "kind": kind, "message": message, "traceback": tb,
           "time": time.time()}
    _STATE["records"].append(rec)
    if _STATE["results_path"]:
        with open(_STATE["results_path"], "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


def graded(*targets: str):
    """Decorate a check: tamper check, parlab's `targets` unavailable to the student's code, failures as
    CheckFailed, one record per run. The check's first argument is the student's function or class."""
    def wrap(check):
        @functools.wraps(check)
        def run(*args, **kwargs):
            __tracebackhide__ = True                            # noqa: F841  (pytest: hide this frame)
            name = check.__name__
            try:
                bad = tampered()
                if bad:
                    raise CheckFailed(f"tampered: {', '.join(bad)} no longer is parlab's own; the grading code "
                                      f"or parlab was rebound in this notebook. Restart the kernel, remove the "
                                      f"code that rebinds it, and run the notebook from the top.", "tampered")
                out, err = None, None
                with references(targets, student_namespaces(*args[:1]), student_cells(*args[:1])) as usage:
                    try:
                        if args and id(args[0]) in usage.originals:   # parlab's own function handed in
                            usage.add(usage.originals[id(args[0])])
                            raise ReferenceUsed()
                        out = check(*args, **kwargs)
                    except (AssertionError, ReferenceUsed, CpuTimeExceeded) as e:
                        err = e
                    used = usage.names()
                if used:
                    raise CheckFailed(f"{name}: you called parlab's {', '.join(used)}; write your own. This part "
                                      f"asks you to compute it yourself, so parlab's version is unavailable "
                                      f"while the check runs.", "reference")
                if err is not None:
                    raise err
            except CheckFailed as e:
                _record(name, False, e.kind, str(e), traceback.format_exc())
                raise e.with_traceback(None) from None
            except AssertionError as e:
                _record(name, False, "fail", str(e), traceback.format_exc())
                raise CheckFailed(str(e)) from None
            except CpuTimeExceeded:
                msg = cpu_message(name)
                _record(name, False, "cpu", msg, traceback.format_exc())
                raise CheckFailed(msg, "cpu") from None
            except BaseException as e:
                _record(name, False, "error", f"{type(e).__name__}: {e}", traceback.format_exc())
                raise
            _record(name, True, "ok", "", "")
            return out
        run.__parlab_check__ = check
        return run
    return wrap
