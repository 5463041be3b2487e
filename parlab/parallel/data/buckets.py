"""Communication for data parallelism: flat buffers, parameter broadcast, gradient buckets.

The wrappers in `parlab.parallel.data.ddp` say *when* to communicate; this module
says *what* goes on the wire. Everything here sends through `parlab.comm`, so
it is traced, and takes an explicit ``group``.

* Flat buffers. Sending 30 small tensors costs 30 start-up latencies; sending
  one tensor holding all of them costs one. `flatten` / `unflatten_into` copy a
  list of same-dtype tensors into one 1-D buffer and back (what
  ``torch._utils._flatten_dense_tensors`` does for torch's DataParallel).
* `broadcast_tensors`: rank ``src``'s values to every rank, one broadcast per
  dtype (DDP's construction-time sync, DataParallel's per-step replicate);
  `reduce_tensors`: the sum on rank ``dst`` (DataParallel's gradient reduce).
* Buckets (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
  Parallel Training", VLDB 2020, section 3.2.3). One all-reduce per gradient
  is latency-bound; one all-reduce of all gradients can only start after
  backward has finished. A bucket is in between: a flat buffer holding the
  gradients of a few consecutive parameters. `assign_buckets` fills buckets in
  the order given (DDP passes the *reverse* registration order, roughly the
  order backward produces gradients) up to a byte cap; `GradBucket` holds the
  buffer, one view per parameter and the bookkeeping of which gradients have
  arrived, and launches its asynchronous all-reduce.
"""
from __future__ import annotations

from typing import Sequence

import torch

from parlab import comm

__all__ = ["flatten", "unflatten_into", "broadcast_tensors", "reduce_tensors", "assign_buckets", "GradBucket"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor holding every tensor's values, one after another (all the same dtype and device)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])  # (sum of numels,)


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `tensors` (the inverse of `flatten`), in place."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset: offset + n].view_as(t))
            offset += n


def _by_dtype(tensors: Sequence[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, group=None, label: str = "broadcast") -> None:
    """Every rank's `tensors` become global rank `src`'s, in place: one flat broadcast per (dtype, device)."""
    for same in _by_dtype([t for t in tensors if t.numel() > 0]).values():
        flat = flatten(same)                                   # (total,)
        comm.broadcast(flat, src=src, group=group, label=label)
        unflatten_into(flat, same)


def reduce_tensors(tensors: Sequence[torch.Tensor], dst: int, group=None, label: str = "reduce") -> None:
    """Global rank `dst`'s `tensors` become the sum over the group, in place, one flat reduce per
    (dtype, device); other ranks' tensors are left as they were."""
    for same in _by_dtype([t for t in tensors if t.numel() > 0]).values():
        flat = flatten(same)                                   # (total,)
        comm.reduce(flat, dst=dst, group=group, label=label)
        if comm.get_rank() == dst:
            unflatten_into(flat, same)


def assign_buckets(nbytes: Sequence[int], kinds: Sequence[object], cap_bytes: int) -> list[list[int]]:
    """Split items 0..n-1, in the order given, into consecutive buckets of at most `cap_bytes` bytes.

    A bucket is closed when the next item would push it over the cap, or when the next item has another
    kind (dtype, device): a flat buffer has one dtype. An item larger than the cap gets a bucket of its own.
    Pure: ``assign_buckets([4, 4, 4], ["f"] * 3, 8) == [[0, 1], [2]]``.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    buckets: list[list[int]] = []
    size, kind = 0, None
    for i, (b, k) in enumerate(zip(nbytes, kinds)):
        if not buckets or k != kind or size + b > cap_bytes:
            buckets.append([])
            size, kind = 0, k
        buckets[-1].append(i)
        size += b
    return buckets


class GradBucket:
    """A flat gradient buffer for a few parameters, filled as their gradients arrive, then all-reduced.

    ``buffer`` is (sum of numels,) in the parameters' dtype; ``views[j]`` is the slice shaped like
    ``params[j]``. `add_grad` copies one gradient in and returns True when the bucket is complete.
    """

    def __init__(self, index: int, params: Sequence[torch.nn.Parameter]):
        self.index = index
        self.params = list(params)
        p0 = self.params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=p0.dtype, device=p0.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            self.views.append(self.buffer[offset: offset + p.numel()].view_as(p))  # shaped like p
            offset += p.numel()
        self.arrived = [False] * len(self.params)
        self.work = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        self.arrived = [False] * len(self.params)
        self.work = None

    @property
    def complete(self) -> bool:
        return all(self.arrived)

    def add_grad(self, slot: int, grad: torch.Tensor | None) -> bool:
        """Copy parameter `slot`'s gradient into the buffer (zeros for None); True once all have arrived."""
        if grad is None:
            self.views[slot].zero_()
        else:
            self.views[slot].copy_(grad)
        self.arrived[slot] = True
        return self.complete

    def all_reduce_async(self, group=None, label: str = "") -> None:
        """Launch the average over the group of this buffer (ReduceOp.AVG), without waiting."""
        self.work = comm.all_reduce(self.buffer, op=comm.ReduceOp.AVG, group=group, async_op=True,
                                    label=label or f"grad bucket {self.index}")

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
