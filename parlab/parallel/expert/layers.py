"""Expert-parallel layers: a mixture-of-experts MLP whose experts are spread over an expert-parallel group.

`ExpertParallelMoE` is `parlab.models.moe.MoE` holding E/ep of the E experts (a slice of the stacked weights,
``experts.fc.weight`` (E/ep, F, H)); the router stays whole on every rank (E x H: small). Its forward is the
one-process layer's, with the experts' step replaced by dispatch, the local experts and combine
(`parlab.parallel.expert.comm`):

    x (B, S, H) -> tokens (T, H) --route--> sorted by expert (N, H)
        --dispatch (all-to-all)--> this rank's experts' rows (M, H) --local experts--> (M, H)
        --combine (all-to-all)--> (N, H) --unsort, weight, sum over k--> (B, S, H)

`expert_parallel(model, group)` swaps every MoE layer of a model in place; the dense layers are untouched (run
them data parallel: `parlab.parallel.expert.grads.average_gradients`). Each rank routes its own tokens: capacity
and the load-balancing loss are per rank, as on the one-process model that routes the same tokens in one group
per rank (``MoE.groups``; `routed_as_ranks`).

References
    [1] D. Lepikhin et al., "GShard", arXiv:2006.16668, section 3.2.
    [2] Megatron-Core, ``megatron/core/transformer/moe/moe_layer.py`` (router, dispatcher, experts).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parlab import comm
from parlab.i18n import _
from parlab.models.moe import MoE, moe_layers
from parlab.parallel.expert.comm import combine, dispatch, gather_over_etp, reduce_scatter_over_etp

__all__ = ["ExpertParallelMoE", "expert_parallel", "routed_as_ranks", "local_experts"]


def local_experts(experts: int, group=None) -> range:
    """The global ids of the experts this rank holds: a contiguous E/ep of them (expert e on rank e // (E/ep))."""
    ep, r = comm.get_world_size(group), comm.get_rank(group)
    if experts % ep:
        raise ValueError(_("{experts} experts do not split over an expert-parallel group of {ep} ranks: choose ep "
                           "dividing the number of experts (e.g. ep={fits})").format(
            experts=experts, ep=ep, fits=next(d for d in range(ep, 0, -1) if experts % d == 0)))
    n = experts // ep
    return range(r * n, (r + 1) * n)


class ExpertParallelMoE(MoE):
    """`MoE` with E/ep experts on this rank of `group` (default: the world); built from the one-process layer,
    whose router and share of experts it copies. `etp_group` (expert tensor parallelism, Megatron-Core's ETP):
    each expert's MLP split over its ranks, fc by output columns ``(E/ep, F/etp, H)``, proj by input columns
    ``(E/ep, H, F/etp)``; the dispatched rows are gathered over etp before the experts and their partial outputs
    reduce-scattered after (`gather_over_etp`); ``tp_dim`` tags the split dims (`dense_state_dict`)."""

    def __init__(self, moe: MoE, group=None, etp_group=None) -> None:
        mine = local_experts(moe.num_experts, group)
        etp, t = (1, 0) if etp_group is None else (comm.get_world_size(etp_group), comm.get_rank(etp_group))
        hidden, ffn = moe.router.in_features, moe.experts.fc.weight.shape[1]
        if ffn % etp:
            raise ValueError(_("expert tensor parallelism over {etp} ranks needs the experts' hidden size {ffn} "
                               "divisible by etp").format(etp=etp, ffn=ffn))
        super().__init__(hidden, ffn // etp, moe.num_experts, moe.top_k, bias=moe.experts.fc.bias is not None,
                         capacity_factor=moe.capacity_factor, norm_topk=moe.norm_topk,
                         aux_loss_coeff=moe.aux_loss_coeff, z_loss_coeff=moe.z_loss_coeff, dropout=moe.drop.p,
                         local_experts=len(mine))
        self.group, self.etp_group, self.etp = group, etp_group, etp
        self.expert_ids = mine
        split = {"fc.weight": 1, "fc.bias": 1, "proj.weight": 2} if etp > 1 else {}   # (E/ep, ...) dims
        self.aux_grad_scale = moe.aux_grad_scale                                      # (groups: 1, its own tokens)
        ref = moe.router.weight
        self.to(device=ref.device, dtype=ref.dtype)
        if ref.is_meta:         # built on the meta device: materialize() draws this rank's experts later
            ep, r = comm.get_world_size(group), comm.get_rank(group)
            for name, p in self.experts.named_parameters():                           # experts r E/ep .. of E,
                p.dense_chunk = [(0, ep, r)] + ([(split[name], etp, t)] if name in split else [])   # then etp's part
                p.tp_dim = split.get(name)
            return
        with torch.no_grad():
            self.router.weight.copy_(moe.router.weight)                               # (E, H), replicated
            for name, p in self.experts.named_parameters():                           # (E/ep, ...) of (E, ...)
                full = moe.experts.get_parameter(name)[mine.start:mine.stop]
                p.copy_(full.chunk(etp, split[name])[t] if name in split else full)
                p.tp_dim = split.get(name)

    def experts_forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dispatch this rank's sorted rows (N, H) to the experts' ranks, run the local experts on what arrives,
        and combine: (N, H), in the order they left."""
        rows, plan = dispatch(x_sorted, counts, self.group)                           # (M, H) by local expert
        if self.etp > 1:
            every, gathered = gather_over_etp(rows, plan.local_counts, self.etp_group)   # (M_all, H)
            y = reduce_scatter_over_etp(self._partial_experts(every, gathered.local_counts), gathered,
                                        self.etp_group)                               # (M, H)
        else:
            y = self.experts(rows, plan.local_counts)                                 # (M, H)
        return combine(y, plan, self.group)                                           # (N, H)


    def _partial_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This etp rank's share of every local expert on rows (M_all, H) sorted by expert: partial sums (M_all, H)
        over its F/etp hidden units, the proj bias added as bias / etp (`_BiasShare`) so the etp sum adds it once."""
        ex, out = self.experts, []
        for e, block in enumerate(torch.split(x, counts)):                            # (n_e, H) each
            y = F.linear(ex.act(ex.fc(block, e)), ex.proj.weight[e])                  # (n_e, F/etp) -> (n_e, H)
            out.append(y if ex.proj.bias is None else y + _BiasShare.apply(ex.proj.bias[e], self.etp))
        return torch.cat(out) if out else x[:0]                                       # (M_all, H)


class _BiasShare(torch.autograd.Function):
    """forward: bias / etp (each etp rank's share of a bias added once after the sum over etp); backward: the
    gradient unscaled (every etp rank gets the output gradient of all the rows: the whole bias gradient)."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor, etp: int) -> torch.Tensor:
        return bias / etp

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def expert_parallel(model: nn.Module, group=None, etp_group=None) -> nn.Module:
    """Every `MoE` layer of `model` replaced, in place, by an `ExpertParallelMoE` over `group` (default: the
    world); returns `model`. The parameter names stay (``blocks.0.mlp.experts.fc.weight``), their first
    dimension is this rank's E/ep experts."""
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE) and not isinstance(module, ExpertParallelMoE):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    ExpertParallelMoE(module, group, etp_group))
    return model


def routed_as_ranks(model: nn.Module, ranks: int, positions: list[torch.Tensor] | None = None) -> nn.Module:
    """The one-process `model` routing its tokens in `ranks` equal groups, as `ranks` ranks each route their own
    share of the batch (capacity and load-balancing loss per group); returns `model`. `positions`: ranks that
    also split the sequence (context parallelism, sequence parallelism's shards) route some positions of their
    rows: the positions of each sequence shard, in the ranks' order (``MoE.positions``); None: whole rows."""
    for m in moe_layers(model):
        m.groups, m.positions = ranks, positions
    return model
