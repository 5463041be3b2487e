"""The runner every check shares: run the student's code on simulated ranks, and turn each way it fails into a message.

`run_student` is ``parlab.run(fn, world_size, *args)`` on gloo with a trace, under the deadlock `watchdog` (a
deadlock is recognised from the ranks' state within about 3 s) and the CPU-time limit of `guard`; a rank's
exception, a deadlock, a runaway loop, an edited trace or a `raise NotImplementedError` left in place each becomes an
AssertionError (CheckFailed) that says what happened on which rank (`_explain_rank_error`). `call_student` does the
same for a plain single-process function. `TIMEOUT` is the wall-clock backstop of one run; `_show` prints the head
of a tensor in a message.

Every exercise's checks (``parlab.course.grading.collectives``, ``.groups``, ``.data_parallel`` ...) call these.
"""
from __future__ import annotations

import shutil
import tempfile

import torch

from parlab.i18n import _
from parlab.launch import RankError, RankKilled, RankTimeout, RunResult, run
from parlab.course.grading import guard, watchdog
from parlab.course.grading.guard import CheckFailed

__all__ = ["TIMEOUT", "run_student", "call_student"]

TIMEOUT = 300.0                 # wall-clock backstop per run; deadlocks are found by `watchdog` within ~3 s


def run_student(fn, world_size: int, *args, timeout: float = TIMEOUT, what: str | None = None) -> RunResult:
    """``parlab.run(fn, world_size, *args)`` on gloo with a trace, under the deadlock watchdog and the CPU-time
    limit, every failure turned into an AssertionError (CheckFailed) that says what happened."""
    what = what or _("your function")
    folder = tempfile.mkdtemp(prefix="parlab-watch-")
    try:
        return run(watchdog.rank_entry, world_size, folder, guard._STATE["cpu_limit"], fn, *args, backend="gloo",
                   trace=True, timeout=timeout)
    except (RankKilled, RankError) as e:
        found = watchdog.verdict(folder)        # a deadlock first: peers then fail on a closed connection
        if found is not None:
            raise AssertionError(watchdog.explain(found, what, world_size)) from None
        if isinstance(e, RankKilled):
            if "SIGXCPU" in str(e):
                on = _("{what} on rank {rank}").format(what=what, rank=e.rank)
                raise CheckFailed(guard.cpu_message(on), "cpu") from None
            raise AssertionError(f"{what}: {e}") from None
        _explain_rank_error(e, what, world_size)
    except RankTimeout as e:
        raise AssertionError(_("{what} did not finish within {timeout:g} s on {world} ranks (ranks {ranks} were "
                               "still running). {hint}").format(what=what, timeout=timeout, world=world_size,
                                                                 ranks=e.unfinished, hint=watchdog.hint())) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _explain_rank_error(e: RankError, what: str, world_size: int):
    """Raise the AssertionError (or CheckFailed) that explains an exception raised on a rank."""
    on = _("{what} on rank {rank}").format(what=what, rank=e.rank)
    if e.exc_type == "CpuTimeExceeded":
        raise CheckFailed(guard.cpu_message(on), "cpu") from None
    if e.exc_type == "TraceEdited":
        raise CheckFailed(_("tampered: {what} on rank {rank}: {error}; the check reads what parlab.comm recorded, so "
                            "the trace must not be touched. Remove the code that edits it.").format(
            what=what, rank=e.rank, error=e.message), "tampered") from None
    if e.exc_type == "ReferenceUsed":
        raise AssertionError(f"{on}: {e.message}") from None
    if e.exc_type == "NotImplementedError":
        raise AssertionError(_("{what} is not written yet (rank {rank} raised NotImplementedError): replace the "
                               "`raise NotImplementedError` line with your code.").format(what=what,
                                                                                          rank=e.rank)) from None
    tail = "\n".join(e.traceback.strip().splitlines()[-6:])
    raise AssertionError(_("{what} raised {exc} on rank {rank} of {world}: {error}\n--- end of the traceback from "
                           "rank {rank} ---\n{tail}").format(what=what, exc=e.exc_type, rank=e.rank, world=world_size,
                                                             error=e.message, tail=tail)) from None


def call_student(fn, *args, what: str | None = None):
    """Call a student's plain (single-process) function; its exceptions become AssertionErrors that say so."""
    what = what or _("your function")
    try:
        with guard.cpu_limit():
            return fn(*args)
    except guard.CpuTimeExceeded:
        raise CheckFailed(guard.cpu_message(what), "cpu") from None
    except NotImplementedError:
        raise AssertionError(guard.not_written(what)) from None
    except Exception as e:
        raise AssertionError(_("{what}{args} raised {exc}: {error}").format(what=what, args=args,
                                                                           exc=type(e).__name__, error=e)) from e


def _show(t: torch.Tensor, k: int = 6) -> str:
    """The first `k` values of `t`, for a message: [1, -3, 7, ...]."""
    vals = ", ".join(f"{v:g}" for v in t[:k].tolist())
    return f"[{vals}{', ...' if t.numel() > k else ''}]"


guard.protect(__name__)
