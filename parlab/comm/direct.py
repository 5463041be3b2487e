"""Collectives built from point-to-point messages, part of `parlab.comm` (re-exported there): the "direct"
reduce-scatter and all-gather that ZeRO uses on gloo.

On gloo, ``reduce_scatter_tensor`` is a clone, a full all-reduce and a copy, and ``all_gather_into_tensor`` goes
through a fresh flat output (ProcessGroupGloo.cpp; benchmarks/README.md measures both). Built from messages,
rank r sends chunk j straight to rank j (reduce-scatter) or its own chunk to every rank (all-gather): (N-1)/N of
the payload each, which is what the trace records, as for a ring [1]. With NCCL parlab uses the native
collectives. Every round is posted in an order that cannot deadlock under NCCL's point-to-point rules
(`_shift_round`; tests/serialised_p2p.py).

[1] nccl-tests, doc/PERFORMANCE.md (bus bandwidth: (N-1)/N of the data for reduce-scatter and all-gather).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from parlab.comm.traced import _nbytes, _run, _strict, get_rank, get_world_size, group_ranks

__all__ = ["reduce_scatter_direct", "reduce_scatter_pieces", "all_gather_direct"]


# ---------------------------------------------------------------------- collectives built from messages
class _Messages:
    """The handle of a collective built from point-to-point messages: `wait()` waits for every message, then
    runs `finish` (e.g. adds up the received chunks) once."""

    def __init__(self, works: list, finish=None):
        self._works, self._finish = works, finish

    def wait(self, *args, **kwargs) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return not self._works and self._finish is None

    @classmethod
    def start(cls, works: list, finish=None, async_op: bool = False) -> "_Messages | None":
        """The handle for `async_op`; a blocking call waits here and returns None, as torch's collectives do."""
        work = cls(works, finish)
        if async_op:
            return work
        work.wait()
        return None


def _shift_round(r: int, n: int, j: int, send, recv) -> list:
    """Post round j of a shift exchange (rank r sends to r + j and receives from r - j, mod n) in an order that
    cannot deadlock where a send waits for its receive to be posted and a rank's messages run one at a time
    (NCCL's rule; tests/serialised_p2p.py): the shift splits the ranks into gcd(n, j) cycles, and in each cycle
    its smallest rank receives first while the others send first, so every cycle unwinds from that rank. gloo
    itself would accept any order."""
    if r < math.gcd(n, j):                       # the smallest rank of its cycle {r, r + j, r + 2j, ...}
        return [recv(), send()]
    return [send(), recv()]


def _sum_into(out: torch.Tensor, mine: torch.Tensor, received, n: int, op) -> None:
    """Finish a direct reduce-scatter on one span: `out` holds the chunk received first (N > 1); add this rank's
    own chunk `mine` and the other received chunks, then divide by N for AVG. With N = 1, `out` = `mine`."""
    if n == 1:
        out.copy_(mine)
        return
    out.add_(mine)
    for e in received:
        out.add_(e)
    if op == ReduceOp.AVG:
        out.div_(n)


def reduce_scatter_direct(output: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, label: str = ""):
    """`reduce_scatter` (SUM or AVG) built from point-to-point messages, the "direct" algorithm: rank r sends
    chunk j of `tensor` straight to rank j and adds the N-1 copies of chunk r it receives to its own. Each
    rank sends (N-1)/N of `tensor`, what a ring reduce-scatter sends; traced as one reduce_scatter. For gloo,
    whose own reduce_scatter is a clone of the input, a whole all-reduce (twice the bytes) and a copy.
    With N > 2 it holds N-2 received chunks at once (a scratch buffer)."""
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"reduce_scatter_direct adds up the chunks: op must be ReduceOp.SUM or ReduceOp.AVG, "
                         f"got {op}; use reduce_scatter for other reductions")
    _strict("reduce_scatter", group, output, tensor, reduce_op=op)
    n, r, ranks, m = get_world_size(group), get_rank(group), group_ranks(group), output.numel()
    if tensor.numel() != n * m:
        raise ValueError(f"reduce_scatter_direct: the input has {tensor.numel()} elements, expected the group size "
                         f"{n} times the output's {m}")
    flat, out = tensor.reshape(-1), output.view(-1)                      # (N*m,), (m,)

    def call():
        extra = torch.empty((max(n - 2, 0), m), dtype=out.dtype, device=out.device)   # (N-2, m) received
        works = []
        for j in range(1, n):
            dst, src = (r + j) % n, (r - j) % n
            send = lambda: dist.isend(flat[dst * m:(dst + 1) * m], ranks[dst], group=group)  # noqa: E731
            recv = lambda: dist.irecv(out if j == 1 else extra[j - 2], ranks[src], group=group)  # noqa: E731
            works += _shift_round(r, n, j, send, recv)

        def finish():
            _sum_into(out, flat[r * m:(r + 1) * m], extra, n, op)
        return _Messages.start(works, finish, async_op=async_op)
    return _run("reduce_scatter", "collective", call, tensor, _nbytes(tensor), group, None, label, async_op)


def reduce_scatter_pieces(output: torch.Tensor, pieces: Sequence[Sequence[torch.Tensor]], op=ReduceOp.SUM, group=None,
                          async_op: bool = False, label: str = ""):
    """`reduce_scatter_direct` without a concatenated input: `pieces[j]` are 1-D tensors whose concatenation is
    chunk j of the input (the part whose reduction ends on group rank j; `output.numel()` elements), cut at the
    same places on every rank. Each piece travels as its own message, received straight into its slice of
    `output`, so the pieces can be gradients themselves (no copy into a staging buffer). Same bytes as
    `reduce_scatter_direct`; traced as one reduce_scatter. The caller must not change the pieces until the
    work is waited for."""
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"reduce_scatter_pieces adds up the chunks: op must be ReduceOp.SUM or ReduceOp.AVG, "
                         f"got {op}; use reduce_scatter for other reductions")
    n, r, ranks, m = get_world_size(group), get_rank(group), group_ranks(group), output.numel()
    if len(pieces) != n or any(sum(p.numel() for p in ps) != m for ps in pieces):
        raise ValueError(f"reduce_scatter_pieces needs {n} lists of pieces (one per group rank), each adding up to "
                         f"the output's {m} elements; got {[sum(p.numel() for p in ps) for ps in pieces]}")
    _strict("reduce_scatter", group, output, *(p for ps in pieces for p in ps), reduce_op=op)
    out = output.view(-1)                                                # (m,)
    bounds = [0]
    for p in pieces[r]:
        bounds.append(bounds[-1] + p.numel())

    def call():
        extra = torch.empty((max(n - 2, 0), m), dtype=out.dtype, device=out.device)   # (N-2, m) received
        works = []
        for j in range(1, n):
            dst, src = (r + j) % n, (r - j) % n
            buf = out if j == 1 else extra[j - 2]
            send = lambda: [dist.isend(p.reshape(-1), ranks[dst], group=group) for p in pieces[dst]]  # noqa: E731
            recv = lambda: [dist.irecv(buf[a:b], ranks[src], group=group)  # noqa: E731
                            for a, b in zip(bounds, bounds[1:])]
            for ws in _shift_round(r, n, j, send, recv):
                works += ws

        def finish():                     # out += own pieces (+ the other received chunks), / N: in 1 MiB steps,
            step = max(1, (1 << 20) // max(1, out.element_size()))       # so each step's operands stay in cache
            for p, a, b in zip(pieces[r], bounds, bounds[1:]):
                p = p.reshape(-1)
                for c in range(a, b, step):
                    o = out[c:min(b, c + step)]
                    _sum_into(o, p[c - a:c - a + o.numel()], (e[c:c + o.numel()] for e in extra), n, op)
        return _Messages.start(works, finish, async_op=async_op)
    return _run("reduce_scatter", "collective", call, output, _nbytes(output) * n, group, None, label, async_op)


def all_gather_direct(outputs: Sequence[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False,
                      label: str = ""):
    """`outputs[j]` becomes group rank j's `tensor` (all the same size), built from point-to-point messages:
    each rank sends its tensor straight to every other one, (N-1)/N of the gathered bytes, what a ring
    all-gather sends; traced as one all_gather. `outputs[rank]` may be `tensor` itself, and the outputs may
    lie anywhere (e.g. chunks of several segments): nothing is staged or copied. For gloo, whose
    all_gather_into_tensor gathers into a fresh buffer and copies it out."""
    _strict("all_gather", group, tensor, *outputs)
    n, r, ranks = get_world_size(group), get_rank(group), group_ranks(group)
    if len(outputs) != n or any(o.numel() != tensor.numel() for o in outputs):
        raise ValueError(f"all_gather_direct needs {n} outputs (one per group rank) of {tensor.numel()} elements "
                         f"each, got {[o.numel() for o in outputs]}")

    def call():
        works = []
        for j in range(1, n):
            dst, src = (r + j) % n, (r - j) % n
            send = lambda: dist.isend(tensor, ranks[dst], group=group)  # noqa: E731
            recv = lambda: dist.irecv(outputs[src], ranks[src], group=group)  # noqa: E731
            works += _shift_round(r, n, j, send, recv)
        if outputs[r].data_ptr() != tensor.data_ptr():
            outputs[r].copy_(tensor)
        return _Messages.start(works, async_op=async_op)
    return _run("all_gather", "collective", call, tensor, _nbytes(tensor) * n, group, None, label, async_op)
