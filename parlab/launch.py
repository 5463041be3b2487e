"""Start ranks: `run` for simulated ranks on one machine, `init` for scripts under torchrun.

`run(fn, world_size)` is how lessons, exercises and tests execute parallel
code: it starts `world_size` processes, gives each an initialised default
process group, calls ``fn(*args, **kwargs)`` on every rank and returns the
results in rank order, together with each rank's captured output and, with
``trace=True``, the merged communication trace.

How it starts ranks (measured on a 2-core CPU machine, torch 2.13, gloo):

* **fork** (the default for CPU/gloo on Linux). Children inherit the parent's
  memory, so a function defined in a notebook cell runs as is, and start-up is
  fast (about 0.1-0.2 s for 8 ranks). Rendezvous goes through a
  `torch.distributed.FileStore` on a fresh temporary file: no ports, so two
  notebooks can run at once without colliding. Each child calls
  ``torch.set_num_threads(1)`` before touching torch, because a forked child
  can deadlock in its first multi-threaded kernel when the parent already used
  its OpenMP pool (with 8 ranks on 2 cores one thread each is right anyway).
* **spawn** (used for NCCL, or when asked). Once a process has touched CUDA,
  forking it is unsafe, so GPU ranks are fresh interpreters. The function and
  its arguments are shipped by value with cloudpickle, which also handles
  functions defined in a notebook; globals they use must be picklable. Each
  rank re-imports torch, so start-up takes seconds.

Faults never hang the caller: an exception on a rank raises `RankError`
(naming the rank, carrying its traceback) and stops the others; ranks still
running after `timeout` seconds raise `RankTimeout` naming them; a rank killed
by a signal raises `RankKilled`. No child process survives a call: they are
killed on every exit path, and they die with the parent (PR_SET_PDEATHSIG).

After a failed collective a process group may be broken; parlab never reuses
one: each `run` builds new processes and a new group.

`init()` is the same entry point for scripts started by ``torchrun`` (one node
or many, e.g. under SLURM): it reads torchrun's environment, picks NCCL and
``cuda:LOCAL_RANK`` when GPUs are present, else gloo on the CPU, and returns a
`Context`. Under `run` it simply describes the group that already exists, so
the same user code runs in both worlds.
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection, get_context
from typing import Any, Callable

import torch
import torch.distributed as dist

from .trace import Trace, recording

__all__ = ["run", "init", "Context", "RunResult", "RankError", "RankTimeout", "RankKilled", "choose_backend"]


# ---------------------------------------------------------------------- results and errors
@dataclass
class RunResult:
    """What `run` brings home: one return value per rank (rank order), captured output, the trace."""
    results: list[Any]
    outputs: list[str]
    trace: Trace | None = None
    seconds: float = 0.0
    backend: str = "gloo"

    def __getitem__(self, rank: int) -> Any:
        return self.results[rank]

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self):
        return iter(self.results)


class RankError(RuntimeError):
    """An exception raised inside `fn` on some rank; `.traceback` is the formatted traceback from that rank."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str):
        self.rank, self.exc_type, self.message, self.traceback = rank, exc_type, message, tb
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n\n--- traceback from rank {rank} ---\n{tb}")


class RankTimeout(TimeoutError):
    """Some ranks did not finish within the timeout (often a deadlock: mismatched send/recv or collectives)."""

    def __init__(self, unfinished: list[int], timeout: float, outputs: list[str]):
        self.unfinished, self.timeout, self.outputs = unfinished, timeout, outputs
        super().__init__(f"ranks {unfinished} did not finish within {timeout:g} s; a common cause is a deadlock "
                         f"(a rank waiting in a collective or recv that its peers never enter). "
                         f"All ranks were stopped.")


class RankKilled(RuntimeError):
    """A rank process died from a signal (e.g. SIGKILL from the out-of-memory killer) or exited without a result."""

    def __init__(self, rank: int, how: str):
        self.rank, self.how = rank, how
        super().__init__(f"rank {rank} {how}; all ranks were stopped")


# ---------------------------------------------------------------------- backend choice
def choose_backend(world_size: int, backend: str = "auto") -> str:
    """'auto' -> NCCL with one GPU per rank when there are enough GPUs, else gloo on the CPU."""
    if backend != "auto":
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(f"backend='nccl' needs one GPU per rank: world_size {world_size} but "
                             f"{torch.cuda.device_count()} GPUs visible; use backend='gloo' or fewer ranks")
        return backend
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


# ---------------------------------------------------------------------- the child side
def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no rank outlives a crashed notebook."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the parent's finally-block still kills us
        pass


def _child(rank: int, world_size: int, workdir: str, backend: str, threads: int, seed: int, seed_per_rank: bool,
           timeout: float, trace: bool, payload) -> None:
    _die_with_parent()
    # Capture this rank's output at the file-descriptor level (catches C++ messages too), and give Python
    # fresh stream objects: an inherited Jupyter stream would try to talk to the kernel from this process.
    out = os.open(os.path.join(workdir, f"out.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    status: tuple
    try:
        torch.set_num_threads(threads)
        fn, args, kwargs = pickle.loads(payload) if isinstance(payload, bytes) else payload
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout), device_id=device_id)
        # init can return on one rank before its peers finished connecting; a rank that then exits
        # at once would break their connection set-up. One barrier makes "initialised" mean "on all ranks".
        dist.barrier()
        s = seed + (rank if seed_per_rank else 0)
        random.seed(s)
        torch.manual_seed(s)
        try:
            import numpy as np
            np.random.seed(s % 2**32)
        except ImportError:
            pass
        if trace:
            with recording(rank) as rec:
                value = fn(*args, **kwargs)
            events = rec.events
        else:
            value, events = fn(*args, **kwargs), None
        status = ("ok", value, events)
    except BaseException as exc:  # report everything, including SystemExit, to the caller
        status = ("error", time.time(), type(exc).__name__, str(exc), traceback.format_exc())
    try:
        blob = pickle.dumps(status)
    except Exception as exc:
        status = ("error",)
        blob = pickle.dumps(("error", time.time(), "PicklingError",
                             f"the return value of rank {rank} cannot be sent back ({exc}); return tensors, "
                             f"numbers, strings, lists or dicts", traceback.format_exc()))
    with open(os.path.join(workdir, f"result.{rank}.tmp"), "wb") as f:
        f.write(blob)
    os.replace(os.path.join(workdir, f"result.{rank}.tmp"), os.path.join(workdir, f"result.{rank}"))
    sys.stdout.flush()
    sys.stderr.flush()
    if status[0] == "ok":
        # Leave together: a rank that exits early closes sockets its peers may still be reading from.
        _store_barrier(store, "parlab/exit", world_size)
    # Leave without tearing the process group down collectively: peers may already be gone.
    os._exit(0 if status[0] == "ok" else 1)


def _store_barrier(store, key: str, world_size: int, timeout_s: float | None = None) -> bool:
    """Wait until all ranks reached this point, through the rendezvous store (no collective involved).
    With `timeout_s`, give up after that many seconds; returns whether every rank arrived."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    arrived = store.add(key, 1)
    while arrived < world_size:
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.001)
        arrived = store.add(key, 0)
    return True


def _spawn_entry(rank, world_size, workdir, backend, threads, seed, seed_per_rank, timeout, trace, payload):
    import cloudpickle  # the payload was made by cloudpickle; plain pickle can load it once cloudpickle is importable
    _child(rank, world_size, workdir, backend, threads, seed, seed_per_rank, timeout, trace,
           cloudpickle.loads(payload))


# ---------------------------------------------------------------------- the parent side
def run(fn: Callable, world_size: int, *args, backend: str = "auto", timeout: float = 60.0, trace: bool = False,
        seed: int = 0, seed_per_rank: bool = False, threads: int | None = None, start_method: str | None = None,
        echo: bool = True, **kwargs) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on `world_size` simulated ranks and return their results in rank order.

    backend       'auto' (NCCL if there is a GPU per rank, else gloo), 'gloo' or 'nccl'
    timeout       seconds before unfinished ranks are stopped and `RankTimeout` is raised
    trace         record every parlab.comm call and parlab.trace.region; merged into `RunResult.trace`
    seed          every rank calls torch.manual_seed(seed) (+ rank when `seed_per_rank`)
    threads       torch threads per rank (default: 1 when forking, see below; CPU cores // world_size
                  when spawning)
    start_method  'fork' (default for gloo) or 'spawn' (default for NCCL; ships `fn` with cloudpickle)
    echo          print each rank's captured output, prefixed ``[rank r]``, in rank order

    Keyword arguments not listed above go to `fn` (use functools.partial for one that collides).
    """
    if not callable(fn):
        raise TypeError(f"run() needs a function to call on every rank, got {type(fn).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    backend = choose_backend(world_size, backend)
    start_method = start_method or ("spawn" if backend == "nccl" else "fork")
    if start_method not in ("fork", "spawn"):
        raise ValueError(f"start_method must be 'fork' or 'spawn', got {start_method!r}")
    if start_method == "fork" and backend == "nccl":
        raise ValueError("forking after CUDA is initialised is unsafe; use start_method='spawn' with NCCL")
    if threads is None:
        # A forked rank can deadlock in its first multi-threaded kernel once the parent has used
        # torch's OpenMP pool (seen here with 2 threads per rank), so forked ranks run one thread each.
        threads = 1 if start_method == "fork" else max(1, (os.cpu_count() or 1) // world_size)

    workdir = tempfile.mkdtemp(prefix="parlab-run-")
    if start_method == "fork":
        ctx, target, payload = get_context("fork"), _child, (fn, args, kwargs)
    else:
        import cloudpickle
        ctx, target, payload = get_context("spawn"), _spawn_entry, cloudpickle.dumps((fn, args, kwargs))
    procs = []
    t_start = time.perf_counter()
    try:
        for rank in range(world_size):
            p = ctx.Process(target=target, name=f"parlab-rank-{rank}",
                            args=(rank, world_size, workdir, backend, threads, seed, seed_per_rank, timeout, trace,
                                  payload))
            p.start()
            procs.append(p)
        failure = _wait(procs, timeout, t_start)
        outputs = [_read(os.path.join(workdir, f"out.{r}")) for r in range(world_size)]
        if failure is None:
            statuses = [_load(workdir, r) for r in range(world_size)]
            if echo:
                _echo(outputs)
            seconds = time.perf_counter() - t_start
            events = [s[2] for s in statuses] if trace else None
            return RunResult(results=[s[1] for s in statuses], outputs=outputs,
                             trace=Trace.merge(events) if trace else None, seconds=seconds, backend=backend)
        if echo:
            _echo(outputs)
        raise _explain(failure, workdir, world_size, timeout, outputs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait(procs, timeout: float, t_start: float):
    """Wait until every rank exited cleanly (-> None) or something went wrong (-> a description)."""
    pending = {p.sentinel: r for r, p in enumerate(procs)}
    while pending:
        left = timeout - (time.perf_counter() - t_start)
        if left <= 0:
            return ("timeout", sorted(pending.values()))
        for s in connection.wait(list(pending), timeout=left):
            r = pending.pop(s)
            procs[r].join()
            if procs[r].exitcode != 0:
                return ("failed", r, procs[r].exitcode)
    return None


def _explain(failure, workdir: str, world_size: int, timeout: float, outputs: list[str]) -> Exception:
    """Turn a failure into the most useful exception: the earliest rank error, else the kill, else the timeout."""
    if failure[0] == "timeout":  # name the ranks still inside fn (finished ones wait at the exit barrier)
        inside = [r for r in failure[1] if not os.path.exists(os.path.join(workdir, f"result.{r}"))]
        return RankTimeout(inside or failure[1], timeout, outputs)
    _, failed, code = failure
    if code < 0:  # the first rank to go died from a signal: peers' connection errors are its consequence
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return RankKilled(failed, f"was killed by signal {name}" + (" (often the out-of-memory killer)"
                                                                    if name == "SIGKILL" else ""))
    time.sleep(0.05)  # let ranks that failed at the same moment finish writing their reports
    errors = []
    for r in range(world_size):
        try:
            st = _load(workdir, r)
        except FileNotFoundError:
            continue
        if st[0] == "error":
            errors.append((st[1], r, st))
    if errors:  # the first error in time is the cause; the others are usually peers losing their connection
        _, r, st = min(errors)
        return RankError(r, st[2], st[3], st[4])
    return RankKilled(failed, f"exited with code {code} without reporting a result (sys.exit/os._exit in fn?)")


def _load(workdir: str, rank: int):
    with open(os.path.join(workdir, f"result.{rank}"), "rb") as f:
        return pickle.load(f)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _echo(outputs: list[str]) -> None:
    for r, text in enumerate(outputs):
        for line in text.splitlines():
            print(f"[rank {r}] {line}")


# ---------------------------------------------------------------------- torchrun side
@dataclass
class Context:
    """Where this process sits: its rank, the world size, its rank on this node and its device."""
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    extra: dict = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(backend: str = "auto", timeout: float = 600.0) -> Context:
    """Initialise torch.distributed from torchrun's environment (or describe the group `run` already made).

    Under ``torchrun --nproc_per_node=N script.py`` (one node or many): NCCL on ``cuda:LOCAL_RANK`` when GPUs
    are present, else gloo on the CPU. Run as a plain ``python script.py`` it becomes a world of one rank.
    """
    if dist.is_available() and dist.is_initialized():
        be = dist.get_backend()
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        device = torch.device("cuda", torch.cuda.current_device()) if be == "nccl" else torch.device("cpu")
        return Context(dist.get_rank(), dist.get_world_size(), local, device, be)
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise RuntimeError("parlab.init(): RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not; "
                               "start the script with torchrun (it sets all four)")
        rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
        init_method = "env://"
    else:  # plain `python script.py`: a world of one
        rank, world, local = 0, 1, 0
        init_method = None
    be = "nccl" if (backend == "auto" and torch.cuda.is_available()) else ("gloo" if backend == "auto" else backend)
    device = torch.device("cpu")
    if be == "nccl":
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs on this node; "
                               f"use --nproc_per_node <= {torch.cuda.device_count()}")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    kw = dict(backend=be, timeout=datetime.timedelta(seconds=timeout))
    if be == "nccl":
        kw["device_id"] = device
    if init_method is None:
        store = dist.FileStore(tempfile.mktemp(prefix="parlab-store-"), 1)
        dist.init_process_group(store=store, rank=0, world_size=1, **kw)
    else:
        dist.init_process_group(init_method=init_method, **kw)
    # Tear the group down at exit: a process that exits with a live gloo group can abort in C++
    # ("terminate called without an active exception"; seen here about 1 run in 10).
    atexit.register(_destroy_at_exit)
    return Context(rank, world, local, device, be)


def _destroy_at_exit(timeout_s: float = 30.0) -> None:
    """Leave the process group in step with the other ranks, so that no rank exits while a peer still talks to it.

    A rank that tears down (or simply exits with) its gloo connections while a peer is still
    finishing its last send can make that peer's process abort in C++ ("terminate called without
    an active exception", about 1 exit in 30 on a loaded machine). So every rank first waits on
    the rendezvous store until all ranks are done, then destroys the group, then waits once more
    until all have destroyed it. The waits go through the store (torchrun's agent hosts it), not
    through the process group, and are bounded: a rank that crashed or hangs costs at most
    `timeout_s` seconds of exit time, never a hang, and a failure here never masks the exit code.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    store = None
    crashed = getattr(sys, "last_value", None) is not None  # set by Python when an uncaught exception ends the script
    if world > 1 and not crashed:  # a crashed rank leaves at once: its peers may never reach the rendezvous
        try:
            store = dist.distributed_c10d._get_default_store()  # private API: guarded, falls back to a plain destroy
        except Exception:
            store = None
    try:
        if store is not None:
            _store_barrier(store, "parlab/exit/done", world, timeout_s)
        dist.destroy_process_group()
        if store is not None:
            _store_barrier(store, "parlab/exit/destroyed", world, timeout_s)
    except Exception:
        pass  # exiting anyway: the rank's own exit status is what matters
