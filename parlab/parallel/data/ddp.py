"""DistributedDataParallel: every rank computes its own loss; gradients are averaged in buckets during backward.

Data parallelism keeps a full copy of the model on every rank and splits the batch; averaging the ranks'
gradients gives the step one process would take on the whole batch (`parlab.parallel.data.naive` has the
derivation, and the design through a main rank that this one replaced).

`DistributedDataParallel` is what ``torch.nn.parallel.DistributedDataParallel``
does (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020, arXiv:2006.15704): every rank computes its own
loss and backward, and gradients are averaged with all-reduces *during*
backward:

* gradients go into buckets (`parlab.parallel.data.buckets.GradBucket`) filled in reverse
  registration order, which is roughly the order backward produces them, up
  to ``bucket_cap_mb``;
* a post-accumulate-grad hook on each parameter copies its gradient into its
  bucket; when a bucket is full its all-reduce starts asynchronously, while
  backward goes on computing the gradients of earlier layers. Buckets start in
  index order on every rank, because collectives are matched by call order;
* at the end of backward an autograd-engine callback waits for every bucket
  and copies the averages back into ``param.grad``. So ``loss.backward()``
  returns with synchronised gradients; `finish_grad_sync` does the same
  explicitly and is a no-op when backward already did it;
* inside ``no_sync()`` backward only accumulates locally (gradient
  accumulation); the first backward outside it reduces the sum.

A ring all-reduce of X bytes sends 2 (N-1)/N X per rank (REFERENCES.md), and
DDP all-reduces each gradient byte exactly once per step.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
import torch.nn as nn

from parlab import comm
from parlab.parallel.data.buckets import GradBucket, assign_buckets, broadcast_tensors
from parlab.parallel.data.meters import memory_report
from parlab.trace import Event, current_recorder, now, region

__all__ = ["DistributedDataParallel"]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class DistributedDataParallel(nn.Module):
    """Wrap `module` so that backward averages its gradients over `group`, in buckets, overlapping backward.

    ``model = DistributedDataParallel(GPT(cfg), bucket_cap_mb=25)``; then the usual loop:
    ``loss = model(x, y)[1]; loss.backward(); opt.step(); opt.zero_grad()`` with any torch optimizer over
    ``model.parameters()``. At construction every rank takes group rank 0's parameters and buffers.

    find_unused_parameters  a parameter that gets no gradient on a rank contributes zeros to the average
                            either way. With True, one more small all-reduce per step ("unused parameters")
                            finds the parameters no rank used; they keep ``grad = None``, as in one process,
                            so optimizers with weight decay or momentum leave them alone. With False they
                            get a zero gradient.
    Parameters with ``requires_grad=False`` at construction are broadcast once and never reduced.
    One backward per forward: a second backward before the next forward accumulates locally, unsynchronised.
    Padded targets. Averaging the ranks' gradients of their own mean losses gives the global mean only when
    every rank holds equally many non-ignored targets. With padding (ignore_index -100) spread unevenly, use
    ``loss = parlab.parallel.data.loss.global_mean_loss(logits, targets, group)``: D * (this rank's sum) / (the global
    count, one all-reduce), whose average over the ranks is the global mean over the non-ignored targets.

    What a trace shows per step: a "forward" region; "backward" compute spans labelled "until bucket i ready"
    and "rest of backward"; async all-reduces labelled "grad bucket i" (start = launch, end = completion);
    a "grad sync" region where the end of backward waits for the buckets. `bucket_names` lists each
    bucket's parameters.
    """

    def __init__(self, module: nn.Module, group=None, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False):
        super().__init__()
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0 \
                or not math.isfinite(bucket_cap_mb):
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB (2**20 bytes), and finite; got "
                             f"{bucket_cap_mb!r}; "
                             f"e.g. 25 (torch's default), or 0.001 for about one bucket per small parameter")
        self.module, self.group, self.find_unused_parameters = module, group, find_unused_parameters
        self.bucket_cap_mb = bucket_cap_mb
        tensors = [p.data for p in module.parameters()] + list(module.buffers())
        broadcast_tensors(tensors, src=comm.group_ranks(group)[0], group=group, label="broadcast params")

        names = {p: name for name, p in module.named_parameters()}  # a tied parameter appears once
        trainable = [p for p in module.parameters() if p.requires_grad][::-1]  # reverse registration order
        layout = assign_buckets([p.numel() * p.element_size() for p in trainable],
                                [(p.dtype, p.device) for p in trainable], max(1, int(bucket_cap_mb * 2**20)))
        self.buckets = [GradBucket(i, [trainable[j] for j in idx]) for i, idx in enumerate(layout)]
        self.bucket_names = [[names[p] for p in b.params] for b in self.buckets]
        self._slot = {p: (b, j) for b in self.buckets for j, p in enumerate(b.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in trainable]
        self._require_sync = True     # False inside no_sync()
        self._pending = False         # a backward that must reduce is expected / under way
        self._callback_queued = False
        self._next = 0                # the next bucket to launch; buckets start in index order on every rank
        self._t = None                # trace clock at the last backward span boundary

    # -- the training loop's side
    def forward(self, *args, **kwargs):
        self._pending = self._require_sync and torch.is_grad_enabled()
        if self._pending:
            for b in self.buckets:
                b.reset()
            self._next, self._callback_queued, self._t = 0, False, None
        with region("forward"):
            out = self.module(*args, **kwargs)
        if self._pending:   # a hook on the outputs: the moment backward starts, queue the end-of-backward sync
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(self._on_backward_start)
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Backward of forwards run inside the block accumulates ``param.grad`` locally, without communication."""
        before, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = before

    def finish_grad_sync(self) -> None:
        """Wait for every bucket and write the averaged gradients into ``param.grad``.

        Backward calls this by itself when it ends; calling it again is a no-op. Buckets holding a parameter
        that got no gradient are completed here (its local gradient, or zeros) and launched in index order."""
        if not self._pending:
            return
        if not self.buckets:            # nothing trainable
            self._pending = False
            return
        used = {p: True for b in self.buckets for p, got in zip(b.params, b.arrived) if got}
        for b in self.buckets[self._next:]:
            for j, p in enumerate(b.params):
                if not b.arrived[j]:
                    used[p] = p.grad is not None  # e.g. accumulated under no_sync, unused now
                    b.add_grad(j, p.grad)
        self._launch_ready()
        with region("grad sync", label="wait for buckets"):
            for b in self.buckets:
                b.wait()
        if self.find_unused_parameters:
            flags = torch.tensor([int(used[p]) for b in self.buckets for p in b.params], dtype=torch.int32,
                                 device=self.buckets[0].buffer.device)  # (trainable params,) 1 = used here
            comm.all_reduce(flags, group=self.group, label="unused parameters")
            used = {p: bool(f) for p, f in zip((p for b in self.buckets for p in b.params), flags.tolist())}
        with torch.no_grad():
            for b in self.buckets:
                for p, view in zip(b.params, b.views):
                    if self.find_unused_parameters and not used[p]:
                        continue                                  # no rank used it: grad stays as it was
                    if p.grad is None:
                        p.grad = view.clone()
                    else:
                        p.grad.copy_(view)
        self._pending = False

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """This rank's bytes: parameters, gradients, optimizer state, grad buckets (communication buffers)."""
        return memory_report(self.module, optimizer, grad_buckets=[b.buffer for b in self.buckets])

    # -- hooks (run inside autograd)
    def _on_backward_start(self, grad: torch.Tensor) -> None:
        if self._pending and not self._callback_queued:
            self._callback_queued = True
            self._t = now()
            rec = current_recorder()
            self._t_dev = rec.device_mark() if rec is not None else None   # cuda-events clock (else None)
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._pending:
            return                                                # no_sync: just accumulate
        self._on_backward_start(p.grad)                           # outputs were not tensors: queue from here
        bucket, slot = self._slot[p]
        if bucket.add_grad(slot, p.grad):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            b = self.buckets[self._next]
            self._span(f"until bucket {b.index} ready")
            b.all_reduce_async(self.group, label=f"grad bucket {b.index}")
            self._next += 1

    def _on_backward_end(self) -> None:
        self._span("rest of backward")
        self.finish_grad_sync()

    def _span(self, label: str) -> None:
        """Record the backward compute since the last boundary as a "backward" span (for timelines)."""
        rec, t = current_recorder(), now()
        if self._t is not None:
            t_dev = rec.device_mark() if rec is not None else None
            if rec is not None:
                ev = rec.add(Event(rank=rec.rank, kind="compute", op="backward", start=self._t, end=t, label=label))
                span = rec.device_span(ev, getattr(self, "_t_dev", None), end=False)
                if span is not None:   # on a GPU: from the last boundary's CUDA event to this one's
                    span.end = t_dev
            self._t, self._t_dev = t, t_dev
