"""Averaging gradients over the replicas that computed them: the one home of data parallelism's gradient sync for
the techniques that run it after their backward (the pipeline's data-parallel replicas, Ulysses' cp group, the dense
weights beside expert parallelism, the hybrid's dp x cp group).

    average_grads(params, group, label)     one flat all-reduce (ReduceOp.AVG) of every gradient, copied back

The step's loss is the mean over the replicas' batches, so a replicated weight's gradient is the mean of the
replicas' gradients: sum over the group, divided by its size (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020, section 2). One flat buffer means one collective per step instead
of one per tensor, the bucketing idea of the same paper taken to one bucket (DDP's bucketed, overlapped version is
`parlab.parallel.data.ddp`, a lesson of its own; ZeRO's reduce-scatter is `parlab.parallel.zero`).
"""
from __future__ import annotations

import torch

from parlab.comm.traced import ReduceOp, all_reduce, get_world_size

__all__ = ["average_grads"]


@torch.no_grad()
def average_grads(params, group=None, label: str = "grad average", missing_as_zero: bool = False) -> None:
    """Average the gradients of `params` over `group` (default: the world) in one flat all-reduce. A parameter
    without a gradient is left out, or with `missing_as_zero` given a zero gradient first (every rank must send
    the same tensors: a rank whose tokens never reached a weight still joins its average)."""
    params = list(params)
    if missing_as_zero:
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])                  # (numel of this rank's gradients,)
    all_reduce(flat, op=ReduceOp.AVG, group=group, label=label)
    for g, avg in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(avg.view_as(g))
