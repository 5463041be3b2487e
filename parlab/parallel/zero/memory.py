"""Memory of the model states per GPU: the ZeRO formulas, and the same bytes measured from tensors.

Model states are the parameters, their gradients and the optimizer state; activations and
temporary buffers come on top (section 3 of [1]). For psi parameters, Nd data-parallel ranks
and mixed-precision Adam (16-bit weights and gradients, K = 12 bytes of optimizer state per
parameter: fp32 master weights 4 + Adam m 4 + v 4):

    stage        params       grads         optimizer     per GPU                         psi = 7.5B, Nd = 64
    DP (0)       2 psi        2 psi         K psi         (2 + 2 + K) psi      = 16 psi    120 GB
    ZeRO-1       2 psi        2 psi         K psi / Nd    4 psi + K psi / Nd              31.4 GB
    ZeRO-2       2 psi        2 psi / Nd    K psi / Nd    2 psi + (2 + K) psi / Nd        16.6 GB
    ZeRO-3       2 psi / Nd   2 psi / Nd    K psi / Nd    (2 + 2 + K) psi / Nd            1.9 GB

Communication per step, in elements moved per rank (ring algorithms, Nd large):
DP, ZeRO-1, ZeRO-2 ~ 2 psi (reduce-scatter + all-gather, or one all-reduce);
ZeRO-3 ~ 3 psi (all-gather in forward, again in backward, reduce-scatter of gradients).

The byte widths are arguments, so the same formulas describe the runs of this course: an fp32
model trained with AdamW has ``param_bytes=4, grad_bytes=4, k=8`` (m and v; the parameters are
the master weights). parlab's FSDP with ``compute_dtype`` keeps fp32 master shards as its
parameters and fp32 gradient shards, and gathers 16-bit copies only for the duration of a
unit's compute: ``param_bytes=4, grad_bytes=4, k=8`` per shard, 16 psi / Nd in total, the same
total as the paper's (2 + 2 + 12) psi / Nd with the bytes filed differently.

`min_dp_size` inverts the formulas: the smallest Nd at which a stage's model states fit one GPU
(GPT-3 175B on 80 GB: ZeRO-3 from Nd = 35; ZeRO-1/2 never, they keep 4 psi / 2 psi whole on every GPU).

`measure` counts the bytes a rank really holds, from the tensors themselves (it imports torch,
never torch.distributed); lessons put its bars next to `model_state_bytes`.

References
    [1] S. Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
        Models", arXiv:1910.02054, sections 3 (where memory goes), 5 (ZeRO-DP), 7 (communication).
    [2] V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
        arXiv:2205.05198 (transformer parameter count).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from parlab.trace.wire import ring_factor

__all__ = ["model_state_bytes", "comm_elements", "max_params", "measure",
           "gathered_timeline", "min_dp_size", "STAGES"]

STAGES = {0: "DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def _check(stage: int, nd: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be 0 (plain DP), 1, 2 or 3, got {stage!r}")
    if not isinstance(nd, int) or nd < 1:
        raise ValueError(f"the data-parallel size nd must be a positive integer, got {nd!r}")


def model_state_bytes(psi: float, nd: int, stage: int, param_bytes: float = 2, grad_bytes: float = 2,
                      k: float = 12) -> dict[str, float]:
    """Bytes of model states per GPU: {'params', 'grads', 'optimizer', 'total'} (section 5.1 of [1])."""
    _check(stage, nd)
    params = param_bytes * psi / (nd if stage >= 3 else 1)
    grads = grad_bytes * psi / (nd if stage >= 2 else 1)
    optimizer = k * psi / (nd if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def comm_elements(psi: float, stage: int, nd: int | None = None) -> float:
    """Elements each rank sends per step: 2 psi for DP/ZeRO-1/ZeRO-2, 3 psi for ZeRO-3 (section 7 of [1]).

    With `nd`, the exact ring factor (nd - 1) / nd of each reduce-scatter / all-gather is applied."""
    _check(stage, nd or 1)
    ring = ring_factor("all_gather", nd) if nd else 1.0     # all-gather and reduce-scatter: (nd - 1) / nd
    return (3 if stage == 3 else 2) * psi * ring


def max_params(gpu_bytes: float, nd: int, stage: int, param_bytes: float = 2, grad_bytes: float = 2,
               k: float = 12) -> float:
    """The largest psi whose model states fit in `gpu_bytes` (activations not counted): 80e9 / 16 = 5.0e9 for DP."""
    per_param = model_state_bytes(1.0, nd, stage, param_bytes, grad_bytes, k)["total"]
    return gpu_bytes / per_param


def min_dp_size(psi: float, gpu_bytes: float, stage: int, param_bytes: float = 2, grad_bytes: float = 2,
                k: float = 12) -> int | None:
    """The smallest DP size Nd at which the model states of stage `stage` fit in `gpu_bytes` per GPU, or None
    if no Nd is enough (the unsharded part alone is too big: e.g. ZeRO-1 still keeps 4 psi bytes per GPU).

    Per GPU the states are a + b / Nd (a: the replicated part, b: the sharded part), so Nd >= b / (gpu - a).
    >>> min_dp_size(175e9, 80e9, 3)    # GPT-3: 2800 GB of states / 80 GB
    35
    """
    whole = model_state_bytes(psi, 1, stage, param_bytes, grad_bytes, k)["total"]
    a = model_state_bytes(psi, 1, 0, param_bytes, grad_bytes, k)
    a = sum(a[part] for part, sharded_from in (("params", 3), ("grads", 2), ("optimizer", 1)) if stage < sharded_from)
    if a >= gpu_bytes and whole > gpu_bytes:
        return None
    if whole <= gpu_bytes:
        return 1
    nd = max(1, math.ceil((whole - a) / (gpu_bytes - a) - 1e-9))
    while model_state_bytes(psi, nd, stage, param_bytes, grad_bytes, k)["total"] > gpu_bytes:   # rounding guard
        nd += 1
    return nd


# ---------------------------------------------------------------------- measured
def _state_tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _state_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _state_tensors(v)


def measure(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None,
            extra: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes this process holds in parameters, gradients and optimizer state, counted from the tensors.

    params     the parameters the rank keeps (``model.parameters()``; for FSDP its flat shards)
    optimizer  its ``state`` is walked for tensors (a ShardedOptimizer exposes only its shard's state)
    extra      other tensors to count as parameters (e.g. unsharded buffers alive at that moment)
    Tensors are counted once each, however often they appear (tied weights)."""
    seen: set[int] = set()

    def once(ts: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in ts:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.nbytes                     # numel x element size
        return total

    params = list(params)
    out = {"params": once(params) + once(extra), "grads": once(p.grad for p in params)}
    out["optimizer"] = once(_state_tensors(list(optimizer.state.values()))) if optimizer is not None else 0
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def gathered_timeline(trace, rank: int = 0) -> list[dict]:
    """Bytes of gathered (unsharded) weights over time on one rank, from the ``unsharded_bytes`` marks
    FullyShardedDataParallel leaves in a trace: [{'t': seconds from the trace start, 'bytes', 'label'}],
    label e.g. 'gathered blocks.0', 'freed blocks.0', 'regathered blocks.1', 'freed blocks.1 after backward'."""
    t0 = trace.t0
    return [{"t": e.start - t0, "bytes": e.nbytes, "label": e.label}
            for e in trace.filter(rank=rank, op="unsharded_bytes").events]
