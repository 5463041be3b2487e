"""A lab's watch on its peers, for a job that must end instead of hanging (`parlab.labs` starts one per rank):
heartbeats in the rendezvous store, the step each rank is in, who stopped answering when a collective fails, and
a rank that ends itself when the store goes silent (or when it finds it was stopped itself).

`watch_peers` starts a `Watch` on the default process group's store and installs `report_failures`: an uncaught
communication error (typically a collective that timed out after --timeout) prints `Watch.report`, which names
the rank that stopped answering and the step every rank had reached, in place of the traceback (kept when no
rank stopped: then the program itself is stuck, and the traceback shows where).
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time

import torch.distributed as dist

from parlab.i18n import _

__all__ = ["Watch", "stopped_itself", "watch_peers", "report_failures"]


def stopped_itself(silent: float, paused: float, timeout: float) -> bool:
    """Was the store's silence of `silent` seconds this process's own doing? True when the process was not
    running (`paused`: the longest wake-up of its watcher later than asked) for more than half the timeout: then
    the store had no chance to answer, and blaming its host would point at the wrong process (a SIGSTOPped rank
    0 under srun, woken by SLURM's SIGCONT, blamed itself as "the process hosting the store")."""
    return silent > timeout and paused > timeout / 2


class Watch:
    """Who stopped answering: every rank bumps a heartbeat counter in the rendezvous store from a daemon
    thread and records the step it is in; when a collective fails (typically after --timeout), `report`
    reads the counters twice, a few beats apart: a rank whose counter did not move is stopped (SIGSTOP,
    a node that froze) or dead. The counters, not clocks, are compared: nodes' clocks may differ.

    The store belongs to torchrun's agent, which still answers when a rank does not; under srun it lives in rank
    0's process, so a stopped rank 0 takes it along, and a store request to a stopped (not dead) host waits
    forever, whatever its timeout (measured: torch 2.13's TCPStore client). So no store request runs on the
    training thread (`at_step` only records the step; the heartbeat thread publishes it), and a third thread,
    which never touches the store, watches the heartbeat: when the store has not answered for `timeout` seconds
    it says so and ends this rank (exit status 1), so the job ends instead of hanging."""

    def __init__(self, store, rank: int, world: int, interval: float = 0.5, timeout: float = 300.0):
        self.store, self.rank, self.world, self.interval, self.timeout = store, rank, world, interval, timeout
        self.blamed: list[int] = []          # the ranks the last `report` found stopped
        self._stop = threading.Event()
        self._step, self._published, self._answered = -1, None, time.monotonic()
        self.store.set(self._key("step", rank), "-1")
        self._thread = threading.Thread(target=self._beat, name="parlab-lab-heartbeat", daemon=True)
        self._thread.start()
        self._monitor = threading.Thread(target=self._watch_store, name="parlab-lab-store-watch", daemon=True)
        self._monitor.start()
        atexit.register(self.stop)   # runs before init's exit rendezvous (atexit is last-in, first-out)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @staticmethod
    def _key(what: str, rank: int) -> str:
        return f"parlab/lab/{what}/{rank}"

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(self._key("alive", self.rank), 1)
                if self._step != self._published:
                    step = self._step
                    self.store.set(self._key("step", self.rank), str(step))
                    self._published = step
                self._answered = time.monotonic()
            except Exception:   # the store is gone (the job is ending): stop beating
                return
            self._stop.wait(self.interval)

    def _watch_store(self) -> None:
        last, paused = time.monotonic(), 0.0
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            # a wake-up far later than asked: this process itself was not running (SIGSTOP, a frozen node)
            paused, last = max(paused, now - last - self.interval), now
            silent = now - self._answered
            if silent <= self.timeout:
                paused = 0.0 if silent < self.interval * 4 else paused       # answered again: start afresh
                continue
            if stopped_itself(silent, paused, self.timeout):
                print(_("[rank {rank}] this process was stopped for {paused:.0f} s (SIGSTOP, or its node froze) and "
                        "has just resumed; the other ranks have given up on it by now: rank {rank} stops "
                        "now").format(rank=self.rank, paused=paused), file=sys.stderr, flush=True)
            else:
                print(_("[rank {rank}] the rendezvous store has not answered for {silent:.0f} s: the process "
                        "hosting it stopped, froze or died (under srun: rank 0's; under torchrun: the node's agent); "
                        "rank {rank} stops now").format(rank=self.rank, silent=silent), file=sys.stderr, flush=True)
            os._exit(1)

    def at_step(self, step: int) -> None:
        self._step = step                                  # published by the heartbeat thread

    def _read(self, what: str) -> dict[int, int | None]:
        out = {}
        for r in range(self.world):
            try:
                out[r] = int(self.store.add(self._key(what, r), 0) if what == "alive"
                             else self.store.get(self._key(what, r)))
            except Exception:
                out[r] = None
        return out

    def report(self, error: BaseException, wait_beats: int = 6) -> str:
        """Lines saying which ranks stopped answering and where every rank was, for this rank's stderr."""
        try:
            self.store.set_timeout(datetime.timedelta(seconds=10))   # a store that does not answer: give up
        except Exception:
            pass
        first = self._read("alive")
        time.sleep(wait_beats * self.interval)
        second, steps = self._read("alive"), self._read("step")
        silent = [r for r in range(self.world) if r != self.rank and (second[r] is None or second[r] == first[r])]
        self.blamed = silent
        head = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
        where = ", ".join(f"rank {r}: " + ("?" if steps[r] is None else _("setting up") if steps[r] < 0
                                             else _("step {step}").format(step=steps[r]))
                          for r in range(self.world))
        lines = [_("[rank {rank}] a collective failed: {error}").format(rank=self.rank, error=head)]
        if silent:
            who, quiet = ", ".join(map(str, silent)), wait_beats * self.interval
            lines.append((_("[rank {rank}] ranks {who} stopped answering: no heartbeat in {seconds:g} s (stopped, "
                            "e.g. by SIGSTOP, frozen, or dead); the other ranks are alive") if len(silent) > 1 else
                          _("[rank {rank}] rank {who} stopped answering: no heartbeat in {seconds:g} s (stopped, "
                            "e.g. by SIGSTOP, frozen, or dead); the other ranks are alive")
                          ).format(rank=self.rank, who=who, seconds=quiet))
        else:
            lines.append(_("[rank {rank}] every rank still answers: a rank is stuck in the program (waiting "
                           "in a collective that its peers never enter?)").format(rank=self.rank))
        lines.append(_("[rank {rank}] where each rank was: {where} (at its last heartbeat, every "
                       "{interval:g} s)").format(rank=self.rank, where=where, interval=self.interval))
        return "\n".join(lines)


def report_failures(watch: Watch) -> None:
    """Make an uncaught communication error (a RuntimeError from the backend) print `Watch.report` instead of a
    traceback when the report names the rank that stopped answering: the cause is found, and 30 lines of the
    survivor's own stack would only bury it (the exit status stays 1). When every rank still answers, the
    program itself is stuck, and the traceback, which shows where this rank waited, follows the report."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, RuntimeError):
            try:
                print(watch.report(value), file=sys.stderr, flush=True)
            except Exception:
                pass
            else:
                if watch.blamed:
                    return
        previous(kind, value, tb)

    sys.excepthook = hook


def watch_peers(rank: int, world_size: int, timeout: float) -> Watch | None:
    """A `Watch` on the default process group's store, its failures reported (`report_failures`); None on one
    rank, or where the store cannot be had (a private torch API, guarded: the lab runs without the watch)."""
    if world_size == 1:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    if store is None:
        return None
    watch = Watch(store, rank, world_size, timeout=timeout)
    report_failures(watch)
    return watch
