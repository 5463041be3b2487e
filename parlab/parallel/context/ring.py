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
from dataclasses import dataclass, field

import torch

from parlab import comm
from parlab.parallel.context.ring_plan import (LAYOUTS, BlockPlan, _check_layout, attention_memory_per_rank, block_plan,
    check_seq_len, chunk_ids, overlap_threshold, ring_bytes_per_rank, ring_steps, shard_positions, shard_sequence,
    unshard_sequence, work_matrix)
from parlab.trace import region

__all__ = ["LAYOUTS", "chunk_ids", "check_seq_len", "shard_positions", "shard_sequence", "unshard_sequence",
           "BlockPlan", "block_plan", "work_matrix", "merge_partials", "attention_block", "RingStats",
           "ring_attention", "RingAttention", "ring_steps", "ring_bytes_per_rank",
           "attention_memory_per_rank", "overlap_threshold"]

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
            p, lse = _masked_softmax(s)                     # (B, nh, cq, ck), (B, nh, cq)
        else:
            lse = torch.logsumexp(s, dim=-1)                # (B, nh, cq)
            p = torch.exp(s - lse.unsqueeze(-1))            # (B, nh, cq, ck)
        p = p.to(v.dtype).to(acc)                           # P in the input's precision
        return p @ v.to(acc), lse                           # (B, nh, cq, hd) in float32+, (B, nh, cq)


# Exponents are clamped to [_EXP_FLOOR, 0] where masked entries would give exp(-inf): a CPU's vectorised exp
# takes a slow path for inputs that underflow (a (4, 256, 256) exp: 216 us on ordinary scores, 490-920 us with the
# causal half at -inf, 2.5-6.4 ms at -100; benchmarks/README.md), and exp(-80) = 1.8e-35 is below float32's
# resolution of any row sum (>= 1), so the clamp changes no result.
_EXP_FLOOR = -80.0


def _masked_softmax(s: torch.Tensor):
    """Causal softmax of a diagonal block's scores s (B, nh, c, c) -> (P, lse), without exponentials of -inf:

        naive:   s[i, j > i] = -inf;  lse = logsumexp(s, -1);  P = exp(s - lse)
        here:    m = max_{j <= i} s[i, j];  e = exp(clamp(s - m, floor, 0)) * tril;  lse = m + log(sum_j e);
                 P = e / sum_j e
    (the clamp at 0 keeps a masked score above the row's maximum from overflowing before the mask zeroes it)."""
    keep = _tril(s)                                                  # (c, c) 1 on and below the diagonal
    m = (s + _causal_bias(s)).amax(dim=-1, keepdim=True)             # (B, nh, c, 1) max over the visible keys
    e = torch.exp((s - m).clamp_(_EXP_FLOOR, 0.0)) * keep            # (B, nh, c, c)
    total = e.sum(dim=-1, keepdim=True)                              # (B, nh, c, 1), >= 1 (the max's own term)
    return e / total, (m + torch.log(total)).squeeze(-1)


def _tril(s: torch.Tensor) -> torch.Tensor:
    """(cq, ck) in s's dtype: 1 on and below the diagonal, 0 above it."""
    return torch.ones(s.shape[-2:], dtype=s.dtype, device=s.device).tril()


def _causal_bias(s: torch.Tensor) -> torch.Tensor:
    """(cq, ck): 0 on and below the diagonal, -inf above it. Added to a diagonal block's scores s (B, nh, cq, ck)
    it hides the masked keys from a row maximum (`_masked_softmax`): the same as ``s.masked_fill(~tril, -inf)``,
    but an add broadcasts in vectorised code on a CPU, where masked_fill with a broadcast mask ran ~8x slower
    (250 us vs 30 us for 4 x 256 x 256)."""
    return torch.full(s.shape[-2:], float("-inf"), dtype=s.dtype, device=s.device).triu(1)


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
    if mask:                                                 # masked entries 0, no exp(-inf) (_masked_softmax)
        p = torch.exp((s - lse.unsqueeze(-1)).clamp_(_EXP_FLOOR, 0.0)) * _tril(s)   # (B, nh, cq, ck)
    else:
        p = torch.exp(s - lse.unsqueeze(-1))                 # (B, nh, cq, ck)
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
