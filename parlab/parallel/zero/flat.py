"""Flat buffers for ZeRO-1/2 (`parlab.parallel.zero.optimizer.ShardedOptimizer`): the owner-major layout and its bookkeeping.

Pure functions on integers and tensors (no torch.distributed), so the layout is tested in milliseconds.

Per dtype, every trainable parameter gets a slot in one flat vector laid out owner by owner; each owner's
segment is padded to the longest one (`seg`), so a single reduce-scatter / all-gather of equal chunks moves
the whole vector (gloo cannot gather unequal sizes):

    flat (Nd * seg,)   [ p3 p0 . | p1 p4 p2 | p5 . . ]     owner 0 | owner 1 | owner 2   ('.' = padding)
                        ^ rank 0's segment: [0, seg)

The parameters themselves become views into this vector, so the all-gather writes every rank's updated
weights straight into the model (no copy in, no copy out). Inside a segment parameters keep their global
order, and global order runs parameter group by parameter group, so the parameters a rank owns in one group
are one contiguous *run* of its segment: an element-wise optimizer (AdamW, SGD, ...) can step each run as
one tensor, with one kernel per operation instead of a Python loop over parameters.

References
    [1] S. Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
        arXiv:1910.02054 (partitioned optimizer state and gradients).
    [2] DeepSpeed, deepspeed/runtime/zero/stage_1_and_2.py (flat, contiguous fp32 partitions stepped as one
        tensor per parameter group).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["FlatLayout", "make_layouts", "owned_runs", "bucket_plans", "split_state", "merge_state", "ELEMENTWISE",
           "STEP_CHUNK_BYTES", "chunk_bounds", "join_chunks", "split_chunks", "split_by_rank", "gloo_messages"]

# Optimizers whose update of an element depends only on that element's gradient and state: stepping a
# concatenation of parameters is the same as stepping each (for the same hyper-parameters).
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop)

# The inner optimizer steps a run in chunks of this many bytes (2^18 fp32 elements), not as one tensor:
# AdamW is a handful of element-wise passes (mul, lerp, addcmul, sqrt, div, addcdiv), each over the whole
# tensor; over a 1 MiB chunk its operands stay in a core's L2 cache between passes, over a 16 MiB run every
# pass streams from memory. Measured (benchmarks/README.md, ZeRO section): AdamW over 50M fp32 elements took
# 0.55-0.85x the per-parameter time in 1 MiB chunks and 1.1-1.6x in 16 MiB runs.
STEP_CHUNK_BYTES = 1 << 20


@dataclass
class FlatLayout:
    """One dtype's owner-major flat vector: `segs[r]` are rank r's global parameter indices in order,
    `offset[i]` where parameter i starts in the (Nd * seg,) vector, `seg` the padded segment length."""
    dtype: torch.dtype
    seg: int
    segs: list[list[int]]
    offset: dict[int, int] = field(default_factory=dict)
    numel: dict[int, int] = field(default_factory=dict)


def make_layouts(numels: list[int], dtypes: list[torch.dtype], owner: dict[int, int], world: int) -> list[FlatLayout]:
    """Per dtype (in order of first appearance among `owner`'s keys), the owner-major layout.

    >>> [(l.seg, l.segs, l.offset) for l in make_layouts([4, 3, 2, 1], [torch.float32] * 4, {0: 0, 1: 1, 2: 1, 3: 0}, 2)]
    [(5, [[0, 3], [1, 2]], {0: 0, 3: 4, 1: 5, 2: 8})]
    """
    out = []
    for dtype in dict.fromkeys(dtypes[i] for i in owner):
        segs = [[i for i in owner if owner[i] == r and dtypes[i] == dtype] for r in range(world)]
        seg = max(sum(numels[i] for i in s) for s in segs)
        lay = FlatLayout(dtype, seg, segs)
        for r, ids in enumerate(segs):
            off = r * seg
            for i in ids:
                lay.offset[i], lay.numel[i] = off, numels[i]
                off += numels[i]
        out.append(lay)
    return out


def owned_runs(lay: FlatLayout, rank: int, group_of: dict[int, int], cap: int | None = None
               ) -> list[tuple[int, int, int, list[int]]]:
    """(group, start, end, indices): maximal runs of rank's segment whose parameters share a group, each at
    most `cap` elements unless one parameter alone is larger; start/end are offsets into the segment.

    >>> lay = make_layouts([4, 3, 2, 1], [torch.float32] * 4, {0: 0, 1: 1, 2: 1, 3: 0}, 2)[0]
    >>> owned_runs(lay, 1, {0: 0, 1: 0, 2: 1, 3: 1})
    [(0, 0, 3, [1]), (1, 3, 5, [2])]
    """
    runs: list[tuple[int, int, int, list[int]]] = []
    base = rank * lay.seg
    for i in lay.segs[rank]:
        a, b = lay.offset[i] - base, lay.offset[i] - base + lay.numel[i]
        if runs and runs[-1][0] == group_of[i] and runs[-1][2] == a and (cap is None or b - runs[-1][1] <= cap):
            g, s, _, ids = runs[-1]
            runs[-1] = (g, s, b, ids + [i])
        else:
            runs.append((group_of[i], a, b, [i]))
    return runs


def bucket_plans(lay: FlatLayout, bucket_numel: int) -> tuple[int, list[list]]:
    """Cut every segment into chunks of `cs` elements: bucket c holds chunk c of each rank's segment, so one
    reduce-scatter of it leaves rank r with chunk c of its own segment, and one all-gather sends it back.
    Returns cs and, per bucket, what `torch.cat` needs, rank by rank: (index, first, last) element slices
    of parameters, and ints for zero padding.

    >>> lay = make_layouts([4, 3, 2, 1], [torch.float32] * 4, {0: 0, 1: 1, 2: 1, 3: 1}, 2)[0]   # seg 6
    >>> bucket_plans(lay, 6)
    (3, [[(0, 0, 3), (1, 0, 3)], [(0, 3, 4), 2, (2, 0, 2), (3, 0, 1)]])
    """
    cs = max(1, min(lay.seg, bucket_numel // len(lay.segs)))
    plans = []
    for lo in range(0, lay.seg, cs):
        hi, plan = min(lo + cs, lay.seg), []
        for r, ids in enumerate(lay.segs):
            base, end = r * lay.seg, lo
            for i in ids:
                a, b = lay.offset[i] - base, lay.offset[i] - base + lay.numel[i]      # segment offsets
                if b > lo and a < hi:
                    plan.append((i, max(lo, a) - a, min(hi, b) - a))
                    end = min(hi, b)
            if end < hi:
                plan.append(hi - end)
        plans.append(plan)
    return cs, plans


def split_state(state: dict, members: list[tuple[int, int, torch.Size]], numel: int) -> dict[int, dict]:
    """A run's optimizer state -> per-parameter states {index: state}: per-element tensors (as long as
    the run) are sliced and reshaped (and cloned, so saving one does not save the whole run); the rest
    (e.g. AdamW's scalar ``step``) is copied to every parameter."""
    out = {}
    for i, off, shape in members:
        n = shape.numel()
        out[i] = {k: (v[off:off + n].view(shape).clone() if v.dim() == 1 and v.numel() == numel else v.clone())
                  if torch.is_tensor(v) else v for k, v in state.items()}
    return out


def merge_state(states: dict[int, dict], members: list[tuple[int, int, torch.Size]], numel: int) -> dict:
    """Per-parameter states -> one run's state: per-element tensors (shaped like their parameter) are
    concatenated, a parameter without state contributing zeros; other entries come from the first
    parameter that has them (a run steps as one tensor, so it has one step count)."""
    have = [(i, s) for i, s in ((i, states.get(i)) for i, _, _ in members) if s]
    if not have:
        return {}
    out = {}
    for k, v in have[0][1].items():
        if torch.is_tensor(v) and v.shape == members[[m[0] for m in members].index(have[0][0])][2] and v.dim() > 0:
            parts = [states[i][k].reshape(-1) if states.get(i) and k in states[i]
                     else torch.zeros(shape.numel(), dtype=v.dtype, device=v.device) for i, _, shape in members]
            out[k] = torch.cat(parts)                                        # (numel,)
            assert out[k].numel() == numel
        else:
            out[k] = v
    return out


def chunk_bounds(numel: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive chunks of at most `chunk` elements covering `numel`.

    >>> chunk_bounds(10, 4)
    [(0, 4), (4, 8), (8, 10)]
    """
    return [(a, min(a + chunk, numel)) for a in range(0, numel, max(1, chunk))]


def join_chunks(states: list[dict], bounds: list[tuple[int, int]]) -> dict:
    """The states of a run's chunks (stepped together) -> the run's state: per-element tensors (1-D, as
    long as their chunk) are concatenated; other entries (e.g. AdamW's ``step``) come from the first chunk.
    {} if the chunks have no state yet."""
    if not states or not all(states):
        return {}
    out = {}
    for k, v in states[0].items():
        if torch.is_tensor(v) and v.dim() == 1 and v.numel() == bounds[0][1] - bounds[0][0]:
            out[k] = torch.cat([s[k] for s in states])                       # (run numel,)
        else:
            out[k] = v
    return out


def split_chunks(state: dict, bounds: list[tuple[int, int]], numel: int) -> list[dict]:
    """A run's state -> one state per chunk: per-element tensors (1-D, `numel` long) sliced and cloned,
    everything else cloned per chunk (each chunk counts its own steps)."""
    if not state:
        return [{} for _ in bounds]
    return [{k: (v[a:b].clone() if v.dim() == 1 and v.numel() == numel else v.clone()) if torch.is_tensor(v) else v
             for k, v in state.items()} for a, b in bounds]


def split_by_rank(plan: list, n: int) -> list[list]:
    """A bucket's plan entries (a gradient slice ``(i, a, b)`` or an int of padding), cut into the Nd chunks of
    `n` elements that go to each rank: chunk r holds the entries of rank r's segment."""
    per, filled = [[]], 0
    for x in plan:
        if filled == n:
            per.append([])
            filled = 0
        per[-1].append(x)
        filled += x if isinstance(x, int) else x[2] - x[1]
    return per


def gloo_messages(per_rank: list[list], min_n: int) -> tuple[list[list], int]:
    """The messages of one bucket on gloo, per rank: [(entries, length, staging start | None)], and the number
    of staged elements. A piece of at least `min_n` elements goes straight from .grad (start None); a run of
    smaller neighbours is copied into one slice of a small staging buffer and goes as one message. Every message
    costs a rendezvous of the two ranks' threads (milliseconds on a loaded machine), every copied byte CPU time:
    big pieces are not copied, small ones not sent alone."""
    used, rows = 0, []
    for plan in per_rank:
        row: list = []
        for x in plan:
            n = x if isinstance(x, int) else x[2] - x[1]
            if n >= min_n:
                row.append(([x], n, None))
            elif row and row[-1][2] is not None:                 # extend the staged run
                row[-1] = (row[-1][0] + [x], row[-1][1] + n, row[-1][2])
                used += n
            else:
                row.append(([x], n, used))
                used += n
        rows.append(row)
    return rows, used
