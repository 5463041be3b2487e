"""Sequence (context) parallelism: Ulysses all-to-all attention, and the tiny GPT run sequence-sharded.

Long sequences do not fit one GPU's activations, so P ranks each take S/P positions of every
sequence. Everything in a transformer layer is position-wise (LayerNorm, the q/k/v/proj Linears,
the MLP) except attention, where every query needs every earlier key. Two ways around that:

Ulysses [1] (this module). Re-shard around attention: an all-to-all turns "S/P positions, all nh
heads" into "all S positions, nh/P heads", each rank runs ordinary attention on its heads, and a
second all-to-all turns the result back. In a (sequence x heads) grid, with P = 2:

    before (sequence-sharded)      after all-to-all (head-sharded)
          heads 0-1  heads 2-3            heads 0-1  heads 2-3
    s 0-3   rank 0     rank 0       s 0-3   rank 0     rank 1
    s 4-7   rank 1     rank 1       s 4-7   rank 0     rank 1

Per layer each rank all-to-alls q, k, v (fused, one call) and the output: a payload of
4 B S H / P elements forward and the same backward (the conjugate all-to-alls), of which
(P - 1)/P leaves the rank. Constant when S and P grow together. Needs nh % P == 0.

Ring attention [2] (``parlab.parallel.context.ring``): keep the sequence sharding and pass K/V blocks
around a ring; no limit from the number of heads, and the traffic can hide behind compute.

``ContextParallelGPT`` plugs either into the tiny GPT through ``CausalSelfAttention.core_attention``:
token ids and targets are sharded along the sequence (``shard_sequence``, contiguous or zigzag),
position embeddings use each rank's *global* positions, and ``average_gradients`` averages the
gradients over the CP group. The full model's loss is the mean over the N non-ignored targets of
the whole sequence (ignore_index -100 marks padding), which the ranks share unevenly when padding
sits at the end: so every rank's loss is its share P * (its sum) / N, N counted over the CP group
(one all-reduce of an integer per forward). The average of the shares is the full model's loss
and the averaged gradients are its gradients; without padding each share is the local mean.

Forward/backward pairs (named for the direction, as in Megatron's mappings.py):
    _SeqToHead   forward: all-to-all sequence-sharded -> head-sharded; backward: head -> sequence
    _HeadToSeq   forward: all-to-all head-sharded -> sequence-sharded; backward: sequence -> head

References
    [1] S. A. Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
        Long Sequence Transformer Models", arXiv:2309.14509 (2023), section 3.
    [2] H. Liu, M. Zaharia, P. Abbeel, "Ring Attention with Blockwise Transformers", arXiv:2310.01889.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from parlab import comm
from parlab.models import GPT, causal_attention, count_targets, weighted_mean_loss
from parlab.parallel.context.ring import LAYOUTS, RingStats, check_seq_len, ring_attention, shard_positions, shard_sequence

__all__ = ["seq_to_head", "head_to_seq", "ulysses_attention", "ulysses_bytes_per_layer", "ContextParallelGPT"]


def ulysses_bytes_per_layer(B: int, S: int, H: int, P: int, element_size: int = 4) -> dict[str, float]:
    """All-to-all traffic of one Ulysses layer per rank, each way (forward, and again backward):
    payload 4 B S H / P (q, k, v and the output, each (B, S/P, H)); sent (P-1)/P of it."""
    payload = 4 * B * S * H // P * element_size
    return {"payload": payload, "sent": payload * (P - 1) / P}


# ---------------------------------------------------------------------- the all-to-all pair
def _check_heads(nh: int, P: int) -> None:
    if nh % P:
        ok = [p for p in range(1, nh + 1) if nh % p == 0]
        raise ValueError(f"Ulysses splits heads across ranks: n_head {nh} is not divisible by P {P}; "
                         f"choose P in {ok} (or use ring attention, which has no such limit)")


def _a2a_seq_to_head(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """(*L, nh, s, hd) holding positions chunk r -> (*L, nh/P, P*s, hd) holding head group r."""
    P = comm.get_world_size(group)
    if P == 1:
        return x
    *L, nh, s, hd = x.shape
    _check_heads(nh, P)
    send = x.reshape(*L, P, nh // P, s, hd).movedim(-4, 0).contiguous()   # (P, *L, nh/P, s, hd): part j -> rank j
    recv = torch.empty_like(send)                                          # recv[j]: rank j's positions, my heads
    comm.all_to_all(recv, send, group=group, label=label)
    return recv.movedim(0, -3).reshape(*L, nh // P, P * s, hd)            # (*L, nh/P, S, hd)


def _a2a_head_to_seq(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """(*L, nh/P, S, hd) holding head group r -> (*L, nh, S/P, hd) holding positions chunk r."""
    P = comm.get_world_size(group)
    if P == 1:
        return x
    *L, h, S, hd = x.shape
    send = x.reshape(*L, h, P, S // P, hd).movedim(-3, 0).contiguous()    # (P, *L, nh/P, s, hd): positions j -> rank j
    recv = torch.empty_like(send)                                          # recv[j]: rank j's heads, my positions
    comm.all_to_all(recv, send, group=group, label=label)
    return recv.movedim(0, -4).reshape(*L, P * h, S // P, hd)             # (*L, nh, s, hd)


class _SeqToHead(torch.autograd.Function):
    """forward: all-to-all sequence-sharded -> head-sharded; backward: all-to-all head -> sequence."""

    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return _a2a_seq_to_head(x, group, label)

    @staticmethod
    def backward(ctx, g):
        return _a2a_head_to_seq(g, ctx.group, f"{ctx.label} (bwd)"), None, None


class _HeadToSeq(torch.autograd.Function):
    """forward: all-to-all head-sharded -> sequence-sharded; backward: all-to-all sequence -> head."""

    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return _a2a_head_to_seq(x, group, label)

    @staticmethod
    def backward(ctx, g):
        return _a2a_seq_to_head(g, ctx.group, f"{ctx.label} (bwd)"), None, None


def seq_to_head(x: torch.Tensor, group=None, label: str = "ulysses seq->head") -> torch.Tensor:
    """Differentiable all-to-all: (*L, nh, S/P, hd) -> (*L, nh/P, S, hd)."""
    return _SeqToHead.apply(x, group, label)


def head_to_seq(x: torch.Tensor, group=None, label: str = "ulysses head->seq") -> torch.Tensor:
    """Differentiable all-to-all: (*L, nh/P, S, hd) -> (*L, nh, S/P, hd)."""
    return _HeadToSeq.apply(x, group, label)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                      layout: str = "contiguous") -> torch.Tensor:
    """Attention over a sequence sharded across `group`: q, k, v (B, nh, S/P, hd) -> (B, nh, S/P, hd).

    Each rank holds the positions `shard_positions(S, P, rank, layout)`; after the all-to-all a rank
    holds every rank's positions in rank order, which for the zigzag layout are put back in sequence
    order (a local permutation) before the causal mask is applied."""
    P = comm.get_world_size(group)
    if not (q.shape == k.shape == v.shape) or q.dim() != 4:
        raise ValueError(f"ulysses_attention needs q, k, v of one shape (B, nh, S/P, hd); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    _check_heads(q.shape[1], P)
    S = q.shape[-2] * P
    check_seq_len(S, P, layout)
    qkv = seq_to_head(torch.stack([q, k, v]), group, "ulysses qkv seq->head")  # (3, B, nh/P, S, hd)
    if layout != "contiguous":                     # rows arrive in rank order; sort them into sequence order
        order = torch.cat([shard_positions(S, P, r, layout) for r in range(P)]).to(q.device)  # (S,)
        qkv = qkv.index_select(-2, torch.argsort(order))
    out = causal_attention(qkv[0], qkv[1], qkv[2], causal=causal)                # (B, nh/P, S, hd)
    if layout != "contiguous":
        out = out.index_select(-2, order)         # back to rank order
    return head_to_seq(out, group, "ulysses out head->seq")                     # (B, nh, S/P, hd)


# ---------------------------------------------------------------------- the context-parallel GPT
class _CPAttention:
    """The core_attention hook installed on every layer: ring or Ulysses over the CP group."""

    def __init__(self, group, attention: str, layout: str, causal: bool, stats: RingStats | None):
        self.group, self.attention, self.layout, self.causal, self.stats = group, attention, layout, causal, stats

    def __call__(self, q, k, v):                  # (B, nh, S/P, hd) x3 -> (B, nh, S/P, hd)
        if self.attention == "ring":
            return ring_attention(q, k, v, self.group, self.causal, self.layout, self.stats)
        return ulysses_attention(q, k, v, self.group, self.causal, self.layout)


class ContextParallelGPT(nn.Module):
    """The tiny GPT with its sequence split over a CP group. Wraps (and modifies) `model`:

        cp = ContextParallelGPT(clone_model(model), group, attention="ring", layout="zigzag")
        logits, loss = cp(cp.shard(x), cp.shard(y))    # (B, S/P, V), this rank's share of the loss
        loss.backward(); cp.average_gradients()          # now equal to the full model's gradients
        cp.global_loss(loss)                             # the full model's loss, on every rank

    attention  'ring' (any n_head) or 'ulysses' (n_head % P == 0)
    layout     'zigzag' (balanced causal work) or 'contiguous'
    stats      optional RingStats filled by every ring layer (forward and backward work per step)
    """

    def __init__(self, model: GPT, group=None, attention: str = "ring", layout: str = "zigzag",
                 stats: RingStats | None = None):
        super().__init__()
        if attention not in ("ring", "ulysses"):
            raise ValueError(f"attention must be 'ring' or 'ulysses', got {attention!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.P, self.cp_rank = comm.get_world_size(group), comm.get_rank(group)
        if attention == "ulysses":
            _check_heads(model.config.n_head, self.P)
        if model.config.dropout:
            raise ValueError("ContextParallelGPT needs dropout=0: each rank would draw its own masks, so the "
                             "result would not match the one-process model")
        self.model, self.group, self.attention, self.layout = model, group, attention, layout
        hook = _CPAttention(group, attention, layout, causal=True, stats=stats)
        for block in model.blocks:
            block.attn.core_attention = hook      # the hook models.CausalSelfAttention offers

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a (B, S) batch -> (B, S/P)."""
        return shard_sequence(x, self.P, self.cp_rank, self.layout, dim=1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, S/P): this rank's shard -> (logits (B, S/P, V), this rank's share of the loss or None):
        P * (sum over its non-ignored targets) / (their count over the CP group)."""
        m = self.model
        S = idx.shape[1] * self.P
        if S > m.config.seq_len:
            raise ValueError(f"sequence of length {S} (= {idx.shape[1]} per rank x P {self.P}) is longer than "
                             f"GPTConfig.seq_len={m.config.seq_len}")
        pos = shard_positions(S, self.P, self.cp_rank, self.layout).to(idx.device)  # (S/P,) global positions
        x = m.embed(idx, pos)                     # (B, S/P, H) with this shard's global positions
        for block in m.blocks:
            x = block(x)                          # (B, S/P, H); attention talks to the CP group
        logits = m.head(x)                        # (B, S/P, V)
        loss = None if targets is None else self._loss_share(logits, targets)
        return logits, loss

    def _loss_share(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """P * (sum of this rank's losses) / N, N = non-ignored targets over the CP group: the shares average
        to the full sequence's mean loss."""
        n = count_targets(targets)                                # () int64, this rank's
        total = n.clone()
        if self.P > 1:
            comm.all_reduce(total, group=self.group, label="cp loss tokens")
        n, total = int(n), int(total)
        return weighted_mean_loss(self.model.loss, logits, targets, n, n * self.P / total if n else 0.0)  # ()

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Average every parameter's gradient over the CP group (one all-reduce of one flat bucket)."""
        comm.average_grads(self.model.parameters(), self.group, "cp grad average")

    @torch.no_grad()
    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over the CP group of the ranks' shares: the full sequence's mean loss."""
        t = loss.detach().clone()
        comm.all_reduce(t, op=comm.ReduceOp.AVG, group=self.group, label="cp loss average")
        return t
