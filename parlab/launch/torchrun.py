"""`init()`: the entry point for scripts started by ``torchrun`` or ``srun`` (one node or many).

It reads the launcher's environment, picks NCCL and ``cuda:LOCAL_RANK`` when GPUs are present, else gloo
on the CPU, starts the default process group and returns a `Context`. Under `parlab.run` it simply
describes the group that already exists, so the same user code runs in both worlds.

Where the ranks come from, in this order:

* ``torchrun`` (or any launcher following its convention) sets RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR and MASTER_PORT; rendezvous is torch's ``env://``.
* plain ``srun python script.py`` with several tasks sets no RANK/WORLD_SIZE, only SLURM's variables:
  SLURM_PROCID (rank), SLURM_STEP_NUM_TASKS (world size) and SLURM_LOCALID (rank on the node). The
  address of rank 0 cannot be known for sure from them (the node that ran ``srun`` may hold no task),
  so MASTER_ADDR must be exported by the job script; MASTER_PORT defaults to 29500 + SLURM_JOB_ID % 1000
  so that two jobs sharing a node do not collide. A job of several tasks whose script runs ``python``
  without ``srun`` (SLURM_NTASKS > 1 but no job step) is stopped with a message: every task would
  otherwise silently become a world of one.
* anything else is a world of one (``python script.py``), with an in-memory store: no temporary file.

The process group is torn down at exit in step with the other ranks (`_destroy_at_exit`).
References: torch.distributed ``init_process_group`` and ``torchrun`` documentation; SLURM ``srun``
manual, section "OUTPUT ENVIRONMENT VARIABLES".
"""
from __future__ import annotations

import atexit
import datetime
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Context", "init", "check_timeout", "local_world_size", "slurm_ranks"]


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


def check_timeout(timeout, what: str = "timeout") -> float:
    """A positive, finite number of seconds, or a clear error saying what to pass instead."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{what} must be a number of seconds (e.g. 60), got {timeout!r}; "
                        f"for a very long run pass a large number such as 3600")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {timeout!r}; "
                         f"for a very long run pass a large number such as 3600")
    return float(timeout)


def _int_env(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise RuntimeError(f"parlab.init(): environment variable {name}={env[name]!r} is not an integer") from None


def slurm_ranks(env) -> tuple[int, int, int] | None:
    """(rank, world, local rank) of an ``srun`` task of a job step with several tasks; None outside SLURM
    or for a single task. Raises a clear error for a multi-task job whose script was not started by srun."""
    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if ntasks is None or not ntasks.isdigit() or int(ntasks) <= 1:
        return None
    if "SLURM_STEP_NUM_TASKS" not in env or "SLURM_PROCID" not in env:
        raise RuntimeError(
            f"parlab.init(): this SLURM job has SLURM_NTASKS={ntasks} tasks, but this process was not started "
            f"by srun (no job step), so every task would be a world of one. Start the script with "
            f"`srun python script.py` (one task per GPU) or `srun torchrun --nproc_per_node=N script.py` "
            f"(one task per node).")
    return _int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_STEP_NUM_TASKS"), \
        _int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0


def _one_thread_per_task(env, rank: int) -> None:
    """What torchrun does for its workers, under srun too: each task computes with OMP_NUM_THREADS threads, 1
    unless the job chose (SLURM_CPUS_PER_TASK from ``srun -c``). Tasks that each take every core of the node
    fight over them: the pipeline lab ran 5-30x slower under srun than under torchrun that way. Said once."""
    if "OMP_NUM_THREADS" in env:
        return                                       # the user chose
    cpus = env.get("SLURM_CPUS_PER_TASK", "")
    threads = int(cpus) if cpus.isdigit() and int(cpus) > 0 else 1
    torch.set_num_threads(threads)
    if rank == 0:
        print(f"parlab.init(): OMP_NUM_THREADS is not set; each srun task computes with {threads} torch "
              f"thread{'s' if threads > 1 else ''} ({'SLURM_CPUS_PER_TASK' if cpus.isdigit() else 'as torchrun does'}"
              f"); export OMP_NUM_THREADS to choose", file=sys.stderr, flush=True)


def local_world_size(env=None, default: int = 1) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else srun's SLURM_STEP_TASKS_PER_NODE ("4(x2)": 4 tasks on
    each of 2 nodes; "4,3": 4 on the first node; this node's count is not given, the first is taken), else
    SLURM_NTASKS_PER_NODE, else `default`. srun sets no LOCAL_WORLD_SIZE: a layout printout that read only that
    would put every task of a multi-node step on one node."""
    env = os.environ if env is None else env
    for name in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        text = env.get(name, "")
        first = text.split(",")[0].split("(")[0].strip()
        if first.isdigit() and int(first) > 0:
            return int(first)
    return default


def init(backend: str = "auto", timeout: float = 600.0) -> Context:
    """Initialise torch.distributed from torchrun's or srun's environment (or describe the group `run` made).

    backend  'auto' (NCCL on ``cuda:LOCAL_RANK`` when GPUs are present, else gloo on the CPU), 'gloo' or 'nccl'
    timeout  seconds a collective may wait for its peers before it fails (torch's process-group timeout);
             a rank that stopped answering then costs this long, not forever

    Run as a plain ``python script.py`` it becomes a world of one rank.
    """
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    timeout = check_timeout(timeout)
    if dist.is_available() and dist.is_initialized():
        be = dist.get_backend()
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        device = torch.device("cuda", torch.cuda.current_device()) if be == "nccl" else torch.device("cpu")
        return Context(dist.get_rank(), dist.get_world_size(), local, device, be)
    env = os.environ
    slurm = None
    if "RANK" in env and "WORLD_SIZE" in env:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise RuntimeError("parlab.init(): RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not; "
                               "start the script with torchrun (it sets all four)")
        rank, world = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
        local = _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
    elif (slurm := slurm_ranks(env)) is not None:
        rank, world, local = slurm
        if not env.get("MASTER_ADDR", "").strip():
            raise RuntimeError(
                f"parlab.init(): started by srun with several tasks but MASTER_ADDR is "
                f"{'empty' if 'MASTER_ADDR' in env else 'not set'}, and SLURM does not say where rank 0 runs. "
                "Add to the job script, before srun (inside the job: scontrol needs SLURM_JOB_NODELIST):\n"
                "    export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
                "(the first node runs rank 0 under SLURM's default block distribution), or use torchrun.")
        _one_thread_per_task(env, rank)
    else:  # plain `python script.py`: a world of one
        rank, world, local = 0, 1, 0
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
    if world == 1 and slurm is None and "RANK" not in env:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kw)  # in memory: nothing to clean
    elif slurm is not None:
        port = int(env.get("MASTER_PORT", 29500 + int(env.get("SLURM_JOB_ID", "0") or 0) % 1000))
        store = dist.TCPStore(env["MASTER_ADDR"], port, world, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(store=store, rank=rank, world_size=world, **kw)
    else:
        dist.init_process_group(init_method="env://", **kw)
    # Tear the group down at exit: a process that exits with a live gloo group can abort in C++
    # ("terminate called without an active exception"; seen here about 1 run in 10).
    atexit.register(_destroy_at_exit)
    return Context(rank, world, local, device, be, extra={"launcher": "srun"} if slurm is not None else {})


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


def _destroy_at_exit(timeout_s: float = 30.0) -> None:
    """Leave the process group in step with the other ranks, so that no rank exits while a peer still talks to it.

    A rank that tears down (or simply exits with) its gloo connections while a peer is still
    finishing its last send can make that peer's process abort in C++ ("terminate called without
    an active exception", about 1 exit in 30 on a loaded machine). So every rank first waits on
    the rendezvous store until all ranks are done, then destroys the group, then waits once more
    until all have destroyed it; rank 0, whose process hosts the store under srun, leaves last. The waits
    go through the store (torchrun's agent hosts it, srun's rank 0), not
    through the process group, and are bounded: a rank that crashed or hangs costs at most
    `timeout_s` seconds of exit time, never a hang, and a failure here never masks the exit code.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    world, rank = dist.get_world_size(), dist.get_rank()
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
            # Under srun rank 0's process hosts the store: it leaves last, after every other rank's final request
            # (else a peer still polling it prints a C++ "recvValue failed" stack trace: 2 runs in 8 here).
            if rank != 0:
                store.add("parlab/exit/left", 1)                # its last request
            else:
                _store_barrier(store, "parlab/exit/left", world, min(timeout_s, 5.0))   # every other rank's too
    except Exception:
        pass  # exiting anyway: the rank's own exit status is what matters
