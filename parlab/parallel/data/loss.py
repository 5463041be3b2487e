"""The exact global mean loss under data parallelism when targets are padded (ignore_index).

DDP, ZeRO and FSDP average the ranks' gradients. If every rank's loss is its own mean over its non-ignored
targets, the average of the D ranks' gradients is the mean of D means, which equals the global mean over all
the batch's non-ignored targets only when every rank holds equally many of them. With padding (-100 targets,
as `parlab.models.GPT.loss` and torch's ``F.cross_entropy`` ignore) unevenly spread over the ranks, a rank
with few real tokens would count as much as a rank with many. The exact loss is the sum over all ranks'
non-ignored targets divided by their global count N [1]:

    n_r   = non-ignored targets on rank r                     (count_targets)
    N     = sum_r n_r                                         one all-reduce of one int64 ("loss token count")
    L_r   = D * (sum of rank r's per-token losses) / N        this rank's share
    mean_r L_r = (sum over all ranks' tokens) / N             what the gradient average of DDP/ZeRO/FSDP sees

so ``loss = global_mean_loss(logits, targets, group)`` then ``loss.backward()`` under any of the three gives
the dense model's gradient on the whole batch, and the average of the returned values over the group (the
usual AVG all-reduce for logging) is the global mean loss. Without padding every n_r = N / D and L_r is the
local mean: nothing changes. `parlab.parallel.pipeline.executor.PipelineParallel` (``loss_group``) and
`parlab.parallel.context.ulysses.ContextParallelGPT` already divide by the global count; this helper is for the
losses users compute themselves around DDP, ZeRO (`parlab.parallel.zero.optimizer.ShardedOptimizer`) and FSDP.

The sum is taken in float32 at least (as `parlab.parallel.tensor.loss` does for the vocabulary-parallel loss); the result
is float32 (float64 stays float64).

References
    [1] Megatron-LM, megatron/training (loss_func: the sum of the masked losses and the token count are
        all-reduced over the data-parallel group, and the loss is their ratio).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlab import comm
from parlab.models import count_targets

__all__ = ["global_target_count", "global_mean_loss"]


def global_target_count(targets: torch.Tensor, group=None, ignore_index: int = -100) -> torch.Tensor:
    """N: the number of targets that are not `ignore_index` over every rank of `group`. () int64, one
    all-reduce ("loss token count")."""
    n = count_targets(targets, ignore_index).reshape(1)                    # (1,) int64, this rank's n_r
    if dist.is_initialized() and comm.get_world_size(group) > 1:
        comm.all_reduce(n, group=group, label="loss token count")
    return n[0]                                                            # ()


def global_mean_loss(logits: torch.Tensor, targets: torch.Tensor, group=None, ignore_index: int = -100) -> torch.Tensor:
    """This rank's share D * (its summed cross-entropy) / N of the mean over the non-ignored targets of all D
    ranks of `group` (see the module docstring). logits (..., V), targets (...). When no rank has a target:
    0 (times the logits, so backward gives zero gradients instead of nan)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: expected "
                         f"logits (..., V) for targets (...)")
    n = global_target_count(targets, group, ignore_index)                  # () int64, N
    acc = torch.promote_types(logits.dtype, torch.float32)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(acc), targets.reshape(-1),
                            ignore_index=ignore_index, reduction="sum")    # () this rank's sum
    if int(n) == 0:
        return logits.sum().to(acc) * 0.0                                  # ()
    d = comm.get_world_size(group) if dist.is_initialized() else 1
    return total * (d / n.to(acc))               # () D * sum_r / N
