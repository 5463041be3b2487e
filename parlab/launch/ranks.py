"""Start ranks: `run` for simulated ranks on one machine (each rank's side is parlab.launch.child; `init`, for
torchrun/srun, is parlab.launch.torchrun).

`run(fn, world_size)` is how lessons, exercises and tests execute parallel
code: it starts `world_size` processes, gives each an initialised default
process group, calls ``fn(*args, **kwargs)`` on every rank and returns the
results in rank order, together with each rank's captured output and, with
``trace=True``, the merged communication trace.

The backend is gloo on the CPU unless asked: lessons, exercises and tests build
their models and tensors on the CPU, and a CPU tensor cannot go through NCCL.
``backend="nccl"`` (one GPU per rank, rank r on ``cuda:r``) or ``backend="auto"``
(NCCL when there is a GPU per rank) are explicit choices; on NCCL the rank's
device is set before the function's arguments are unpickled, and every tensor
in the results comes back on the CPU (so the caller opens no CUDA context).

How it starts ranks (measured on a 2-core CPU machine, torch 2.13, gloo):

* **fork** (the default for CPU/gloo on Linux). Children inherit the parent's
  memory, so a function defined in a notebook cell runs as is, and start-up is
  fast (about 0.1-0.2 s for 8 ranks). Rendezvous goes through a
  `torch.distributed.FileStore` in a fresh temporary folder: no ports, so two
  notebooks can run at once without colliding. Each child calls
  ``torch.set_num_threads(1)`` before touching torch, because a forked child
  can deadlock in its first multi-threaded kernel when the parent already used
  its OpenMP pool (with 8 ranks on 2 cores one thread each is right anyway).
  A process group the parent already has (after `parlab.init()`, or a `run`
  inside a rank) is forgotten in the child, never used or torn down there, so
  both cases work.
* **spawn** (used for NCCL, or when asked). Once a process has touched CUDA,
  forking it is unsafe, so GPU ranks are fresh interpreters. The function and
  its arguments are shipped by value with cloudpickle, which also handles
  functions defined in a notebook; globals they use must be picklable. Each
  rank re-imports torch, so start-up takes seconds.

Faults never hang the caller: an exception on a rank raises `RankError`
(naming the rank, carrying its traceback) and stops the others; ranks still
running after `timeout` seconds raise `RankTimeout` naming them; a rank killed
by a signal, or one that exits without reporting (``os._exit``), raises
`RankKilled`. Blame goes to the cause, not to the peers that saw the broken
connection (parlab.launch.blame): a rank that died without a report is the
culprit (its peers always report), else the earliest exception in time. Ctrl-C stops every rank at once
and still prints what each rank wrote so far. No child process and no
temporary file survives a call: ranks are killed and the ``parlab-run-*``
folder removed on every exit path, and ranks die with the parent
(PR_SET_PDEATHSIG); the folder of a parent that was itself killed (SIGKILL) is
removed by the next `run` of the same user.

After a failed collective a process group may be broken; parlab never reuses
one: each `run` builds new processes and a new group.
"""
from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, Callable

import torch

from parlab.launch.blame import explain, load_report, settle, wait
from parlab.launch.child import _child, _spawn_entry
from parlab.launch.torchrun import check_timeout
from parlab.trace import Trace

__all__ = ["run", "RunResult", "choose_backend"]


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


# ---------------------------------------------------------------------- the parent side
def _check_args(fn, world_size, timeout, threads, seed, start_method) -> None:
    """Every argument checked before any process starts, with what to pass instead."""
    if not callable(fn):
        raise TypeError(f"run() needs a function to call on every rank, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be a positive integer (the number of ranks), got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    check_timeout(timeout)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer (torch threads per rank) or None, got {threads!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    if start_method not in (None, "fork", "spawn"):
        raise ValueError(f"start_method must be 'fork' or 'spawn', got {start_method!r}")


def _import_before_fork() -> None:
    """Import here, once, what every forked rank would otherwise import for itself. A torch optimizer's first
    `add_param_group` imports torch._dynamo (its `_disable_dynamo` decorator): 0.9 s of CPU on a quiet core of the
    2-core CI machine, 2.7 s with 4 ranks sharing 2 cores, paid by each rank of each run that builds an optimizer
    unless the parent has it already (lesson 03's 4-rank runs took 2.2 s each before, 0.2 s after). Forked ranks
    share the parent's imported modules for free. Likewise the message catalogue of the language in force
    (compiled from its PO file on first use: 0.1 s), which a rank that prints or raises in Chinese would compile
    again for itself."""
    import torch._dynamo  # noqa: F401

    from parlab.i18n.catalogue import translations
    from parlab.i18n.language import language
    translations(language())


def run(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout: float = 60.0, trace: bool = False,
        seed: int = 0, seed_per_rank: bool = False, threads: int | None = None, start_method: str | None = None,
        echo: bool = True, **kwargs) -> RunResult:
    """Run ``fn(*args, **kwargs)`` on `world_size` simulated ranks and return their results in rank order.

    backend       'gloo' (the default: ranks on the CPU, where lessons, exercises and tests put their
                  tensors), 'nccl' (rank r on cuda:r; tensors in the results come back on the CPU) or
                  'auto' (NCCL if there is a GPU per rank, else gloo; only for code that puts its tensors
                  on ``parlab.init().device``)
    timeout       seconds (positive, finite) before unfinished ranks are stopped and `RankTimeout` is raised
    trace         record every parlab.comm call and parlab.trace.region; merged into `RunResult.trace`
    seed          every rank calls torch.manual_seed(seed) (+ rank when `seed_per_rank`)
    threads       torch threads per rank (default: 1 when forking, see below; CPU cores // world_size
                  when spawning)
    start_method  'fork' (default for gloo) or 'spawn' (default for NCCL, or once this process has
                  initialised CUDA; ships `fn` with cloudpickle)
    echo          print each rank's captured output, prefixed ``[rank r]``, in rank order

    Keyword arguments not listed above go to `fn` (use functools.partial for one that collides).
    It may be called after `parlab.init()` in the same process and from inside a rank (a nested run).
    """
    _check_args(fn, world_size, timeout, threads, seed, start_method)
    backend = choose_backend(world_size, backend)
    cuda_used = torch.cuda.is_initialized()   # e.g. after parlab.init() on NCCL: a forked child cannot use CUDA
    start_method = start_method or ("spawn" if backend == "nccl" or cuda_used else "fork")
    if start_method == "fork" and backend == "nccl":
        raise ValueError("forking after CUDA is initialised is unsafe; use start_method='spawn' with NCCL")
    if start_method == "fork" and cuda_used:
        raise ValueError("this process has initialised CUDA, and a forked rank cannot use it; "
                         "use start_method='spawn' (the default in this case)")
    if threads is None:
        # A forked rank can deadlock in its first multi-threaded kernel once the parent has used
        # torch's OpenMP pool (seen here with 2 threads per rank), so forked ranks run one thread each.
        threads = 1 if start_method == "fork" else max(1, (os.cpu_count() or 1) // world_size)

    if start_method == "fork":
        _import_before_fork()
        ctx, target, payload = get_context("fork"), _child, (fn, args, kwargs)
    else:
        import cloudpickle
        ctx, target, payload = get_context("spawn"), _spawn_entry, cloudpickle.dumps((fn, args, kwargs))
    procs = []
    t_start = time.perf_counter()
    _sweep_orphans()
    workdir = tempfile.mkdtemp(prefix=f"parlab-run-{os.getpid()}-")
    try:
        try:
            # Python's gc docs: freeze before fork so that a rank's collections never touch (and so copy) the
            # pages of the parent's objects (7% less CPU here for the test files that start the most ranks)
            gc.freeze()
            try:
                for rank in range(world_size):
                    p = ctx.Process(target=target, name=f"parlab-rank-{rank}",
                                    args=(rank, world_size, workdir, backend, threads, seed, seed_per_rank, timeout,
                                          trace, payload))
                    p.start()
                    procs.append(p)
            finally:
                gc.unfreeze()
            failure = wait(procs, timeout, t_start, workdir)
        except KeyboardInterrupt:
            # Ctrl-C: stop every rank now, then show what each had written (the output says where it hung)
            _stop(procs)
            outputs = [_read(os.path.join(workdir, f"out.{r}")) for r in range(world_size)]
            if echo:
                _echo(outputs)
            print(f"parlab.run: interrupted; stopped all {world_size} ranks", file=sys.stderr)
            raise
        outputs = [_read(os.path.join(workdir, f"out.{r}")) for r in range(world_size)]
        if failure is None:
            statuses = [load_report(workdir, r) for r in range(world_size)]
            if echo:
                _echo(outputs)
            seconds = time.perf_counter() - t_start
            events = [s[2] for s in statuses] if trace else None
            return RunResult(results=[s[1] for s in statuses], outputs=outputs,
                             trace=Trace.merge(events) if trace else None, seconds=seconds, backend=backend)
        settle(procs, workdir, failure)
        codes = [p.exitcode for p in procs]   # before stopping the rest: who exited on its own, and how
        _stop(procs)
        outputs = [_read(os.path.join(workdir, f"out.{r}")) for r in range(world_size)]
        if echo:
            _echo(outputs)
        raise explain(failure, workdir, world_size, timeout, outputs, codes)
    finally:
        _stop(procs)
        shutil.rmtree(workdir, ignore_errors=True)


def _sweep_orphans() -> None:
    """Remove ``parlab-run-<pid>-*`` folders of this user whose process is gone: the one exit path `run`
    cannot clean up after itself is its own process being killed (a notebook kernel killed with SIGKILL)."""
    tmp = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(tmp) if n.startswith("parlab-run-")]
    except OSError:
        return
    for name in names:
        pid = name[len("parlab-run-"):].split("-", 1)[0]
        path = os.path.join(tmp, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid() or os.path.exists(f"/proc/{pid}"):
                continue
        except OSError:
            continue
        if os.path.isdir("/proc/self"):   # only where /proc tells whether a process is alive (Linux)
            shutil.rmtree(path, ignore_errors=True)


def _stop(procs) -> None:
    """SIGKILL every rank still running and reap them all (a stopped, SIGSTOPped or hung rank included)."""
    for p in procs:
        if p.exitcode is None:
            try:
                p.kill()
            except (OSError, ValueError):
                pass
    for p in procs:
        try:
            p.join(timeout=5)
        except (OSError, ValueError, AssertionError):
            pass


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
