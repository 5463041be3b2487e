"""Traced communication: the one place in parlab that talks to other ranks.

Every function here is a thin wrapper over the torch.distributed call of the
same meaning, with the same arguments and the same result, plus:

* an explicit, optional ``group`` (default: the world group), so parlab works
  inside any torch.distributed program (``parlab.run``, ``torchrun``, a test
  harness that called ``init_process_group`` itself);
* an optional ``label`` ("grad bucket 2", "stage 1 -> 2 act mb 3") that
  lessons show on hover;
* one `parlab.trace.Event` per call on the calling rank when a recorder is
  active (``parlab.run(..., trace=True)`` or ``with parlab.trace.recording()``):
  op, group ranks, peer, element count, payload bytes, dtype, start and end.
  On the "cuda-events" clock (a recording in a process that uses CUDA; see
  parlab.trace) start and end are CUDA events on the current stream, not host
  times: a synchronous call ends when the current stream may use its result,
  an asynchronous one when its kernels finish (an event recorded from the
  work's future callback, which torch runs on a stream synchronised with them;
  at ``wait()`` when the backend offers no future).
  With no recorder the only extra cost is one list lookup.

Ranks (``src``, ``dst``, ``peer``) are *global* ranks, as in torch.distributed.

Strict mode (``with comm.strict(): ...``; the test suite runs in it) checks every tensor handed to a call
before it reaches torch.distributed: on the rank's device (``cuda:<current>`` under NCCL, the CPU under
gloo), contiguous, of a dtype NCCL supports, and ReduceOp.AVG only on floating types. gloo accepts much that
NCCL refuses or gets wrong, so on a CPU machine this is how GPU-only failures show up; a violation raises
`StrictCommError` saying what to change (`parlab.comm.strict_mode`).

Names follow torch 2.13's non-deprecated API: all-gather and reduce-scatter of
whole tensors use ``all_gather_single`` / ``reduce_scatter_single`` where they
exist (``all_gather_into_tensor`` and ``reduce_scatter_tensor`` print
FutureWarnings there), falling back for older torch.

Collective semantics (N ranks, X = tensor):
    broadcast(X, src)        every rank ends with src's X
    reduce(X, dst)           dst ends with sum_r X_r
    all_reduce(X)            every rank ends with sum_r X_r
    all_gather(out, X)       out = cat_r X_r                (out is N times X)
    reduce_scatter(out, X)   out = (sum_r X_r)[chunk rank]  (out is X/N)
    all_to_all(out, X)       out[chunk j] = X_j[chunk rank] (a transpose of chunks)
    send / recv              point to point
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist

from parlab.comm.strict_mode import _strict
from parlab.trace import Event, current_recorder, now

__all__ = [
    "ReduceOp", "get_rank", "get_world_size", "group_ranks",
    "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
    "barrier", "send", "recv", "isend", "irecv", "all_gather_dim", "reduce_scatter_dim", "all_gather_uneven",
    "TracedWork",
]

ReduceOp = dist.ReduceOp
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------- helpers
def get_rank(group=None) -> int:
    """This process's rank inside `group` (default: world)."""
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    """Number of ranks in `group` (default: world)."""
    return dist.get_world_size(group)


def group_ranks(group=None) -> list[int]:
    """Global ranks of the members of `group` (default: world), in group-rank order."""
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


class TracedWork:
    """Wraps the handle of an asynchronous call; the event's end time is set when the work completes."""

    def __init__(self, work, event: Event, device_span=None):
        self._work, self.event, self._device_span = work, event, device_span
        try:  # completion time from the backend's future when it offers one (gloo and NCCL do)
            # The callback holds only the event, never the work: a callback that keeps its own work alive
            # forms a C++/Python cycle that made processes abort at exit ("terminate called without an
            # active exception", about 1 run in 8 of a 27-bucket DDP step under torchrun).
            work.get_future().add_done_callback(functools.partial(_finish, event, device_span))
        except (RuntimeError, AttributeError):
            pass

    def _finish(self) -> None:
        _finish(self.event)

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._finish()
        if self.event.waited is None:   # where the program first needed the result (for parlab.cluster.replay)
            self.event.waited = now()
            rec = current_recorder()
            if rec is not None and rec.meter is not None:     # and the work done by then (count_costs)
                self.event.meter_waited = rec.meter.state()
        if self._device_span is not None:   # cuda-events clock, no callback yet: when the stream is past the wait
            self._device_span.close()
        return out

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self):
        return self._work.get_future()

    def __getattr__(self, name):  # anything else a torch Work offers
        return getattr(self._work, name)


def _finish(event: Event, device_span=None, _future=None) -> None:
    """Stamp the completion time once (from the backend's callback or from wait(), whichever comes first).
    On the cuda-events clock the end event is recorded here: torch runs a future's callbacks on streams
    synchronised with the work's kernels, so the event completes when the collective does."""
    if device_span is not None:
        device_span.close()
    if event.end == event.start and event.asynchronous and event.clock == "wall":   # (cuda-events: set at the end)
        event.end = now()


def _record(op: str, kind: str, tensor: torch.Tensor | None, nbytes: int, group, peer, label: str,
            start: float, work=None, device_start=None, splits: tuple = ()):
    """Add one event to the active recorder; wrap `work` so its completion is timed."""
    rec = current_recorder()
    ev = Event(rank=rec.rank, kind=kind, op=op, start=start, end=now() if work is None else start,
               group=tuple(group_ranks(group)), peer=peer,
               numel=(nbytes // tensor.element_size()) if tensor is not None and tensor.element_size() else 0,
               nbytes=nbytes, dtype=str(tensor.dtype).replace("torch.", "") if tensor is not None else "",
               label=label, asynchronous=work is not None, splits=splits)
    rec.add(ev)
    span = rec.device_span(ev, device_start, end=work is None)   # None on the wall clock
    return TracedWork(work, ev, span) if work is not None else None


def _run(op: str, kind: str, call, tensor, nbytes, group, peer, label, async_op, splits: tuple = ()):
    """Run one torch.distributed call, tracing it when a recorder is active."""
    if current_recorder() is None:
        return call()
    start, device_start = now(), current_recorder().device_mark()   # device_start: None on the wall clock
    work = call()
    traced = _record(op, kind, tensor, nbytes, group, peer, label, start, work if async_op else None,
                     device_start, splits)
    return traced if async_op else work


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------- collectives
def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, label: str = ""):
    """In place: every rank's `tensor` becomes the reduction (default sum) over the group."""
    _strict("all_reduce", group, tensor, reduce_op=op)
    return _run("all_reduce", "collective", lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
                tensor, _nbytes(tensor), group, None, label, async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, label: str = ""):
    """In place: every rank's `tensor` becomes global rank `src`'s."""
    _strict("broadcast", group, tensor)
    return _run("broadcast", "collective", lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
                tensor, _nbytes(tensor), group, src, label, async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False, label: str = ""):
    """Global rank `dst` ends with the reduction; other ranks' tensors are left unspecified (torch semantics)."""
    _strict("reduce", group, tensor, reduce_op=op)
    return _run("reduce", "collective", lambda: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op),
                tensor, _nbytes(tensor), group, dst, label, async_op)


def all_gather(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False, label: str = ""):
    """`output` (N * tensor.numel() elements) becomes the concatenation along dim 0 of every rank's `tensor`."""
    _strict("all_gather", group, output, tensor)
    return _run("all_gather", "collective",
                lambda: _all_gather_single(output, tensor, group=group, async_op=async_op),
                output, _nbytes(output), group, None, label, async_op)


def reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
                   label: str = ""):
    """`output` becomes this rank's dim-0 chunk of the reduction of every rank's full `tensor`."""
    _strict("reduce_scatter", group, output, tensor, reduce_op=op)
    return _run("reduce_scatter", "collective",
                lambda: _reduce_scatter_single(output, tensor, op=op, group=group, async_op=async_op),
                tensor, _nbytes(tensor), group, None, label, async_op)


def all_to_all(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
               input_split_sizes: Sequence[int] | None = None, group=None, async_op: bool = False, label: str = ""):
    """Chunk j of this rank's `tensor` (dim 0) goes to rank j; `output` holds the chunks received, in rank order.
    Uneven chunks: `input_split_sizes[j]` rows to rank j, `output_split_sizes[j]` rows from it (both lists or
    neither). Traced with the bytes sent to each rank (`Event.splits`)."""
    _strict("all_to_all", group, output, tensor)
    n = get_world_size(group)
    row = _nbytes(tensor) // tensor.shape[0] if tensor.dim() and tensor.shape[0] else 0     # bytes per dim-0 row
    rows = list(input_split_sizes) if input_split_sizes is not None else [tensor.shape[0] // n if tensor.dim() else 0] * n
    return _run("all_to_all", "collective",
                lambda: dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                               async_op=async_op),
                tensor, _nbytes(tensor), group, None, label, async_op, tuple(r * row for r in rows))


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group=None,
           async_op: bool = False, label: str = ""):
    """Global rank `dst` receives every rank's `tensor` into `gather_list` (None on other ranks)."""
    n = get_world_size(group)
    _strict("gather", group, tensor, *(gather_list or ()))
    return _run("gather", "collective",
                lambda: dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op),
                tensor, _nbytes(tensor) * n, group, dst, label, async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group=None,
            async_op: bool = False, label: str = ""):
    """Rank j's `tensor` becomes `scatter_list[j]` of global rank `src`."""
    n = get_world_size(group)
    _strict("scatter", group, tensor, *(scatter_list or ()))
    return _run("scatter", "collective",
                lambda: dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op),
                tensor, _nbytes(tensor) * n, group, src, label, async_op)


def barrier(group=None, label: str = ""):
    """Wait until every rank of the group has arrived."""
    return _run("barrier", "collective", lambda: dist.barrier(group=group), None, 0, group, None, label, False)


# ---------------------------------------------------------------------- point to point
def send(tensor: torch.Tensor, dst: int, group=None, label: str = ""):
    """Blocking send of `tensor` to global rank `dst`."""
    _strict("send", group, tensor)
    return _run("send", "p2p", lambda: dist.send(tensor, dst=dst, group=group), tensor, _nbytes(tensor), group, dst,
                label, False)


def recv(tensor: torch.Tensor, src: int, group=None, label: str = ""):
    """Blocking receive into `tensor` from global rank `src`."""
    _strict("recv", group, tensor)
    return _run("recv", "p2p", lambda: dist.recv(tensor, src=src, group=group), tensor, _nbytes(tensor), group, src,
                label, False)


def isend(tensor: torch.Tensor, dst: int, group=None, label: str = ""):
    """Non-blocking send; call `.wait()` on the result before reusing `tensor`."""
    _strict("isend", group, tensor)
    return _run("send", "p2p", lambda: dist.isend(tensor, dst=dst, group=group), tensor, _nbytes(tensor), group, dst,
                label, True)


def irecv(tensor: torch.Tensor, src: int, group=None, label: str = ""):
    """Non-blocking receive; `tensor` holds the message after `.wait()`."""
    _strict("irecv", group, tensor)
    return _run("recv", "p2p", lambda: dist.irecv(tensor, src=src, group=group), tensor, _nbytes(tensor), group, src,
                label, True)


# ---------------------------------------------------------------------- tensor-returning conveniences
def all_gather_dim(tensor: torch.Tensor, dim: int = 0, group=None, label: str = "") -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim` (all shapes equal); returns a new tensor."""
    n = get_world_size(group)
    if n == 1:
        return tensor
    x = tensor.movedim(dim, 0).contiguous()                     # (d, ...) with the gathered dim first
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)  # (N*d, ...)
    all_gather(out, x, group=group, label=label)
    return out.movedim(0, dim)


def reduce_scatter_dim(tensor: torch.Tensor, dim: int = 0, op=ReduceOp.SUM, group=None, label: str = "") -> torch.Tensor:
    """Sum `tensor` over the group and keep this rank's chunk along `dim`; returns a new tensor."""
    n = get_world_size(group)
    if n == 1:
        return tensor
    if tensor.shape[dim] % n:
        raise ValueError(f"reduce_scatter along dim {dim}: size {tensor.shape[dim]} is not divisible by the "
                         f"group size {n}; pad the tensor or choose sizes that are multiples of {n}")
    x = tensor.movedim(dim, 0).contiguous()                     # (d, ...)
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)  # (d/N, ...)
    reduce_scatter(out, x, op=op, group=group, label=label)
    return out.movedim(0, dim)


def all_gather_uneven(tensor: torch.Tensor, group=None, label: str = "") -> list[torch.Tensor]:
    """All-gather tensors whose dim-0 sizes differ across ranks (gloo's all-gather needs equal sizes):
    exchange the sizes, pad to the largest, gather, then trim. Returns one tensor per group rank."""
    n = get_world_size(group)
    size = torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device)
    sizes = torch.empty(n, dtype=torch.long, device=tensor.device)
    all_gather(sizes, size, group=group, label=f"{label} sizes".strip())
    biggest = int(sizes.max())
    padded = torch.zeros((biggest,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    out = torch.empty((n * biggest,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    all_gather(out, padded, group=group, label=label)
    return [out[i * biggest: i * biggest + int(sizes[i])] for i in range(n)]

