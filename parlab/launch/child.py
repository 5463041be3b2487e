"""The rank side of `parlab.run`: what each rank process does between start and exit.

A rank keeps the memory it frees for its next allocations (`_keep_freed_memory`), captures its output at the
file-descriptor level into ``out.<rank>`` of the run's folder, sets
its device (NCCL: before unpickling the function's arguments, `_prepare`), forgets any process group
inherited from the process that forked it (`_forget_inherited_groups`), joins a new default group
through a `FileStore`, seeds itself, runs the function (recording a trace when asked) and writes
``result.<rank>``: ("ok", value, events) with CUDA tensors moved to the CPU (`to_cpu`), or ("error",
time, type, message, traceback) for any exception. Ranks that succeeded leave together (a store
barrier) and every rank leaves with ``os._exit``, never tearing the group down collectively: its
peers may already be gone. The parent side (starting, waiting, blaming) is in parlab.launch.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import random
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from parlab.launch.torchrun import _store_barrier
from parlab.trace import recording

__all__ = ["to_cpu"]


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no rank outlives a crashed notebook."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the parent's finally-block still kills us
        pass


def _keep_freed_memory() -> None:
    """Tell glibc's malloc to keep freed memory instead of handing it back to the kernel: large blocks from the
    heap rather than from mmap (up to 32 MiB, glibc's upper bound for M_MMAP_THRESHOLD), and no trimming of the
    heap's top. A training step frees and allocates the same large tensors every step; given back, each one
    page-faults again when it is next written (on this project's 2-core VM, ~2 us per 4 KiB page: a ring-attention
    step went from 6.2 to 4.4 ms on one rank). PyTorch's CPU performance tuning guide recommends a caching
    allocator (jemalloc, TCMalloc) for the same reason; this is that within glibc, for the rank processes only.
    Peak memory is unchanged; memory is not returned to the system until the rank exits. Not glibc: nothing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)       # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)        # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _child(rank: int, world_size: int, workdir: str, backend: str, threads: int, seed: int, seed_per_rank: bool,
           timeout: float, trace: bool, payload) -> None:
    _die_with_parent()
    _keep_freed_memory()
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
        _forget_inherited_groups()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))
        device_id, (fn, args, kwargs) = _prepare(rank, backend, payload)
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
        if backend == "nccl":
            value = to_cpu(value)
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


_INHERITED: list = []   # process groups a forked rank inherited: kept referenced, never used or destroyed


def _forget_inherited_groups() -> None:
    """Make a forked rank forget the process groups of the process that forked it (after `parlab.init()`,
    or a `run` inside a rank), so that it can start its own default group.

    The inherited groups belong to the parent: their worker threads do not exist in this process and their
    sockets are the parent's, so shutting them down here could hang or break the parent's group. They are
    only dropped from torch.distributed's bookkeeping (the same fields `destroy_process_group` clears, minus
    the shutdown) and kept referenced, so no destructor runs; the rank leaves with os._exit."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    c10d = dist.distributed_c10d
    try:  # private state of torch.distributed: guarded, with a clear error if a torch version moves it
        w = c10d._world
        _INHERITED.extend(w.pg_map)
        c10d._update_default_pg(None)
        for d in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag, w.tags_to_pg,
                  w.pg_coalesce_state):
            d.clear()
        w.group_count = 0
        c10d._unregister_all_process_groups()
    except Exception as exc:
        raise RuntimeError(f"this process already has a torch.distributed process group, and this torch version "
                           f"does not let a forked rank drop it ({exc}); call parlab.run(..., "
                           f"start_method='spawn'), or call parlab.run before parlab.init()") from exc


def to_cpu(value):
    """`value` with every tensor inside lists, tuples, dicts and sets moved to the CPU (other objects as is)."""
    if torch.is_tensor(value):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        items = [(k, to_cpu(v)) for k, v in value.items()]
        try:
            return type(value)(items)
        except TypeError:  # a dict subclass with another constructor
            return dict(items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_cpu(v) for v in value))
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(to_cpu(v) for v in value)
    return value


def _prepare(rank: int, backend: str, payload):
    """On NCCL, make ``cuda:rank`` this process's device, *then* unpickle (fn, args, kwargs): CUDA tensors
    among the arguments are restored onto the current device, so in the other order they would all land
    on cuda:0. Returns (the device to bind the process group to, or None; the unpickled payload)."""
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    if isinstance(payload, bytes):
        import cloudpickle  # noqa: F401  (made by cloudpickle; plain pickle loads it once it is importable)
        payload = pickle.loads(payload)
    return device_id, payload


def _spawn_entry(rank, world_size, workdir, backend, threads, seed, seed_per_rank, timeout, trace, payload):
    # the payload stays bytes here: _child sets the rank's CUDA device before unpickling it
    _child(rank, world_size, workdir, backend, threads, seed, seed_per_rank, timeout, trace, payload)
