"""Ring attention's plan, without communication: how the sequence is laid out over the ranks, which block each
rank computes at each ring step, what a ring costs (bytes, memory, the overlap threshold) and a ring read back
from a trace. Pure functions (torch tensors for the index maps, no torch.distributed); `parlab.parallel.context.ring`
runs the plan and re-exports every name here.

* layouts: ``contiguous`` (rank r holds positions [r c, (r+1) c)) and ``zigzag`` (half-chunks r and 2P-1-r),
  the load-balanced causal layout of ring-flash-attention [2] (see `parlab.parallel.context.ring`'s docstring);
* `block_plan` / `work_matrix`: the causal block rule per (rank, step), the picture a lesson plots;
* `ring_bytes_per_rank`, `attention_memory_per_rank`, `overlap_threshold`: back-of-the-envelope formulas [1];
* `ring_steps`: a traced ring as plot-ready rows.

References
    [1] H. Liu, M. Zaharia, P. Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
        Context", arXiv:2310.01889 (2023), section 3 (the overlap condition).
    [2] zhuzilin/ring-flash-attention (zigzag_ring_flash_attn.py), the zigzag layout.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import torch

__all__ = ["LAYOUTS", "chunk_ids", "check_seq_len", "shard_positions", "shard_sequence", "unshard_sequence",
           "BlockPlan", "block_plan", "work_matrix", "ring_bytes_per_rank", "ring_steps",
           "attention_memory_per_rank", "overlap_threshold"]

LAYOUTS = ("contiguous", "zigzag")


# ---------------------------------------------------------------------- layouts (pure)
def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunk_ids(rank: int, P: int, layout: str = "zigzag") -> list[int]:
    """Which chunks rank `rank` holds: contiguous -> [r] of P chunks; zigzag -> [r, 2P-1-r] of 2P."""
    _check_layout(layout)
    if not 0 <= rank < P:
        raise ValueError(f"rank must be in [0, {P}), got {rank}")
    return [rank] if layout == "contiguous" else [rank, 2 * P - 1 - rank]


def check_seq_len(S: int, P: int, layout: str = "zigzag") -> None:
    """Raise a ValueError unless a sequence of length S splits evenly for P ranks in `layout`."""
    _check_layout(layout)
    n = P if layout == "contiguous" else 2 * P
    if S < n or S % n:
        ok = [m * n for m in range(1, 4)]
        raise ValueError(f"sequence length {S} cannot be split into {n} equal chunks ({layout} layout, P={P}); "
                         f"use a multiple of {n}, e.g. {ok}")


def shard_positions(S: int, P: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Global positions held by `rank`, increasing: (S/P,) long. Used to shard data and position embeddings."""
    check_seq_len(S, P, layout)
    n = P if layout == "contiguous" else 2 * P
    size = S // n
    return torch.cat([torch.arange(j * size, (j + 1) * size) for j in chunk_ids(rank, P, layout)])  # (S/P,)


def shard_sequence(x: torch.Tensor, P: int, rank: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's positions of `x` along `dim` (e.g. token ids (B, S) -> (B, S/P))."""
    pos = shard_positions(x.shape[dim], P, rank, layout).to(x.device)
    return x.index_select(dim, pos)


def unshard_sequence(shards: list[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: put the P shards (in rank order) back in sequence order along `dim`."""
    P = len(shards)
    S = sum(s.shape[dim] for s in shards)
    order = torch.cat([shard_positions(S, P, r, layout) for r in range(P)])  # position of each gathered row
    full = torch.cat(shards, dim=dim)
    return full.index_select(dim, torch.argsort(order).to(full.device))


# ---------------------------------------------------------------------- the ring schedule (pure)
class BlockPlan(NamedTuple):
    """What rank r computes at one ring step: K/V of rank `src`; query rows `q` and key rows `k`, each
    'all' or one half ('front' / 'back'); `mask`: apply the causal (lower-triangular) mask."""
    src: int
    q: str
    k: str
    mask: bool

    @property
    def work(self) -> float:
        """Fraction of a (c x c) block of scores computed."""
        return (1.0 if self.q == "all" else 0.5) * (1.0 if self.k == "all" else 0.5)


def block_plan(rank: int, step: int, P: int, causal: bool = True, layout: str = "zigzag") -> BlockPlan | None:
    """The block rank `rank` computes at ring step `step` (None: nothing, the whole block is masked)."""
    _check_layout(layout)
    src = (rank - step) % P
    if not causal:
        return BlockPlan(src, "all", "all", False)
    if step == 0:                                     # own K/V: local positions are increasing, so plain tril
        return BlockPlan(src, "all", "all", True)
    if layout == "contiguous":                        # key chunk src is entirely before (src < r) or after
        return BlockPlan(src, "all", "all", False) if src < rank else None
    if src < rank:                                    # key chunk src precedes both query chunks
        return BlockPlan(src, "all", "front", False)
    return BlockPlan(src, "back", "all", False)       # query chunk 2P-1-r follows both key chunks


def work_matrix(P: int, causal: bool = True, layout: str = "zigzag") -> list[list[float]]:
    """Blocks of scores computed, rank x step, in units of one (c x c) block: the heat map of the
    load balance. Contiguous causal: row r sums to r + 1. Zigzag causal: every row sums to (P + 1) / 2."""
    return [[(p.work if (p := block_plan(r, s, P, causal, layout)) else 0.0) for s in range(P)] for r in range(P)]


def ring_bytes_per_rank(P: int, B: int, nh: int, c: int, hd: int, element_size: int = 4,
                        grad_element_size: int | None = None) -> dict[str, int]:
    """Bytes each rank sends per ring-attention layer (one K/V block = 2 B nh c hd elements):
    forward (P-1) K/V blocks; backward (P-1) K/V blocks and P dK/dV blocks. `element_size` is the
    inputs' (K/V travel in it); the dK/dV sums travel in `grad_element_size`, by default as
    `ring_attention` sends them: at least float32 (4 bytes), so 4 for 16-bit inputs, 8 for float64."""
    grad_element_size = max(element_size, 4) if grad_element_size is None else grad_element_size
    block = 2 * B * nh * c * hd * element_size
    grad_block = 2 * B * nh * c * hd * grad_element_size
    return {"forward": (P - 1) * block, "backward": (P - 1) * block + P * grad_block if P > 1 else 0}


# ---------------------------------------------------------------------- reading a ring back from a trace
_LABEL = re.compile(r"(?:ring )?(fwd|bwd) (dkv|kv)? ?step (\d+)")
_BLOCK = re.compile(r".* kv of rank (\d+) q (\w+) k (\w+)")


def ring_steps(trace) -> list[dict]:
    """The ring's events of a `parlab.Trace` as plot-ready rows: rank, phase ('fwd'/'bwd'), step, what
    ('compute', 'send kv', 'recv kv', 'send dkv', 'recv dkv'), peer, bytes, start and end (seconds from
    the first event); compute rows also carry src (whose K/V block), q and k (the rows computed: 'all',
    'front' or 'back' half). Enough to animate K/V blocks moving and each rank's output filling in."""
    rows, t0 = [], trace.t0
    for e in trace.events:
        is_compute = e.kind == "compute" and e.op == "ring attention"
        if not (is_compute or (e.kind == "p2p" and e.label.startswith("ring "))):
            continue
        m = _LABEL.match(e.label)
        if m is None:
            continue
        phase, payload, step = m.group(1), m.group(2), int(m.group(3))
        row = {"rank": e.rank, "phase": phase, "step": step,
               "what": "compute" if is_compute else f"{e.op} {payload}", "peer": e.peer,
               "bytes": e.nbytes, "start": e.start - t0, "end": e.end - t0}
        if is_compute and (b := _BLOCK.match(e.label)):
            row.update(src=int(b.group(1)), q=b.group(2), k=b.group(3))
        rows.append(row)
    return rows


# ---------------------------------------------------------------------- back-of-the-envelope formulas
def attention_memory_per_rank(S: int, P: int, nh: int, hd: int, B: int = 1, method: str = "ring",
                              element_size: int = 2) -> dict[str, float]:
    """Bytes one rank holds for one attention layer's forward (formulas, not a measurement).

    full     (P = 1)   q, k, v, out: 4 B S H;  scores: B nh S^2
    ring               own q, k, v, out: 4 B c H, c = S/P; the K/V block in flight: 2 B c H;
                       one block of scores: B nh c^2 (a fused kernel keeps only a tile, the bound is lower)
    ulysses            own shards 4 B c H; after the all-to-all q, k, v, out of all S positions and nh/P
                       heads: 4 B S H / P; scores B (nh/P) S^2 (quadratic in S unless the kernel is fused)
    H = nh hd. Returns {'tensors', 'scores', 'total'} in bytes."""
    if method not in ("full", "ring", "ulysses"):
        raise ValueError(f"method must be 'full', 'ring' or 'ulysses', got {method!r}")
    H = nh * hd
    if method == "full":
        tensors, scores = 4 * B * S * H, B * nh * S * S
    elif method == "ring":
        c = S / P
        tensors, scores = 6 * B * c * H, B * nh * c * c
    else:
        tensors, scores = 4 * B * S * H / P + 4 * B * S * H / P, B * nh / P * S * S
    tensors, scores = tensors * element_size, scores * element_size
    return {"tensors": tensors, "scores": scores, "total": tensors + scores}


def overlap_threshold(flops: float, bandwidth: float, element_size: int = 2) -> float:
    """Smallest block length c for which a ring step's compute hides the transfer of the next K/V block.

    compute of one (c x c) block, forward: 4 c^2 H FLOPs (q k^T and p v, 2 c^2 H each) -> 4 c^2 H / flops s
    transfer of one K/V block: 2 c H element_size bytes                              -> 2 c H e / bandwidth s
    hidden when 4 c^2 H / flops >= 2 c H e / bandwidth, i.e. c >= e flops / (2 bandwidth);
    in 16-bit (e = 2): c >= flops / bandwidth [1]. H cancels."""
    return element_size * flops / (2 * bandwidth)
