"""Mixture of experts: the MLP a token shares with a few of many experts, on one process.

A mixture-of-experts (MoE) layer replaces the dense MLP by E expert MLPs and a router. The router scores each
token against every expert, sends it to its top k, and the layer's output is the experts' outputs weighted by
the router's probabilities [1, 2]. Parameters grow E times, the FLOPs per token only k times: that is why the
largest models of the field are MoE. This is the one-process reference that expert parallelism
(`parlab.parallel.expert`) shards and is checked against.

    x (T, H) --router--> probs (T, E) --top-k--> expert ids (T, k), weights (T, k)
             --sort by expert--> (N, H) --expert e on its block--> (N, H) --unsort, weight, sum over k--> y (T, H)

The router, as Switch Transformer [2] and GShard [1] define it, and Megatron-Core implements it
(``megatron/core/transformer/moe/router.py``, ``moe_utils.py``):

* softmax over the E logits, then the top k probabilities and their experts (``norm_topk``: renormalise the k
  weights to sum to 1, as Mixtral does; Switch with k = 1 keeps the raw probability);
* the load-balancing loss ``alpha * E * sum_i f_i * P_i`` [2, eq. 4]: f_i the fraction of the T k routed
  assignments sent to expert i (counted, no gradient), P_i the mean router probability of expert i (the
  gradient flows through it). Under uniform routing f_i = P_i = 1/E and the loss is exactly alpha; it grows
  as routing concentrates on a few experts;
* the router z-loss ``beta * mean_t logsumexp(logits_t)^2`` (ST-MoE [3], section 3.1): keeps the logits small;
* a capacity factor cf: each expert takes at most ``capacity = ceil(T k cf / E)`` assignments [1, 2]; beyond
  it the assignments with the lowest probability are dropped (the token's output from that expert is zero, the
  residual connection carries it on). cf None: no dropping.

Routing groups. Capacity and the load-balancing statistics are taken over a *group* of tokens: under expert
parallelism each rank routes its own tokens (GShard's groups), so a one-process model standing in for W ranks
routes W equal, contiguous groups (``MoE.groups = W``): the rank r's tokens are rows r b .. (r + 1) b - 1 of the
global batch. Ranks that split the sequence too (context parallelism, tensor parallelism's sequence shards) route
some positions of some rows: ``MoE.positions``, the positions of each of P sequence shards in a rank's order, makes
the groups (row block) x (sequence shard), ``groups / P`` row blocks, each group's tokens in the rank's order
(its rows, then its positions). The layer's auxiliary loss is the mean of its groups' (each rank's loss,
averaged by data parallelism).

The auxiliary losses do not change the value of the training loss: as Megatron-Core's ``MoEAuxLossAutoScaler``,
`_AuxLossScaler` attaches their gradient to the layer's output, so any loss computed from it (one process,
tensor, pipeline or context parallel) back-propagates them too. The value is kept on the layer (``aux_loss``)
for reporting. Forward: identity on the output; backward: the output's gradient, and d(aux)/d(aux) = scale.

References
    [1] D. Lepikhin et al., "GShard: Scaling Giant Models with Conditional Computation and Automatic
        Sharding", ICLR 2021, arXiv:2006.16668, section 2.2 (top-2 gating, capacity, groups, aux loss).
    [2] W. Fedus, B. Zoph, N. Shazeer, "Switch Transformers", JMLR 2022, arXiv:2101.03961, section 2.2
        (eq. 4, the load-balancing loss; capacity factor).
    [3] B. Zoph et al., "ST-MoE: Designing Stable and Transferable Sparse Expert Models", arXiv:2202.08906,
        section 3.1 (router z-loss).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Routing", "capacity", "route", "load_balancing_loss", "z_loss", "sort_by_expert", "unsort",
           "ExpertMLPs", "MoE", "moe_layers", "aux_losses"]


# ---------------------------------------------------------------------- the router's arithmetic (pure)
def capacity(tokens: int, experts: int, k: int, capacity_factor: float) -> int:
    """Assignments one expert takes from `tokens` tokens routed to k of `experts`: ceil(T k cf / E) [1, 2]."""
    return math.ceil(tokens * k * capacity_factor / experts)


@dataclass
class Routing:
    """Where each of T tokens goes. expert (T, k) long, weight (T, k) float (differentiable), keep (T, k) bool
    (False: dropped over capacity), aux_loss and z_loss () (differentiable, coefficients applied), counts (E,)
    long: kept assignments per expert."""
    expert: torch.Tensor
    weight: torch.Tensor
    keep: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    counts: torch.Tensor


def load_balancing_loss(probs: torch.Tensor, expert: torch.Tensor, experts: int) -> torch.Tensor:
    """E * sum_i f_i P_i of one group [2, eq. 4]: probs (T, E), expert (T, k). 1 under uniform routing."""
    T, k = expert.shape
    f = torch.bincount(expert.reshape(-1), minlength=experts).to(probs.dtype) / (T * k)   # (E,) no gradient
    P = probs.mean(0)                                                                    # (E,)
    return experts * (f * P).sum()                                                      # ()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp(logits_t)^2 (ST-MoE [3] eq. 5): logits (T, E) -> ()."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def _keep_within_capacity(expert: torch.Tensor, weight: torch.Tensor, experts: int, cap: int) -> torch.Tensor:
    """(T, k) bool: each expert keeps its `cap` assignments of highest weight (ties: the earlier token, then the
    lower slot); the rest are dropped."""
    flat_e, flat_w = expert.reshape(-1), weight.detach().reshape(-1)                 # (T k,)
    order = torch.sort(-flat_w, stable=True).indices                                 # best first
    onehot = F.one_hot(flat_e[order], experts)                                       # (T k, E)
    seat = (onehot.cumsum(0) * onehot).sum(-1) - 1                                   # place in its expert's queue
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = seat < cap
    return keep.view_as(expert)


def route(logits: torch.Tensor, k: int, *, capacity_factor: float | None = None, norm_topk: bool = False,
          aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, groups: int = 1) -> Routing:
    """Top-k routing of T tokens from the router's logits (T, E), in `groups` equal contiguous groups (capacity
    and the load-balancing loss per group, the loss their mean). Softmax in float32 whatever the logits' dtype."""
    T, E = logits.shape
    if not 1 <= k <= E:
        raise ValueError(f"top-k routing needs 1 <= k <= experts: k={k}, {E} experts")
    if groups < 1 or T % groups:
        raise ValueError(f"{T} tokens do not split into {groups} equal routing groups (one per rank that routes "
                         f"its own tokens): give every rank the same number of tokens")
    probs = logits.float().softmax(-1)                                               # (T, E)
    weight, expert = probs.topk(k, dim=-1)                                           # (T, k), (T, k)
    if norm_topk:
        weight = weight / weight.sum(-1, keepdim=True)                               # (T, k), rows sum to 1
    g = T // groups
    keep = torch.ones_like(expert, dtype=torch.bool)
    aux = logits.new_zeros((), dtype=torch.float32)
    for s in range(0, T, g):                                                          # one group at a time
        if capacity_factor is not None:
            keep[s:s + g] = _keep_within_capacity(expert[s:s + g], weight[s:s + g], E,
                                                  capacity(g, E, k, capacity_factor))
        if aux_loss_coeff:
            aux = aux + load_balancing_loss(probs[s:s + g], expert[s:s + g], E)
    aux = aux_loss_coeff * aux / groups
    zl = z_loss_coeff * z_loss(logits.float()) if z_loss_coeff else logits.new_zeros((), dtype=torch.float32)
    counts = torch.bincount(expert[keep], minlength=E)                               # (E,)
    return Routing(expert, weight, keep, aux, zl, counts)


# ---------------------------------------------------------------------- permutation: tokens sorted by expert
def sort_by_expert(x: torch.Tensor, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept (token, slot) assignments' inputs sorted by expert, stably (tokens in order within an expert):
    x (T, H) -> (N, H), and `slots` (N,): the flat index t k + j each row came from."""
    k = r.expert.shape[1]
    kept = r.keep.reshape(-1).nonzero().squeeze(1)                                   # (N,) flat slots t k + j
    slots = kept[torch.sort(r.expert.reshape(-1)[kept], stable=True).indices]        # (N,) by expert, then token
    return x[slots // k], slots                                                      # (N, H), (N,)


def unsort(y: torch.Tensor, slots: torch.Tensor, r: Routing) -> torch.Tensor:
    """The experts' outputs y (N, H), in `sort_by_expert`'s order, back to the tokens: (T, H) = sum over each
    token's k slots of weight x output (zero for a dropped slot). A fixed-order sum over k (no scatter-add of
    floats, whose order, and so whose rounding, would vary): deterministic."""
    T, k = r.expert.shape
    out = y.new_zeros(T * k, y.shape[-1]).index_copy(0, slots, y)                    # (T k, H), each slot once
    w = (r.weight * r.keep).to(y.dtype)                                              # (T, k), 0 where dropped
    return (out.view(T, k, -1) * w.unsqueeze(-1)).sum(1)                             # (T, H)


# ---------------------------------------------------------------------- the experts and the layer
class ExpertMLPs(nn.Module):
    """`experts` MLPs Linear(H, F) -> GELU -> Linear(F, H), their weights stacked on a leading expert dimension
    (``fc.weight`` (E, F, H), as Megatron-Core's grouped experts): expert parallelism takes a slice of it."""

    def __init__(self, experts: int, hidden: int, ffn: int, bias: bool = True) -> None:
        super().__init__()
        self.fc = _Stacked(experts, ffn, hidden, bias)
        self.proj = _Stacked(experts, hidden, ffn, bias)
        self.act = nn.GELU()

    @property
    def num_experts(self) -> int:
        return self.fc.weight.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (N, H), rows sorted by expert with counts[e] rows for local expert e -> (N, H)."""
        out = []
        for e, block in enumerate(torch.split(x, counts)):                            # (n_e, H) each
            h = self.act(self.fc(block, e))                                           # (n_e, F)
            out.append(self.proj(h, e))                                               # (n_e, H)
        return torch.cat(out) if out else x[:0]                                       # (N, H)


class _Stacked(nn.Module):
    """E Linear layers in one weight (E, out, in) and bias (E, out); ``forward(x, e)`` is expert e's."""

    def __init__(self, experts: int, out_features: int, in_features: int, bias: bool, device=None) -> None:
        super().__init__()
        # device None: the default device, as nn.Linear (the meta device while GPT builds on it)
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features, device=device))
        self.bias = nn.Parameter(torch.zeros(experts, out_features, device=device)) if bias else None

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return F.linear(x, self.weight[e], None if self.bias is None else self.bias[e])


class _AuxLossScaler(torch.autograd.Function):
    """forward: the output, unchanged; backward: the output's gradient, and `scale` for the auxiliary loss (its
    gradient reaches the router as if it had been added to the training loss)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class MoE(nn.Module):
    """The mixture-of-experts MLP: ``router`` (Linear(H, E), no bias) and ``experts`` (`ExpertMLPs`); a
    drop-in for the dense MLP on (B, S, H). `local_experts`: how many of the experts this module holds (all of
    them here; a share under expert parallelism, which replaces `experts_forward`). `groups`: routing groups (module docstring); `aux_grad_scale`:
    what the auxiliary losses' gradient is multiplied by (1/m when m micro-batches' gradients are summed).
    After each forward: ``aux_loss`` (detached, coefficients applied) and ``routing`` (the last `Routing`)."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int = 1, *, bias: bool = True,
                 capacity_factor: float | None = None, norm_topk: bool = False, aux_loss_coeff: float = 1e-2,
                 z_loss_coeff: float = 0.0, dropout: float = 0.0, local_experts: int | None = None) -> None:
        super().__init__()
        if not isinstance(experts, int) or experts < 2:
            raise ValueError(f"a mixture of experts needs at least 2 experts, got {experts!r}")
        if not isinstance(top_k, int) or not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be between 1 and the {experts} experts, got {top_k!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive (or None: no token dropped), got {capacity_factor!r}")
        self.router = nn.Linear(hidden, experts, bias=False)                          # (E, H)
        self.experts = ExpertMLPs(experts if local_experts is None else local_experts, hidden, ffn, bias)
        self.drop = nn.Dropout(dropout)
        self.num_experts, self.top_k, self.capacity_factor, self.norm_topk = experts, top_k, capacity_factor, norm_topk
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.groups, self.aux_grad_scale = 1, 1.0
        self.positions: list[torch.Tensor] | None = None                              # sequence shards (docstring)
        self.aux_loss: torch.Tensor | None = None
        self.routing: Routing | None = None

    def route(self, x: torch.Tensor) -> Routing:
        """x (T, H) -> this layer's `Routing` of its T tokens."""
        return route(self.router(x), self.top_k, capacity_factor=self.capacity_factor, norm_topk=self.norm_topk,
                     aux_loss_coeff=self.aux_loss_coeff, z_loss_coeff=self.z_loss_coeff, groups=self.groups)

    def experts_forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts on their sorted tokens; expert parallelism replaces this step by dispatch, the local
        experts and combine (`parlab.parallel.expert`)."""
        return self.experts(x_sorted, counts.tolist())                                # (N, H)

    def group_order(self, rows: int, seq: int) -> torch.Tensor | None:
        """(T,) the flat token indices (row S + position) of a (rows, seq) batch, grouped as `positions` says
        (module docstring): group after group, each in its rank's order; None: the groups are contiguous."""
        if self.positions is None:
            return None
        P = len(self.positions)
        if self.groups % P or rows % (self.groups // P) or sum(len(q) for q in self.positions) != seq:
            raise ValueError(f"{self.groups} routing groups of {P} sequence shards do not fit a batch of {rows} "
                             f"rows of {seq} positions: the shards must cover the sequence, the row blocks the rows")
        blocks = torch.arange(rows).view(self.groups // P, -1)                        # (G/P, rows P/G)
        return torch.cat([(b[:, None] * seq + q[None, :].cpu()).reshape(-1) for b in blocks for q in self.positions])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])                                             # (T, H), T = B S
        order = self.group_order(*shape[:2]) if x.dim() == 3 else None
        if order is not None:
            order = order.to(x.device)
            tokens = tokens[order]                                                    # (T, H) group by group
        r = self.route(tokens)
        x_sorted, slots = sort_by_expert(tokens, r)                                   # (N, H)
        y = self.experts_forward(x_sorted, r.counts)                                  # (N, H)
        out = unsort(y, slots, r)                                                     # (T, H)
        out = (out if order is None else out[torch.argsort(order)]).view(shape)       # (B, S, H)
        self.routing, self.aux_loss = r, (r.aux_loss + r.z_loss).detach()
        if out.requires_grad and (self.aux_loss_coeff or self.z_loss_coeff):
            out = _AuxLossScaler.apply(out, r.aux_loss + r.z_loss, self.aux_grad_scale)
        return self.drop(out)


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every `MoE` layer of `model`, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_losses(model: nn.Module) -> torch.Tensor:
    """The sum of the auxiliary losses of `model`'s MoE layers at their last forward (for reporting: their
    gradient was already attached)."""
    vals = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(vals).sum() if vals else torch.zeros((), device=next((p.device for p in model.parameters()), None))
