"""Data parallelism through a main rank: PyTorch's DataParallel pattern, written with ranks.

Data parallelism keeps a full copy of the model on every rank and splits the
batch. With a mean loss over B = N * b samples, the gradient is the mean of the
per-shard gradients, so N ranks that each see b samples and then average their
gradients take exactly the step one process would take on all B samples.
What differs between designs is who holds what and what travels where: here, everything goes through one rank;
`parlab.parallel.data.ddp` is the design that replaced it.

`NaiveDataParallel` is torch's single-process ``nn.DataParallel`` (seed 001)
written with ranks; group rank 0 plays the "main GPU". One update:

    rank 0                                 every rank
    1. scatter inputs         ------>      its shard x_r (b, S)
    2. replicate model        ------>      parameters and buffers
                                           3. forward: out_r = model(x_r)
    4. gather outputs         <------      out_r (b, S, V)
    5. loss(cat(out), y), d loss / d out
    6. scatter output grads   ------>      g_r = d loss / d out_r
                                           7. backward: out_r.backward(g_r)
    8. reduce grads           <------      parameter gradients (summed on rank 0)
    9. optimizer step (rank 0 only; the others get the new weights at step 2 of the next update)

All traffic runs through rank 0, and rank 0 alone holds the full batch, the
gathered outputs, their gradients and the optimizer state: the seed's main GPU
at 18186 MB next to 9824 MB on each other GPU. `NaiveDataParallel.memory`
measures this rank's share from the tensors it really held.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from parlab import comm
from parlab.parallel.data.buckets import broadcast_tensors, reduce_tensors
from parlab.parallel.data.meters import ActivationMeter, memory_report, tensor_bytes
from parlab.trace import Trace, region

__all__ = ["NaiveDataParallel", "NAIVE_PHASES", "traffic_by_phase"]

#: The labels of NaiveDataParallel's communication phases, in the order they run in one update.
NAIVE_PHASES = ("scatter inputs", "replicate model", "gather outputs", "scatter output grads", "reduce grads")


# ---------------------------------------------------------------------- measuring traffic
def traffic_by_phase(trace: Trace, phases: Iterable[str] = NAIVE_PHASES, direction: str = "sent"
                     ) -> dict[str, dict[int, float]]:
    """{phase label: {rank: wire bytes sent (or received)}} over the whole trace, 0 where a rank took no part."""
    ranks = trace.ranks
    out = {}
    for phase in phases:
        got = trace.filter(label=phase).bytes_per_rank(direction=direction)
        out[phase] = {r: got.get(r, 0.0) for r in ranks}
    return out


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ValueError(f"NaiveDataParallel gathers the model's output tensor; the model returned "
                     f"{type(out).__name__}. Return a tensor, or a tuple whose first item is the output to gather")


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))  # mean over B * S


_DTYPES = (torch.long, torch.int32, torch.float32, torch.float64, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------- the DataParallel pattern
class NaiveDataParallel:
    """torch's DataParallel on ranks: group rank 0 scatters, gathers, computes the loss and steps.

    Every rank builds the same `module` and an `optimizer` over its parameters and calls ``step(x, y)``
    each update; only rank 0's arguments are used (the others may pass None) and only rank 0 returns the
    loss. Rank 0's module is the master copy; the others are replicas refreshed at the start of each step
    (call `replicate()` to refresh them after the last one). `loss_fn(outputs, targets)` defaults to mean
    cross-entropy over the last dimension; a model returning a tuple has its first item gathered.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, group=None):
        self.module, self.optimizer, self.loss_fn, self.group = module, optimizer, loss_fn or _cross_entropy, group
        self.root = comm.group_ranks(group)[0]                 # the "main GPU", as a global rank
        self.is_root = comm.get_rank() == self.root
        self.device = next(module.parameters()).device
        self.memory: dict[str, int] = {}                        # this rank's bytes by category, last step

    def replicate(self) -> None:
        """Phase 2: every rank's parameters and buffers become rank 0's."""
        tensors = [p.data for p in self.module.parameters()] + list(self.module.buffers())
        broadcast_tensors(tensors, src=self.root, group=self.group, label="replicate model")

    def _scatter_inputs(self, x: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        n = comm.get_world_size(self.group)
        meta = torch.zeros(8, dtype=torch.long, device=self.device)  # (ndim, shape..., dtype code) to allocate
        if self.is_root:
            if x is None or x.dim() > 6 or x.dtype not in _DTYPES:
                raise ValueError("rank 0 must pass the global batch x (a tensor of at most 6 dimensions)")
            if x.shape[0] % n:
                raise ValueError(f"batch of {x.shape[0]} rows is not divisible by {n} ranks; every replica gets "
                                 f"the same number of rows, so use a multiple of {n}")
            meta[0], meta[1: 1 + x.dim()], meta[7] = x.dim(), torch.tensor(x.shape), _DTYPES.index(x.dtype)
        comm.broadcast(meta, src=self.root, group=self.group, label="scatter inputs (shape)")
        shape = [int(s) for s in meta[1: 1 + int(meta[0])]]
        shape[0] //= n
        x_local = torch.empty(shape, dtype=_DTYPES[int(meta[7])], device=self.device)  # (b, ...)
        chunks = [c.to(self.device).contiguous() for c in x.chunk(n)] if self.is_root else None
        comm.scatter(x_local, chunks, src=self.root, group=self.group, label="scatter inputs")
        return x_local, chunks or []

    def step(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> torch.Tensor | None:
        """One update on the global batch (x, y) held by rank 0. Returns the loss on rank 0, None elsewhere."""
        n, group, root = comm.get_world_size(self.group), self.group, self.root
        if self.is_root and y is None:
            raise ValueError("rank 0 computes the loss, so it must pass the targets y")
        self.module.zero_grad(set_to_none=True)
        x_local, x_chunks = self._scatter_inputs(x)                    # 1. (b, S) on every rank
        self.replicate()                                               # 2.
        params = list(self.module.parameters())
        with region("forward"), ActivationMeter(params) as act:        # 3.
            out = _first_tensor(self.module(x_local))                  # (b, S, V)
        gathered = [torch.empty_like(out) for _ in range(n)] if self.is_root else None
        comm.gather(out.detach().contiguous(), gathered, dst=root, group=group, label="gather outputs")  # 4.
        loss, full, grad_chunks = None, None, None
        if self.is_root:                                               # 5.
            with region("loss"):
                full = torch.cat(gathered).requires_grad_()            # (B, S, V) on rank 0 only
                loss = self.loss_fn(full, y.to(self.device))
                loss.backward()                                        # full.grad: d loss / d outputs
                grad_chunks = [c.contiguous() for c in full.grad.chunk(n)]  # N x (b, S, V)
        g_local = torch.empty_like(out)                                # (b, S, V)
        comm.scatter(g_local, grad_chunks, src=root, group=group, label="scatter output grads")  # 6.
        with region("backward"):                                       # 7.
            out.backward(g_local)
        trainable = [p for p in params if p.requires_grad]
        for p in trainable:                # a parameter this replica did not use contributes zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads_held = tensor_bytes(p.grad for p in trainable)
        reduce_tensors([p.grad for p in trainable], dst=root, group=group, label="reduce grads")  # 8.
        if self.is_root:                                               # 9.
            with region("optimizer"):
                self.optimizer.step()
        else:                              # a replica's gradients are partial sums: drop them
            for p in trainable:
                p.grad = None
        report = memory_report(self.module, self.optimizer if self.is_root else None)
        report["gradients"] = grads_held
        report["inputs"] = tensor_bytes([x_local] + ([x, y] + x_chunks if self.is_root else []))
        report["activations"] = act.nbytes
        report["outputs"] = tensor_bytes([out] + (gathered + [full] if self.is_root else []))
        report["output grads"] = tensor_bytes([g_local] + (grad_chunks + [full.grad] if self.is_root else []))
        self.memory = report
        return loss.detach() if loss is not None else None
