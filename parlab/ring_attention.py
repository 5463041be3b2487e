"""Ring attention: exact attention over a sequence split across P ranks, K/V blocks passed around a ring.

Each of the P ranks of a context-parallel group holds a chunk of c = S/P positions of Q, K and V.
Attention needs every query to meet every (allowed) key, so the K/V blocks travel: at ring step i,
rank r holds the K/V block of rank (r - i) mod P, attends its own queries to it, and passes it on
to rank r + 1. After P steps every query has met every key, and each rank's output for its own
queries is exact. The partial results are combined with the online-softmax merge [3, 4] (below),
so no rank ever holds more than two K/V blocks and one (c x c) score matrix [1].

    step 0      step 1      step 2      step 3          rank r's queries (rows) meet the K/V
    r0: K0V0    r0: K3V3    r0: K2V2    r0: K1V1        block of rank (r - step) mod P;
    r1: K1V1    r1: K0V0    r1: K3V3    r1: K2V2        while computing with the current block,
    r2: K2V2    r2: K1V1    r2: K0V0    r2: K3V3        the next one is already on its way
    r3: K3V3    r3: K2V2    r3: K1V1    r3: K0V0        (isend/irecv started before compute).

Causal masking and load balance [1, 2]. With contiguous chunks (rank r holds positions
[r c, (r+1) c)), a causal query chunk r only sees key chunks 0..r: rank r computes r + 1 blocks of
P, so the last rank works P times as long as the first, and everyone waits for it. The zigzag
layout cuts the sequence in 2P half-chunks and gives rank r half-chunks r and 2P-1-r (an early
and a late one). Then at every step after the first, each rank computes exactly half a block:

    step 0 (own K/V):   causal attention over the two local halves (positions stay increasing)
    source s < r:       all local queries x the *front* key half (chunk s); chunk 2P-1-s is in the future
    source s > r:       the *back* query half (chunk 2P-1-r) x all keys; chunk r precedes both key halves

`block_plan` states this rule, `work_matrix` turns it into the rank x step picture a lesson plots,
and `RingStats` counts what the kernels really computed, so tests check the two agree.

Backward is written out, not obtained by autograd through the ring: the forward saves only the
local q, k, v, the output and the log-sum-exp; the backward sends K/V around the ring again,
recomputes each block's probabilities from the saved log-sum-exp (as FlashAttention does [4]),
keeps dQ at home and sends dK/dV around the ring *with* their K/V block, so after P hops the
accumulated dK/dV arrive back at the rank that owns them.

Mixed precision (bf16 / fp16 inputs): a block's scores q k^T, softmax and P V sums run in float32 (P is
rounded to the input dtype for P V, as in FlashAttention; autocast is off inside a block); out and lse
accumulate in float32 over the P merges (out is cast to the input dtype once, at the end; lse stays
float32 for the backward), as in ring-flash-attention [2]; dQ sums its P blocks in float32. The
travelling dK/dV are partial sums every rank adds to, so they accumulate, and therefore travel, in
float32 (as ring-flash-attention's dk/dv [2]), cast to the input dtype once, at home. On the wire: K/V
blocks in the input dtype (data, not sums), dK/dV in float32 (twice a bf16 K/V block's bytes). Measured
against float64 at P = 4, S = 64 (tests/test_ring_attention.py): max |error| of dK 0.0094, dV 0.0071; with
the dK/dV sums in bf16 0.0114, 0.0106; with bf16 scores as well, dK 0.020.

Communication per rank (K/V block = 2 B nh c hd elements, one message):
    forward   (P - 1) K/V blocks
    backward  (P - 1) K/V blocks + P dK/dV blocks (of the same numel, in float32 for 16-bit inputs)

References
    [1] H. Liu, M. Zaharia, P. Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
        Context", arXiv:2310.01889 (2023).
    [2] zhuzilin/ring-flash-attention (zigzag_ring_flash_attn.py, utils.py), the zigzag layout.
    [3] M. Milakov, N. Gimelshein, "Online normalizer calculation for softmax", arXiv:1805.02867.
    [4] T. Dao et al., "FlashAttention", arXiv:2205.14135, algorithm 1 (forward) and 2 (backward).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import comm
from .trace import region

__all__ = ["LAYOUTS", "chunk_ids", "check_seq_len", "shard_positions", "shard_sequence", "unshard_sequence",
           "BlockPlan", "block_plan", "work_matrix", "merge_partials", "attention_block", "RingStats",
           "ring_attention", "RingAttention", "ring_steps", "ring_bytes_per_rank",
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


# ---------------------------------------------------------------------- one block and the merge
def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: bool = False):
    """Attention of q (B, nh, cq, hd) over k, v (B, nh, ck, hd) -> (out (B, nh, cq, hd), lse (B, nh, cq)).
    lse is log sum_j exp(score_j): what a later merge needs to renormalise. The softmax runs in at least
    float32 and lse comes back in it (as flash attention returns its lse), out in the input dtype."""
    out, lse = _attention_block(q, k, v, mask)
    return out.to(v.dtype), lse                             # (B, nh, cq, hd), (B, nh, cq)


def _attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: bool = False):
    """`attention_block` with out also in the accumulation dtype (float32 for 16-bit inputs), as a fused
    kernel's fp32 accumulators hold it [4]: the scores q k^T and the sum P V accumulate in float32; the
    probabilities P are rounded to the input dtype for the P V product, as FlashAttention does."""
    acc = _acc_dtype(q.dtype)
    with torch.autocast(q.device.type, enabled=False):      # the precision is set here, not by an outer autocast
        s = q.to(acc) @ k.to(acc).transpose(-2, -1) / math.sqrt(q.shape[-1])   # (B, nh, cq, ck), float32+
        #  (rounding the scores to bf16 first would make lse disagree with the backward's float32 scores)
        if mask:
            keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()  # (cq, ck), cq == ck
            s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)                    # (B, nh, cq)
        p = torch.exp(s - lse.unsqueeze(-1)).to(v.dtype).to(acc)   # (B, nh, cq, ck), P in the input's precision
        return p @ v.to(acc), lse                           # (B, nh, cq, hd) in float32+, (B, nh, cq)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where sums across blocks accumulate: float32 for 16-bit inputs, else the input dtype (float64 stays)."""
    return torch.promote_types(dtype, torch.float32)


def merge_partials(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor):
    """Online-softmax merge of two partial attentions of the same queries over disjoint key sets.

    out (B, nh, c, hd), lse (B, nh, c) -> (out, lse) of the attention over the union of the keys.

        naive (overflows exp for large scores):
            lse = log(exp(lse1) + exp(lse2))
            out = (exp(lse1) * out1 + exp(lse2) * out2) / exp(lse)
        stable (every exponent <= 0):
    """
    lse = torch.logaddexp(lse1, lse2)                                   # (B, nh, c)
    out = torch.exp(lse1 - lse).unsqueeze(-1) * out1 + torch.exp(lse2 - lse).unsqueeze(-1) * out2
    return out, lse                                                     # (B, nh, c, hd), (B, nh, c)


def _block_backward(dout, q, k, v, lse, delta, mask: bool):
    """Gradients of one block given the *final* lse of the queries (so P below is the true softmax
    restricted to this block): P = exp(S - lse); dV = P^T dO; dS = P * (dO V^T - delta); dQ = dS K / sqrt(hd);
    dK = dS^T Q / sqrt(hd), with delta = rowsum(dO * O) [4, algorithm 2]."""
    with torch.autocast(lse.device.type, enabled=False):    # float32 math even if backward runs under autocast
        return _block_backward_math(dout, q, k, v, lse, delta, mask)


def _block_backward_math(dout, q, k, v, lse, delta, mask: bool):
    scale = 1.0 / math.sqrt(q.shape[-1])
    dout, q, k, v = (t.to(lse.dtype) for t in (dout, q, k, v))   # 16-bit inputs: the block's math in float32
    s = q @ k.transpose(-2, -1) * scale                     # (B, nh, cq, ck)
    if mask:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))                     # (B, nh, cq, ck), masked entries 0
    dv = p.transpose(-2, -1) @ dout                          # (B, nh, ck, hd)
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))  # (B, nh, cq, ck)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv  # dq (cq), dk (ck), dv (ck)


def _rows(part: str, c: int) -> slice:
    return slice(0, c) if part == "all" else (slice(0, c // 2) if part == "front" else slice(c // 2, c))


# ---------------------------------------------------------------------- the ring
@dataclass
class RingStats:
    """Work counters filled in by `ring_attention`: score entries computed per ring step, per (batch, head),
    summed over calls (one forward and one backward per layer)."""
    forward: list[int] = field(default_factory=list)
    backward: list[int] = field(default_factory=list)

    def add(self, which: str, step: int, entries: int) -> None:
        row = getattr(self, which)
        row.extend([0] * (step + 1 - len(row)))
        row[step] += entries


def _shift(t: torch.Tensor, me: int, nxt: int, prv: int, group, label: str):
    """Start sending `t` to the next rank and receiving the previous rank's into a new buffer.

    Even ranks of the ring (`me`, the rank in the group) post the send first, odd ranks the receive:
    with P = 2 both messages share one NCCL pair-communicator and stream, and send-before-send on both
    sides can wait forever for large messages (gloo does not care)."""
    buf = torch.empty_like(t)
    if me % 2 == 0:
        works = [comm.isend(t, nxt, group=group, label=label), comm.irecv(buf, prv, group=group, label=label)]
    else:
        works = [comm.irecv(buf, prv, group=group, label=label), comm.isend(t, nxt, group=group, label=label)]
    return buf, works


class RingAttention(torch.autograd.Function):
    """forward: ring of K/V blocks with online-softmax merge; backward: ring of K/V plus dK/dV travelling home."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, stats):
        P, me = comm.get_world_size(group), comm.get_rank(group)
        ranks = comm.group_ranks(group)
        nxt, prv = ranks[(me + 1) % P], ranks[(me - 1) % P]
        c = q.shape[-2]
        kv = torch.stack([k, v]).contiguous()                # (2, B, nh, c, hd): one message per step
        acc = _acc_dtype(q.dtype)                            # out and lse accumulate in float32 over P merges
        out = lse = None
        for step in range(P):
            if step < P - 1:                                 # next block in flight while we compute this one
                kv_next, works = _shift(kv, me, nxt, prv, group, f"ring fwd kv step {step}")
            plan = block_plan(me, step, P, causal, layout)
            if plan is not None:
                qr, kr = _rows(plan.q, c), _rows(plan.k, c)
                with region("ring attention", label=f"fwd step {step} kv of rank {plan.src} q {plan.q} k {plan.k}"):
                    o, l = _attention_block(q[..., qr, :], kv[0][..., kr, :], kv[1][..., kr, :], plan.mask)
                    if out is None:                          # step 0 always computes all rows
                        out, lse = o.to(acc), l
                    else:                                    # (no autograd inside forward: in place is fine)
                        out[..., qr, :], lse[..., qr] = merge_partials(out[..., qr, :], lse[..., qr], o.to(acc), l)
            if stats is not None:                            # 0 for a fully masked block
                stats.add("forward", step, 0 if plan is None else (qr.stop - qr.start) * (kr.stop - kr.start))
            if step < P - 1:
                for w in works:
                    w.wait()
                kv = kv_next
        out = out.to(q.dtype)                                # (B, nh, c, hd); lse (B, nh, c) stays float32
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.layout, ctx.stats = group, causal, layout, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        P, me = comm.get_world_size(group), comm.get_rank(group)
        ranks = comm.group_ranks(group)
        nxt, prv = ranks[(me + 1) % P], ranks[(me - 1) % P]
        c = q.shape[-2]
        dout = dout.contiguous()
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)   # (B, nh, c), float32 for 16-bit inputs
        dq = torch.zeros_like(q, dtype=lse.dtype)            # (B, nh, c, hd), stays home, sums P blocks in float32
        kv = torch.stack([k, v]).contiguous()                # (2, B, nh, c, hd), travels in the input dtype
        dkv = dkv_works = None                               # the dK/dV of the visiting block, travels with it,
                                                             # a running sum: float32 for 16-bit inputs
        for step in range(P):
            if step < P - 1:
                kv_next, works = _shift(kv, me, nxt, prv, group, f"ring bwd kv step {step}")
            plan = block_plan(me, step, P, ctx.causal, ctx.layout)
            grad = torch.zeros_like(kv, dtype=lse.dtype)     # (2, B, nh, c, hd): this step's dK, dV, float32+
            if plan is not None:
                qr, kr = _rows(plan.q, c), _rows(plan.k, c)
                with region("ring attention", label=f"bwd step {step} kv of rank {plan.src} q {plan.q} k {plan.k}"):
                    dq_, dk_, dv_ = _block_backward(dout[..., qr, :], q[..., qr, :], kv[0][..., kr, :],
                                                    kv[1][..., kr, :], lse[..., qr], delta[..., qr], plan.mask)
                    dq[..., qr, :] += dq_
                    grad[0][..., kr, :] = dk_
                    grad[1][..., kr, :] = dv_
            if ctx.stats is not None:
                ctx.stats.add("backward", step, 0 if plan is None else (qr.stop - qr.start) * (kr.stop - kr.start))
            if dkv_works is not None:                        # the previous rank's partial dK/dV for this block
                for w in dkv_works:
                    w.wait()
                grad += dkv
            if P == 1:
                dkv = grad
            else:
                dkv, dkv_works = _shift(grad, me, nxt, prv, group, f"ring bwd dkv step {step}")
            if step < P - 1:
                for w in works:
                    w.wait()
                kv = kv_next
        for w in dkv_works or ():                            # after P hops our own dK/dV are home
            w.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                   layout: str = "zigzag", stats: RingStats | None = None) -> torch.Tensor:
    """Exact attention over a sequence sharded across `group`; q, k, v (B, nh, c, hd) -> (B, nh, c, hd).

    Each rank passes its own chunk of c = S/P positions, laid out by `layout` (see `shard_sequence`);
    the output holds the same positions. `stats` (a RingStats) collects the work per ring step."""
    _check_layout(layout)
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise ValueError(f"ring_attention needs q, k, v of one shape (B, nh, c, hd); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if causal and layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"zigzag layout holds two half-chunks per rank, so the local length must be even; got "
                         f"{q.shape[-2]}: use a sequence length that is a multiple of 2P")
    return RingAttention.apply(q, k, v, group, causal, layout, stats)


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
