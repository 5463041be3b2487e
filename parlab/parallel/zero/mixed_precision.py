"""Dynamic loss scaling for float16 compute, agreed over a group of ranks (for FSDP/ZeRO/DDP in fp16).

float16 has 5 exponent bits: values below 2^-24 become 0. Gradients of a language model's loss are often
that small, so in fp16 they underflow and the update is lost. Loss scaling [1] multiplies the loss by S
before backward (so every gradient is S times larger and representable), and divides the gradients by S
before the optimizer step. Dynamic scaling [1, 2] picks S: start high (2^16); when any gradient is inf or
nan (S was too large), skip this step and halve S; after `growth_interval` good steps in a row, double S.

With sharded training (ZeRO-2/3, FSDP) each rank checks only the gradients it holds, so one rank can see an
inf that another does not. The ranks must agree, or one steps while another skips and their weights drift
apart: `LossScaler` all-reduces the "found inf" flag (MAX of one float, "loss scaler found inf") over
`group` before deciding, as torch's ShardedGradScaler does [3].

    scaler = LossScaler()                                   # group: the data-parallel ranks (default world)
    model = FullyShardedDataParallel(GPT(config), compute_dtype=torch.float16)
    opt = torch.optim.AdamW(model.parameters())             # fp32 master shards
    loss = model(x, y)[1]
    scaler.scale(loss).backward()                           # S * loss
    scaler.step(opt)                                        # unscale; step unless any rank found inf/nan
    scaler.update()                                         # halve S after an overflow, grow it when stable

S is also the gradient of the loss itself: when the loss is float16 (F.cross_entropy of fp16 logits), S must
stay below 65504 or that first gradient is inf; the default 2^16 then skips one step and halves. Computing
the loss in float32 (``logits.float()``) avoids it.

bfloat16 has float32's exponent range and needs none of this (the labs' --dtype bfloat16).

References
    [1] P. Micikevicius et al., "Mixed Precision Training", ICLR 2018, arXiv:1710.03740, section 3.2.
    [2] torch.amp.GradScaler (init_scale 2^16, growth 2, backoff 0.5, growth_interval 2000).
    [3] torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler (found-inf all-reduce over the group).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parlab import comm

__all__ = ["LossScaler"]


class LossScaler:
    """Dynamic loss scaling whose skip decisions agree over `group` (see the module docstring)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group=None):
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number (e.g. 2.0**16), got {init_scale!r}")
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1):
            raise ValueError(f"growth_factor must be > 1 (the scale grows after good steps), got {growth_factor!r}")
        if not (isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1):
            raise ValueError(f"backoff_factor must be in (0, 1) (the scale shrinks after an overflow), "
                             f"got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer (good steps before growing), "
                             f"got {growth_interval!r}")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.group = growth_interval, group
        self.good_steps = 0                 # good steps in a row since the last change of scale
        self.found_inf: bool | None = None  # of the current step, once unscaled
        self.skipped = 0                    # steps skipped so far

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """S * loss: call backward on this."""
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient of `optimizer` by S; True when any rank of the group found inf or nan."""
        if self.found_inf is not None:
            raise RuntimeError("unscale_ was already called for this step; call update() after step()")
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        device = grads[0].device if grads else next(p.device for g in optimizer.param_groups for p in g["params"])
        bad = torch.zeros(1, dtype=torch.float32, device=device)         # (1,) 1.0 if a gradient is not finite
        for gr in grads:
            gr.mul_(1.0 / self.scale_value)
            bad = torch.maximum(bad, (~torch.isfinite(gr)).any().to(torch.float32).reshape(1))
        if dist.is_initialized() and comm.get_world_size(self.group) > 1:
            comm.all_reduce(bad, op=comm.ReduceOp.MAX, group=self.group, label="loss scaler found inf")
        self.found_inf = bool(bad.item())
        return self.found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if not done yet) and step `optimizer` unless a rank found inf/nan; True if it stepped."""
        if self.found_inf is None:
            self.unscale_(optimizer)
        if self.found_inf:
            self.skipped += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """After `step`: halve S after an overflow (and start counting again), grow it after
        `growth_interval` good steps in a row."""
        if self.found_inf is None:
            raise RuntimeError("update() needs a step first: call scaler.step(optimizer) before update()")
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.good_steps = 0
        self.found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped = int(state.get("skipped", 0))
