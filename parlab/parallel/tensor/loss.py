"""Vocabulary-parallel cross-entropy: the loss from logits split along the vocabulary over a TP group.

The output layer of a tensor-parallel model is column-parallel over the vocabulary, so rank r holds the
logits of ids [r*V/tp, (r+1)*V/tp): (..., V/tp). Gathering the full (..., V) logits would move V/tp values per
token per rank; instead the loss needs three all-reduces of one number per token [1, section 3]:

    m        = max over the vocabulary              all-reduce MAX   (so exp never overflows)
    z_t      = logit of the target - m              all-reduce SUM   (only the owner of the target adds it)
    sum_exp  = sum over the vocabulary of exp(z)    all-reduce SUM
    loss     = log(sum_exp) - z_t                   (naive, overflowing: log(sum(exp(logits))) - logits[t])

backward needs no communication: d loss / d logits_r = softmax_r - one_hot_r, each rank on its slice.

It behaves as ``F.cross_entropy(logits, targets, ignore_index=..., reduction=...)`` on the full logits:
targets equal to ``ignore_index`` (-100 by default, the padding convention of `parlab.models.GPT.loss`)
contribute no loss and no gradient, "mean" divides by the number of the other targets (nan when there are
none, as torch), "sum" adds them, "none" returns the per-token loss (0 at ignored positions). Any other
target outside [0, V) is a ValueError naming it (torch would index out of bounds on the CPU and assert
on CUDA). Checking that costs one host synchronisation per call.

Precision. As Megatron does (it calls the loss on ``logits.float()``), the statistics, their all-reduces and
the reduction over tokens are in float32 at least (float64 stays float64), whatever the logits' dtype; the
softmax saved for backward is float32 too (for bf16 logits that is twice their memory). The result and the
gradient come back in the logits' dtype, as from F.cross_entropy.

The group's ranks must hold the same targets: the "mean" is over this rank's targets. When the tokens of
one batch are spread over other ranks as well (data or context parallel), reduce with "sum" and divide by
the global count of non-ignored tokens (`parlab.parallel.context.ulysses.ContextParallelGPT` and
`parlab.parallel.pipeline.executor.PipelineParallel` do).

References
    [1] M. Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
        Parallelism", arXiv:1909.08053, 2019, section 3 (the parallel output layer and loss).
    [2] Megatron-LM, megatron/core/tensor_parallel/cross_entropy.py (the same three all-reduces, in fp32).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parlab import comm

__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_mean_loss", "check_targets", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum", "none")


def check_targets(targets: torch.Tensor, vocab_size: int, ignore_index: int = -100) -> None:
    """ValueError naming the first target outside [0, vocab_size) that is not `ignore_index`."""
    if targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"targets must be integer class ids (torch.long), got dtype {targets.dtype}")
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        value = int(targets[tuple(where)])
        raise ValueError(f"target {value} at position {tuple(where)} is outside [0, {vocab_size}) (the vocabulary) "
                         f"and is not ignore_index={ignore_index}; use ids below vocab_size, and ignore_index "
                         f"for padding")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy (0 at ignored targets) from logits split along the vocabulary [1, section 3].
    forward: three all-reduces of one float32 number per token (max, target logit, sum of exponentials);
    backward: none (softmax - one_hot on the local slice, 0 at ignored targets)."""

    @staticmethod
    def forward(ctx, logits, targets, group, label, ignore_index=-100):
        vl = logits.shape[-1]                                          # V/tp
        start = comm.get_rank(group) * vl
        acc = torch.promote_types(logits.dtype, torch.float32)         # statistics in fp32 (fp64 stays fp64)
        x = logits.to(acc)                                             # (..., V/tp)
        # naive: loss = log(sum(exp(full_logits))) - full_logits[target]: overflows, and needs the full logits.
        # stable: subtract the global max m first, and only ever all-reduce one number per token.
        m = x.max(dim=-1).values                                       # (...,) local max
        comm.all_reduce(m, op=comm.ReduceOp.MAX, group=group, label=f"{label} max fwd")
        z = x - m.unsqueeze(-1)                                        # (..., V/tp) shifted, <= 0: exp is safe
        ignored = targets == ignore_index                              # (...,)
        outside = (targets < start) | (targets >= start + vl) | ignored  # (...,) target not on this rank
        local_t = (targets - start).masked_fill(outside, 0)            # (...,) index into this rank's slice
        target_z = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)  # (...,)
        comm.all_reduce(target_z, group=group, label=f"{label} target logit fwd")
        exp = z.exp()                                                  # (..., V/tp)
        sum_exp = exp.sum(dim=-1)                                      # (...,)
        comm.all_reduce(sum_exp, group=group, label=f"{label} sum exp fwd")
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, outside, ignored)  # softmax slice, fp32
        ctx.dtype = logits.dtype
        return (sum_exp.log() - target_z).masked_fill(ignored, 0.0)    # (...,) per-token loss, fp32

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, outside, ignored = ctx.saved_tensors
        g = softmax.clone()                                            # d loss / d logits = softmax - one_hot
        g.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        g.mul_(grad.masked_fill(ignored, 0.0).to(g.dtype).unsqueeze(-1))  # ignored targets: no gradient
        return g.to(ctx.dtype), None, None, None, None                 # (..., V/tp)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None,
                                 label: str = "cross-entropy", *, ignore_index: int = -100,
                                 reduction: str = "none") -> torch.Tensor:
    """Cross-entropy of this rank's logits (..., V/tp) against the full targets (...), as
    ``F.cross_entropy(full_logits, targets, ignore_index=ignore_index, reduction=reduction)`` would give it.

    reduction  "none" (default, the per-token loss (...), 0 at ignored targets), "mean" (over the non-ignored
               targets) or "sum". Every rank of `group` returns the same value."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS} (as in F.cross_entropy), got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: expected "
                         f"logits (..., V/tp) for targets (...)")
    tp = comm.get_world_size(group)
    check_targets(targets, logits.shape[-1] * tp, ignore_index)
    if tp == 1:
        acc = torch.promote_types(logits.dtype, torch.float32)
        loss = F.cross_entropy(logits.flatten(0, -2).to(acc), targets.flatten(), ignore_index=ignore_index,
                               reduction="none").view(targets.shape)  # (...,) fp32
    else:
        loss = _VocabParallelCrossEntropy.apply(logits, targets, group, label, ignore_index)  # (...,) fp32
    if reduction == "sum":
        loss = loss.sum()                                              # ()
    elif reduction == "mean":
        loss = loss.sum() / (targets != ignore_index).sum()            # () nan when every target is ignored
    return loss.to(logits.dtype)


def vocab_parallel_mean_loss(logits, targets, group=None, ignore_index: int = -100):
    """GPT.loss for vocab-split logits: the mean over the non-ignored targets, like F.cross_entropy."""
    return vocab_parallel_cross_entropy(logits, targets, group, ignore_index=ignore_index, reduction="mean")  # ()
