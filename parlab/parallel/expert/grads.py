"""Gradients under expert parallelism: averaged with the same net 1/dp as the dense weights, counted once in the
gradient norm.

Every rank of a data-parallel world of W ranks computes the loss of its own tokens; the step's loss is their mean,
so a dense weight's gradient is the average over the W replicas (1/W of their sum). An expert's weights live on
one EP rank of each expert-data-parallel (EDP) group of W/ep ranks; the gradient on that rank already *sums* the
contributions of the tokens of all ep ranks of its EP group (combine's backward brought them home). So:

    dense weight   all-reduce over the W ranks, / W                    = (1/W) sum over all W ranks
    expert weight  all-reduce over its W/ep EDP replicas, / (W/ep), / ep = (1/W) sum over all W ranks

Forgetting the extra 1/ep (averaging expert gradients over the EDP group alone, as over a DP group) makes them
ep times too large: the bug of DeepSpeed PR 5259, megablocks issue 86 and pytorch issue 160285.

Under tensor parallelism with sequence parallelism (Megatron-Core's MoE with TP), the tp ranks of one data
replica hold different tokens (S/tp each) of the *same* loss: the W ranks of a pipeline stage are tp x D with D
the data-parallel (dp x cp) replicas, and the gradients of all their tokens sum to D times the step's gradient,
not W times. With experts whole on each rank (etp = 1) an expert lives on one rank of each EP group and has
edp = W / ep replicas, so the net 1/D is

    expert weight  all-reduce over its edp replicas, / edp, / (ep etp / tp)      = (1/D) sum over all W ranks

(etp = tp, the experts TP-sharded, gives back / ep). Dividing by ep as without TP makes them tp times too small;
summing them over tp as the other weights used on S/tp tokens (`sync_sequence_parallel_grads`) mixes the
different experts of the tp ranks (with MoE folding the EP group may be the TP group).

The global gradient norm counts every parameter once: the dense gradients are equal on every rank (after the
average), the experts' differ, so the squared norms of the experts are summed over the EP group and added to the
dense ones (Megatron-Core PR 5916 fixed a norm that left the experts out).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from parlab import comm

__all__ = ["is_expert_param", "average_gradients", "average_expert_gradients", "grad_norm", "clip_grad_norm"]


def is_expert_param(name: str) -> bool:
    """A parameter of an expert (``...mlp.experts.fc.weight``), sharded by expert parallelism; the router is not."""
    return ".experts." in f".{name}"


def average_gradients(model: nn.Module, group=None, ep_group=None, edp_group=None,
                      label: str = "ep grads") -> None:
    """Average the gradients of a model run data parallel over `group` (default: the world) with its experts
    spread over `ep_group` (default: the same ranks) and replicated over `edp_group` (None: no replicas):
    dense over `group`, experts over `edp_group` and / ep (module docstring). A missing gradient counts as zero
    (a rank can receive no tokens for an expert)."""
    dense = [p for name, p in model.named_parameters() if p.requires_grad and not is_expert_param(name)]
    comm.average_grads(dense, group, f"{label} dense", missing_as_zero=True)   # one flat all-reduce
    average_expert_gradients(model, ep_group, edp_group, label)


def average_expert_gradients(model: nn.Module, ep_group=None, edp_group=None, label: str = "ep grads",
                             divide_by: float | None = None) -> None:
    """The experts' part of `average_gradients`: each expert gradient averaged over `edp_group` (None: no
    replicas) and divided by `divide_by` (default: the size of `ep_group`; ep etp / tp under sequence
    parallelism, module docstring); a missing gradient counts as zero."""
    ep = comm.get_world_size(ep_group) if divide_by is None else divide_by
    experts = [p for name, p in model.named_parameters() if p.requires_grad and is_expert_param(name)]
    for p in experts:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if edp_group is not None:
        comm.average_grads(experts, edp_group, f"{label} experts")       # one flat all-reduce over the replicas
    for p in experts:
        p.grad.div_(ep)


def grad_norm(model: nn.Module, ep_group=None) -> torch.Tensor:
    """The 2-norm of all gradients of the model, every parameter once: dense (the same on every rank) plus the
    experts of every EP rank (summed over `ep_group`). () float64."""
    dense = torch.zeros((), dtype=torch.float64, device="cpu")       # host sums of the squares (.cpu() below)
    experts = torch.zeros((), dtype=torch.float64, device="cpu")
    for name, p in model.named_parameters():
        if p.grad is not None:
            sq = p.grad.detach().double().square().sum().cpu()
            if is_expert_param(name):
                experts += sq
            else:
                dense += sq
    experts = experts.to(next(model.parameters()).device)
    if comm.get_world_size(ep_group) > 1:
        comm.all_reduce(experts, group=ep_group, label="ep grad norm")
    return (dense + experts.cpu()).sqrt()


def clip_grad_norm(model: nn.Module, max_norm: float, ep_group=None) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / norm) with the norm of `grad_norm`; returns the norm."""
    norm = grad_norm(model, ep_group)
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    return norm
