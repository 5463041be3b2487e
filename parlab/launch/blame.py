"""Who is at fault when ranks of `parlab.run` fail: waiting for them, and the exception that names the cause.

A rank that reports always reports: `parlab.launch.child` writes an error report for any exception in `fn`,
including a peer's broken connection, before the rank exits. So a rank that exited *without* a report (killed by
a signal, ``os._exit``, a crash in C++) is the cause, and its peers' connection errors are its consequences;
otherwise the earliest reported exception in time is. Faults become `RankError` (an exception on a rank, with
its traceback), `RankTimeout` (ranks still running after the timeout, named) and `RankKilled` (a signal, or an
exit without a report).

The report files (``result.<rank>`` in the run's folder) are written by `parlab.launch.child`; this module only
reads them.
"""
from __future__ import annotations

import os
import pickle
import re
import signal
import time
from multiprocessing import connection

import torch

__all__ = ["RankError", "RankTimeout", "RankKilled", "wait", "settle", "explain", "load_report"]


# ---------------------------------------------------------------------- the exceptions
class RankError(RuntimeError):
    """An exception raised inside `fn` on some rank; `.traceback` is the formatted traceback from that rank."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str):
        self.rank, self.exc_type, self.message, self.traceback = rank, exc_type, message, tb
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n\n--- traceback from rank {rank} ---\n{tb}")

    def _render_traceback_(self) -> list[str]:
        """IPython's hook (a notebook shows these lines instead of ~25 of parlab's and torch's frames): the
        rank's error, and the frames of the code that raised it outside parlab, torch and Python's library."""
        frames = re.findall(r'  File "([^"]+)", line (\d+), in (\S+)\n((?:    .*\n?)*)', self.traceback)
        library = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.__file__),
                   os.path.dirname(torch.__file__))
        cell = lambda path: path.startswith("<") or "ipykernel_" in path       # noqa: E731  a notebook cell
        mine = [f"  {'your cell' if cell(path) else path}, line {line}, in {fn}\n{code.rstrip()}"
                for path, line, fn, code in frames if not path.startswith(library)]
        said = f": {self.message}" if self.message else ""
        return [f"\x1b[0;31mRankError\x1b[0m: rank {self.rank} raised {self.exc_type}{said}",
                *mine[-3:], "(parlab's and torch's frames are hidden; the exception's .traceback has them all)"]


class RankTimeout(TimeoutError):
    """Some ranks did not finish within the timeout (often a deadlock: mismatched send/recv or collectives)."""

    def __init__(self, unfinished: list[int], timeout: float, outputs: list[str], returned: list[int] = ()):
        self.unfinished, self.timeout, self.outputs, self.returned = unfinished, timeout, outputs, list(returned)
        if self.returned:      # some ranks were done: whatever the others wait for, those will never send it
            why = (f", while ranks {self.returned} had already returned from the function. If the ranks still "
                   f"inside wait in a collective or recv, it is a deadlock the returned ranks can never end: some "
                   f"ranks ran more steps or collectives than others (an uneven number of batches, a collective "
                   f"under an `if rank == ...`); give every rank the same sequence of collectives")
        else:
            why = ("; a common cause is a deadlock (a rank waiting in a collective or recv that its peers never "
                   "enter)")
        super().__init__(f"ranks {unfinished} did not finish within {timeout:g} s{why}. All ranks were stopped.")


class RankKilled(RuntimeError):
    """A rank process died from a signal (e.g. SIGKILL from the out-of-memory killer) or exited without a result."""

    def __init__(self, rank: int, how: str):
        self.rank, self.how = rank, how
        super().__init__(f"rank {rank} {how}; all ranks were stopped")


# ---------------------------------------------------------------------- waiting, and naming the cause
def reported(workdir: str, rank: int) -> bool:
    return os.path.exists(os.path.join(workdir, f"result.{rank}"))


def wait(procs, timeout: float, t_start: float, workdir: str):
    """Wait until every rank exited cleanly (-> None) or something went wrong (-> a description)."""
    pending = {p.sentinel: r for r, p in enumerate(procs)}
    while pending:
        left = timeout - (time.perf_counter() - t_start)
        if left <= 0:
            return ("timeout", sorted(pending.values()))
        for s in connection.wait(list(pending), timeout=left):
            r = pending.pop(s)
            procs[r].join()
            if procs[r].exitcode != 0 or not reported(workdir, r):   # os._exit(0) in fn reports nothing
                return ("failed", r, procs[r].exitcode)
    return None


def settle(procs, workdir: str, failure, grace: float = 1.0) -> None:
    """Give the other ranks a moment to exit on their own after the first failure, so that `explain` sees the
    cause and not only its consequences.

    A rank that exits without a report (``os._exit``, a signal) closes its sockets a moment before the kernel
    marks it exited; on a busy machine its peers can notice the broken connection, report it and exit first.
    So after a *reported* error the other ranks get up to `grace` seconds: the wait ends as soon as one of them
    exits without a report (the cause) or all have exited. Peers blocked on a healthy rank, or hung, cost at
    most `grace`. After a silent exit (already the cause) the others only finish writing their reports."""
    if failure[0] != "failed" or not reported(workdir, failure[1]):
        time.sleep(0.05)
        return
    if any(p.exitcode is not None and not reported(workdir, r) for r, p in enumerate(procs)):
        return                                   # a rank already gone without a report: the cause is known
    pending = {p.sentinel: r for r, p in enumerate(procs) if p.exitcode is None}
    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        for s in connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic())):
            r = pending.pop(s)
            procs[r].join()
            if not reported(workdir, r):
                return


def explain(failure, workdir: str, world_size: int, timeout: float, outputs: list[str],
            codes: list[int | None]) -> Exception:
    """Turn a failure into the exception that names the cause (`codes`: each rank's exit status, None if
    it was still running when the failure was seen).

    A rank that reports always reports: an exception in `fn` (or a peer's broken connection) writes an
    error report before the rank exits. So a rank that exited *without* a report (killed by a signal,
    ``os._exit``, a crash in C++) is the cause, and its peers' connection errors are its consequences.
    SIGABRT is the exception: gloo can abort a healthy rank whose peer vanished, so an abort is blamed
    only when no rank reported an error. Otherwise the earliest reported exception in time is the cause."""
    if failure[0] == "timeout":  # name the ranks still inside fn (finished ones wait at the exit barrier)
        inside = [r for r in failure[1] if not reported(workdir, r)]
        returned = [r for r in range(world_size) if r not in (inside or failure[1])]
        return RankTimeout(inside or failure[1], timeout, outputs, returned)
    silent, errors = [], []
    for r in range(world_size):
        if not reported(workdir, r):
            if codes[r] is not None:
                silent.append((codes[r] == -signal.SIGABRT, r, codes[r]))   # exited without a report
            continue
        st = load_report(workdir, r)
        if st[0] == "error":
            errors.append((st[1], r, st))
    silent.sort()   # non-aborts first, then by rank
    if silent and (not silent[0][0] or not errors):
        _, r, code = silent[0]
        return RankKilled(r, how(code))
    if errors:  # the first error in time is the cause; the others are usually peers losing their connection
        _, r, st = min(errors)
        return RankError(r, st[2], st[3], st[4])
    return RankKilled(failure[1], how(failure[2]))


def how(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"was killed by signal {name}" + (" (often the out-of-memory killer)" if name == "SIGKILL" else "")
    return f"exited with code {code} without reporting a result (os._exit in fn, or a crash inside C++?)"


def load_report(workdir: str, rank: int):
    with open(os.path.join(workdir, f"result.{rank}"), "rb") as f:
        return pickle.load(f)
