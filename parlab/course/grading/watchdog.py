"""Deadlock detection from the ranks' own state, instead of a fixed wall-clock limit.

A fixed limit fails a correct solution on a busy grading server (parlab's own reference hit a 20-s limit
with ~28 runnable processes on 2 cores) and is slow to report a real deadlock. Here every rank runs a small
watchdog thread (`rank_entry`) that, every `POLL` seconds, writes the rank's state to a shared folder:

* its CPU time (the whole process minus the watchdog thread itself: gloo's helper threads count too),
* where its main thread is: the parlab.comm / torch.distributed call it is inside (found by walking the
  main thread's stack, ``sys._current_frames``) and the student's line that made it, or nothing,
* how many communication calls it has completed (the trace recorder's event count),
* whether the student's function has returned.

Rank 0's watchdog declares a deadlock when **every rank that has not returned has been inside a
communication call for `WINDOW` seconds with the same stack, no call completed and (almost) no CPU
progress**. A rank that
computes, however slowly, is not inside a communication call; a starved rank still advances its CPU time.
So a correct solution on a busy machine is never stopped, and a real deadlock is reported `WINDOW` seconds
after it forms (about 3 s on a quiet machine). Rank 0 then writes the verdict (who waits where) and exits;
`parlab.course.grading.runner.run_student` turns it into the check's message.

Each rank also runs under a CPU-time limit (`guard.cpu_limit`, SIGPROF; ``RLIMIT_CPU`` a few seconds later
as the backstop for a loop inside C code), so a runaway loop fails its check instead of running forever.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
import traceback

from parlab.i18n import _
from parlab.trace import current_recorder
from parlab.course.grading import guard

__all__ = ["rank_entry", "verdict", "explain", "hint", "TraceEdited", "POLL", "WINDOW", "CPU_EPS", "EXIT_DEADLOCK"]

POLL = 0.25          # seconds between state samples
WINDOW = 3.0         # seconds every live rank must sit in communication, unchanged, to call it a deadlock
CPU_EPS = 0.05       # CPU seconds a rank may use in the window and still count as blocked (gloo bookkeeping)
EXIT_DEADLOCK = 87   # exit status of the rank that reports a deadlock
COMM_DIR = os.path.join(guard.PARLAB_DIR, "comm") + os.sep          # the package parlab.comm
COMM_FILES = (COMM_DIR, os.sep + os.path.join("torch", "distributed") + os.sep)


def _comm_site(frame) -> str | None:
    """'comm.recv, called from your line 12: comm.recv(buf, src=left)' when the stack is inside a
    communication call; None otherwise."""
    stack = traceback.extract_stack(frame)                 # outermost first
    inside = [i for i, f in enumerate(stack) if any(c in f.filename for c in COMM_FILES)]
    if not inside:
        return None
    first = inside[0]
    op = stack[first].name
    module = "comm" if stack[first].filename.startswith(COMM_DIR) else "torch.distributed"
    caller = stack[first - 1] if first > 0 else None
    where = ""
    if caller is not None and not caller.filename.startswith(guard.PARLAB_DIR):
        where = _(", called from your line {line}: {code}").format(line=caller.lineno,
                                                                     code=(caller.line or "").strip())
    elif caller is not None:
        where = _(", called from parlab's {file}:{line}").format(file=os.path.basename(caller.filename),
                                                                  line=caller.lineno)
    return f"{module}.{op}{where}"


class _Watchdog(threading.Thread):
    def __init__(self, folder: str, rank: int, world: int):
        super().__init__(daemon=True, name="parlab-watchdog")
        self.folder, self.rank, self.world = folder, rank, world
        self.main = threading.main_thread().ident
        self.done = False
        self.history: dict[int, list[tuple[float, float, str | None, bool]]] = {}

    def _write(self) -> None:
        frame = sys._current_frames().get(self.main)
        site = _comm_site(frame) if frame is not None else None
        cpu = time.process_time() - time.thread_time()
        rec = current_recorder()
        calls = len(rec.events) if rec is not None else 0
        state = {"cpu": cpu, "site": site, "calls": calls, "done": self.done, "t": time.monotonic()}
        path = os.path.join(self.folder, f"state.{self.rank}")
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)

    def _deadlocked(self) -> dict | None:
        now = time.monotonic()
        live = {}
        for r in range(self.world):
            try:
                with open(os.path.join(self.folder, f"state.{r}")) as f:
                    s = json.load(f)
            except (OSError, ValueError):
                return None                                  # a rank not started yet (or mid-write)
            h = self.history.setdefault(r, [])
            h.append((now, s["cpu"], (s["site"], s["calls"]), s["done"]))
            while h and h[0][0] < now - WINDOW - 2 * POLL:
                h.pop(0)
            if not s["done"]:
                live[r] = h
        if not live:
            return None
        for r, h in live.items():
            span = [x for x in h if x[0] >= now - WINDOW]
            if len(h) < 2 or now - h[0][0] < WINDOW or any(x[3] for x in span):
                return None
            sites = {x[2] for x in span}
            if any(x[0] is None for x in sites) or len(sites) != 1 or span[-1][1] - span[0][1] > CPU_EPS:
                return None
        return {str(r): h[-1][2][0] for r, h in live.items()}

    def run(self) -> None:
        while True:
            time.sleep(POLL)
            try:
                self._write()
                if self.rank == 0:
                    found = self._deadlocked()
                    if found is not None:
                        with open(os.path.join(self.folder, "verdict.tmp"), "w") as f:
                            json.dump({"window": WINDOW, "ranks": found}, f)
                        os.replace(os.path.join(self.folder, "verdict.tmp"), os.path.join(self.folder, "verdict"))
                        os._exit(EXIT_DEADLOCK)
            except Exception:                                # never let the watchdog kill a healthy rank
                continue


class TraceEdited(BaseException):
    """The student's code edited this rank's trace: events added, removed or changed other than by parlab."""


def _fields(e) -> tuple:
    return (e.rank, e.kind, e.op, e.start, e.group, e.peer, e.numel, e.nbytes, e.dtype, e.label, e.asynchronous)


class _TraceSeal:
    """The checks read the trace, so it must hold exactly what parlab recorded: events may be added only by parlab's
    own code (``rec.add`` called from inside the parlab package), and when the student's function returns the
    events are checked against a private copy of what was added (the end time excepted: asynchronous works
    stamp it later)."""

    def __init__(self, rec):
        self.rec, self.events, self.n0, self.added = rec, rec.events, len(rec.events), []
        add = rec.add

        def sealed_add(event):
            if not sys._getframe(1).f_code.co_filename.startswith(guard.PARLAB_DIR):
                raise TraceEdited(_("your code added an event to the trace by hand"))
            out = add(event)
            self.added.append((event, _fields(event)))
            return out
        rec.add = sealed_add

    def verify(self) -> None:
        now = self.rec.events
        if (now is not self.events or [id(e) for e in now[self.n0:]] != [id(e) for e, _fields_of in self.added]
                or any(_fields(e) != f for e, f in self.added)):
            raise TraceEdited(_("the trace was edited by hand (events added, removed or changed)"))

    def close(self) -> None:
        vars(self.rec).pop("add", None)


def rank_entry(folder: str, cpu_limit_s: float, fn, *args):
    """Run ``fn(*args)`` on this rank under the watchdog and the CPU-time limit (use with parlab.run); the trace
    is sealed (`_TraceSeal`) while it runs."""
    from parlab import comm
    rank, world = comm.get_rank(), comm.get_world_size()
    if cpu_limit_s:
        soft = int(cpu_limit_s + 10 + time.process_time())
        _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    dog = _Watchdog(folder, rank, world)
    dog.start()
    rec = current_recorder()
    seal = _TraceSeal(rec) if rec is not None else None
    try:
        with guard.cpu_limit(cpu_limit_s):
            out = fn(*args)
        if seal is not None:
            seal.verify()
        return out
    finally:
        if seal is not None:
            seal.close()
        dog.done = True
        try:
            dog._write()
        except OSError:
            pass


def hint() -> str:
    return _("Usually this is a deadlock: every rank waits in a recv (or a blocking send) that its peer never "
             "matches. If all ranks call comm.send before comm.recv, each waits for a receiver forever: start "
             "the send with req = comm.isend(...), then comm.recv(...), then req.wait().")


P2P = {"send", "recv", "isend", "irecv", "wait", "batch_isend_irecv"}    # what the send-before-recv hint is about


def _hint_for(found: dict, world_size: int) -> str:
    """The hint that fits what the ranks wait in: a collective some ranks never reached, collectives in different
    orders, or point-to-point calls that wait for each other (`hint`)."""
    ops = {r: site.split(",")[0].rsplit(".", 1)[-1] for r, site in found["ranks"].items()}
    if all(op in P2P for op in ops.values()):
        return hint()
    returned = sorted(set(range(world_size)) - {int(r) for r in ops})
    if returned:
        return _("Ranks {returned} returned without calling it: a collective is called by every rank of its group, "
                 "the same number of times, in the same order (on one rank alone it waits forever).").format(
            returned=returned)
    return _("The ranks wait in different calls ({ops}): every rank of a group must make the same collectives in "
             "the same order, and a send must have its recv.").format(
        ops=", ".join(f"rank {r}: {op}" for r, op in ops.items()))


def explain(found: dict, what: str, world_size: int) -> str:
    """The check's message for the deadlock `found` (a `verdict`) of `what` on `world_size` ranks."""
    where = "\n".join(_("  rank {rank} waits in {site}").format(rank=r, site=site) for r, site in found["ranks"].items())
    return _("{what} deadlocked on {world} ranks: every rank still running has waited in communication for "
             "{window:g} s with no progress:\n{where}\n{hint}").format(what=what, world=world_size,
                                                                        window=found["window"], where=where,
                                                                        hint=_hint_for(found, world_size))


def verdict(folder: str) -> dict | None:
    """The deadlock rank 0 reported in `folder`, or None."""
    try:
        with open(os.path.join(folder, "verdict")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
