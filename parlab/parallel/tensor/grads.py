"""Tensor-parallel gradients: sequence parallelism's partial gradients summed over the TP group, and the
shards gathered back into the dense layout (for comparing with the one-process model).

With Megatron sequence parallelism [1, section 4.2.2] the layer norms, the row-parallel biases and the
position table run on this rank's S/tp tokens only, so their gradients are partial sums: the gradient of the
whole sequence is the sum over the TP group, one flat all-reduce per step (Megatron does it in
``finalize_model_grads`` after the last micro-batch). Gradient accumulation needs care: after a sync a
gradient holds the summed value, and summing it again after the next backward would count the earlier part
tp times (1.5x the right gradient at tp = 2 after two steps). So `mark_sequence_parallel` registers a tensor
hook that keeps, aside, what each backward adds to the parameter, and the sync sums only that:

    grad  <-  grad + all_reduce(new) - new          (naive: grad <- all_reduce(grad), right only once)

References
    [1] V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
        arXiv:2205.05198, 2022.
    [2] Megatron-LM, megatron/core/distributed/finalize_model_grads.py (_allreduce_layernorm_grads).
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn

from parlab import comm

__all__ = ["dense_state_dict", "dense_grads", "mark_sequence_parallel", "sync_sequence_parallel_grads"]


def _unshard(t: torch.Tensor, dim, group, label: str) -> torch.Tensor:
    return t.detach().clone() if dim is None else comm.all_gather_dim(t.detach(), dim, group, label=label)


def dense_state_dict(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """The dense model's state dict, gathered from the shards (the inverse of `parallelize`)."""
    out, done = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in done:  # a tied parameter appears under two names: gather it once
            done[id(t)] = _unshard(t, getattr(t, "tp_dim", None), group, f"gather {name}")
        out[name] = done[id(t)]
    return out


def dense_grads(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient in the dense layout, keyed like ``dense_model.named_parameters()``.
    With SP, call `sync_sequence_parallel_grads` first."""
    return {n: _unshard(p.grad, getattr(p, "tp_dim", None), group, f"gather grad {n}")
            for n, p in model.named_parameters() if p.grad is not None}


def mark_sequence_parallel(p: nn.Parameter) -> None:
    """Tag `p` as used on S/tp tokens (its gradient is partial) and, from now on, keep aside the gradient each
    backward adds to it, so that `sync_sequence_parallel_grads` sums only what was added since its last call."""
    p.sequence_parallel = True
    if getattr(p, "_sp_owner", None) != id(p):   # (a deep copy inherits the attributes, not the hook)
        p._sp_owner, p._sp_new = id(p), None
        p.register_hook(functools.partial(_keep_new_grad, weakref.ref(p)))


def _keep_new_grad(ref, grad: torch.Tensor) -> None:
    """Tensor hook: add this backward's gradient of the parameter to its not-yet-summed part."""
    p = ref()
    if p is not None:
        p._sp_new = grad.detach().clone() if p._sp_new is None else p._sp_new + grad.detach()


@torch.no_grad()
def sync_sequence_parallel_grads(model: nn.Module, group=None) -> int:
    """Sum, over the TP group, the gradients of parameters used on S/tp tokens (one flat all-reduce).
    Returns how many tensors were summed.

    Only the part added since the last call is summed (kept aside by `mark_sequence_parallel`'s hook), so
    backward + sync repeated k times without zeroing accumulates the k full gradients, as the dense model
    does, instead of summing the earlier, already summed part again. Call it after backward and before
    anything else changes the gradients (data-parallel averaging, clipping)."""
    params, new = [], []
    for p in model.parameters():
        if not getattr(p, "sequence_parallel", False):
            continue
        hooked = getattr(p, "_sp_owner", None) == id(p)
        added = p._sp_new if hooked else p.grad       # untracked (tagged by hand): the whole gradient
        if hooked:
            p._sp_new = None
        if p.grad is None:                            # zeroed to None since the backward: nothing to sum
            continue
        params.append((p, hooked))
        new.append(added if added is not None else torch.zeros_like(p.grad))
    if not params or comm.get_world_size(group) == 1:
        return 0
    flat = torch.cat([g.reshape(-1) for g in new])    # (sum of numels,)
    comm.all_reduce(flat, group=group, label="sp grads")
    for (p, hooked), g, part in zip(params, new, flat.split([g.numel() for g in new])):
        if hooked:
            p.grad.add_(part.view_as(g) - g)          # the earlier (summed) part + the sum of the new part
        else:
            p.grad.copy_(part.view_as(g))
    return len(params)
