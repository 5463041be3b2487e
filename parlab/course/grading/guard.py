"""What keeps a check honest: the student's own work is tested, and a failure reads as feedback.

Every ``check_*`` of `parlab.course.grading` is wrapped by `graded` (a decorator), which, each time the check runs:

* **verifies nothing was rebound** (`tampered`): the identities of the grading functions and constants, of the
  parlab internals a check relies on (``parlab.launch.run``, ``parlab.comm``, ``parlab.trace`` and their classes'
  methods ...) and of the torch functions a comparison goes through (``torch.equal``, ``Tensor.__sub__`` ...) are
  snapshotted when ``parlab.course.grading`` is imported; a check that finds one replaced, before or after it runs,
  fails as *tampered*;
* **makes parlab's own answer unavailable** (`references`): while it runs, parlab's implementation of the
  piece under test (``ParallelGrid`` in the group exercises, ``assign_buckets`` in the bucket exercise, ...)
  refuses to run for the student: its code is swapped in place (so every alias of the function is covered), a
  copy of its code (reload, exec of its source) is recognised by a profile hook, and a call counts as the
  student's when student code stands between it and the check on the stack (`student_call`), so reaching it
  through another parlab function or a subclass fails too: "you called parlab's X; write your own". The
  collectives of ``torch.distributed`` called from student code fail the same way (they would bypass the
  trace). A call is also recorded in a file, so catching the stub's exception does not help, in forked ranks
  either. All of this lives in `parlab.course.grading.unavailable`;
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
import copy
import functools
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
import types

from parlab.i18n import _
from parlab.course.grading.unavailable import (PARLAB_DIR, UNTRACED_PREFIX, ReferenceUsed, references, student_call,
    student_cells, student_namespaces)

__all__ = ["CheckFailed", "ReferenceUsed", "CpuTimeExceeded", "graded", "references", "fresh_seed", "cpu_limit",
           "protect", "tampered", "configure", "results", "install_ipython_hooks", "PARLAB_DIR", "not_written",
           "student_call"]

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
                _("(the grader's own frames are hidden here; the message above is what went wrong)")]


class CpuTimeExceeded(BaseException):
    """Raised by the CPU-time timer inside a runaway loop."""


def not_written(what: str) -> str:
    return _("{what} is not written yet: replace the `raise NotImplementedError` line with your code.").format(
        what=what)


def _is_cell(filename: str) -> bool:
    """A notebook cell's code: ipykernel compiles each cell as <tmp>/ipykernel_<pid>/<hash>.py (plain IPython and
    exec'd code: '<...>')."""
    return filename.startswith("<") or re.search(r"ipykernel_\d+[/\\]\d+\.py$", filename) is not None


def not_written_where(tb) -> str:
    """Where the `raise NotImplementedError` is, for the 'not written yet' line: in the cell that ran, or, when a
    function defined in a cell raised it (an answer cell called from a later one), that function's name."""
    cells = [(frame, line) for frame, line in traceback.walk_tb(tb) if _is_cell(frame.f_code.co_filename)]
    if not cells:
        return ""
    frame, line = cells[-1]
    if frame.f_code.co_name == "<module>" and frame.f_code.co_filename == cells[0][0].f_code.co_filename:
        return _(" (line {line} of this cell)").format(line=line)
    return _(" in {function} (line {line} of the cell that defines it)").format(function=frame.f_code.co_name,
                                                                               line=line)


def install_ipython_hooks() -> None:
    """In IPython, show a `raise NotImplementedError` left in a cell as one line saying 'not written yet'."""
    ip = sys.modules.get("IPython") and getattr(sys.modules["IPython"], "get_ipython", lambda: None)()
    if ip is None or getattr(ip, "_parlab_hooks", False):
        return

    def handler(shell, etype, value, tb, tb_offset=None):
        stb = ["\x1b[0;31mNotImplementedError\x1b[0m: " + _("not written yet{where}: replace "
                                                              "`raise NotImplementedError` with your code.").format(
            where=not_written_where(tb))]
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
    return _("{what} used more than {seconds:g} s of CPU time and was stopped: a loop that never ends? "
             "(A correct solution needs well under a second.) Check every loop's exit condition.").format(
        what=what, seconds=seconds)


# ---------------------------------------------------------------------- tamper detection
_SNAPSHOT: dict[tuple[str, str], object] = {}
_CONTENTS: dict[tuple[str, str], object] = {}          # copies of protected containers (a dict of tolerances ...)


def _lookup(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def protect(module_name: str, names=None, constants: bool | None = None) -> None:
    """Remember the current identity of `names` (dotted, e.g. 'Tensor.abs'; default: every public function and
    class, and the methods of the classes defined there) of a module. Grading modules (`constants`, default for
    parlab.course.grading.*) also keep their constants: a tolerance rebound or a dict of tolerances edited is tampering."""
    import importlib
    mod = importlib.import_module(module_name)
    if names is not None:
        for name in names:
            _SNAPSHOT[(module_name, name)] = _lookup(mod, name)
        return
    constants = module_name.startswith("parlab.course.grading") if constants is None else constants
    for name, obj in list(vars(mod).items()):
        if name.startswith("__") or isinstance(obj, type(sys)):
            continue
        if callable(obj):
            _SNAPSHOT[(module_name, name)] = obj
            if isinstance(obj, type) and obj.__module__ == module_name:      # its methods too (Trace.filter ...)
                for meth, value in vars(obj).items():
                    if callable(getattr(value, "__func__", value)) and not meth.startswith("__"):
                        _SNAPSHOT[(module_name, f"{name}.{meth}")] = getattr(obj, meth, None)
        elif constants:
            _SNAPSHOT[(module_name, name)] = obj
            if isinstance(obj, (dict, list, set)):
                with contextlib.suppress(Exception):
                    _CONTENTS[(module_name, name)] = copy.deepcopy(obj)


def _same(now, obj) -> bool:
    if now is obj or getattr(now, "__parlab_stub__", None) is obj:           # a guard's own stub is fine
        return True
    return isinstance(now, types.MethodType) and isinstance(obj, types.MethodType) and now == obj  # classmethods


def tampered() -> list[str]:
    """The protected names whose current value is not the one snapshotted at import (or whose contents changed)."""
    bad = []
    for (mod, name), obj in _SNAPSHOT.items():
        now = _lookup(sys.modules.get(mod), name)
        changed = not _same(now, obj)
        if not changed and (mod, name) in _CONTENTS:
            try:
                changed = bool(now != _CONTENTS[(mod, name)])
            except Exception:                                               # noqa: BLE001  (uncomparable: skip)
                changed = False
        if changed:
            bad.append(f"{mod}.{name}")
    return bad


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


def _tamper_message(bad: list[str]) -> str:
    return _("tampered: {names} no longer is parlab's own; the grading code or parlab was rebound in this "
             "notebook. Restart the kernel, remove the code that rebinds it, and run the notebook from the top.").format(
        names=", ".join(bad))


def _used_message(name: str, used: list[str]) -> str:
    untraced = [u for u in used if u.startswith(UNTRACED_PREFIX)]
    mine = [u for u in used if not u.startswith(UNTRACED_PREFIX)]
    parts = []
    if mine:
        parts.append(_("{check}: you called parlab's {names}; write your own. This part asks you to compute it "
                       "yourself, so parlab's version is unavailable while the check runs.").format(
            check=name, names=", ".join(mine)))
    if untraced:
        ops = ", ".join(u[len(UNTRACED_PREFIX):] for u in untraced)
        parts.append(_("{check}: you called {names} directly; communicate through parlab.comm (comm.{op} ...), "
                       "which records every message in the trace the check reads.").format(
            check=name, names=", ".join(untraced), op=ops.split(", ")[0]))
    return "\n".join(parts)


def graded(*targets: str):
    """Decorate a check: tamper check (before and after), parlab's `targets` unavailable to the student's code,
    failures as CheckFailed, one record per run. The check's first argument is the student's function or class."""
    def wrap(check):
        @functools.wraps(check)
        def run_check(*args, **kwargs):
            __tracebackhide__ = True                            # noqa: F841  (pytest: hide this frame)
            name = check.__name__
            try:
                bad = tampered()
                if bad:
                    raise CheckFailed(_tamper_message(bad), "tampered")
                out, err = None, None
                with references(targets, student_namespaces(*args[:1]), student_cells(*args[:1])) as usage:
                    try:
                        handed = usage.handed_in(args[0]) if args else None
                        if handed:                                  # parlab's own function or class handed in
                            usage.add(handed)
                            raise ReferenceUsed()
                        out = check(*args, **kwargs)
                    except (AssertionError, ReferenceUsed, CpuTimeExceeded) as e:
                        err = e
                    used = usage.names()
                bad = tampered()                                    # rebound by the student's code during the check
                if bad:
                    raise CheckFailed(_tamper_message(bad), "tampered")
                if used:
                    raise CheckFailed(_used_message(name, used), "reference")
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
        run_check.__parlab_check__ = check
        return run_check
    return wrap
