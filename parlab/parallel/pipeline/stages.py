"""A pipeline's stages: the pieces of the tiny GPT one rank holds under a schedule's placement.

`split_layers` (`parlab.parallel.pipeline.schedules`) gives each of the S = p * v (virtual) stages a balanced run
of transformer blocks; stage 0 also embeds the tokens and stage S - 1 also computes the head (and the loss).
`PipelineStages(model, schedule, group)` keeps on this rank only the stages `schedule.placement` gives it: its
`module` is the model with every other rank's blocks (and embedding, head) set to None, so parameter names stay
those of the full model, and `forward_stage(s, x)` runs stage s. The executor (`parlab.parallel.pipeline.executor`)
builds on it and runs a schedule's actions.

With tied embeddings (GPT-2's lm_head.weight is wte.weight) and the first and last stage on different ranks,
each of the two keeps a copy, and `_sync_tied` adds their gradients after the step (one p2p exchange, as
Megatron's embedding group does with an all-reduce; Narayanan et al., SC 2021, arXiv:2104.04473).
"""
from __future__ import annotations

import torch

from parlab import comm
from parlab.parallel.meta_init import materialize, meta_parameters
from parlab.models import GPT, clone_model
from parlab.parallel.pipeline.schedules import Schedule, split_layers

__all__ = ["PipelineStages"]


class PipelineStages:
    """The stages of `model` that `schedule` places on this rank of the pipeline group `group` (default: world).

    copy    True (default): `module` is a deep copy of `model` (for a moment the rank holds two full models);
            False: the caller hands `model` over and the other stages are dropped from it in place.
    device  move (or, from the meta device, materialise) only the kept stages there."""

    def __init__(self, model: GPT, schedule: Schedule, group=None, *, copy: bool = True,
                 device: torch.device | str | None = None):
        self.schedule, self.group = schedule, group
        self.rank = comm.get_rank(group)                      # position in the pipeline group
        self.peers = comm.group_ranks(group)                  # pipeline rank -> global rank
        S = schedule.stages
        self.layers = split_layers(model.config.n_layer, S)
        self.my_stages = schedule.stages_of(self.rank)
        self.module = m = clone_model(model) if copy else model   # copy=False: the caller hands it over
        keep = {i for s in self.my_stages for i in self.layers[s]}
        for i in range(len(m.blocks)):
            if i not in keep:
                m.blocks[i] = None
        if 0 not in self.my_stages:
            m.wte = m.wpe = None
        if S - 1 not in self.my_stages:
            m.ln_f = m.lm_head = None
        ref = next(m.parameters())
        self.dtype, self.device = ref.dtype, ref.device       # of the messages: (b, S, H) hidden states
        if device is not None:
            self.to(device)                                   # only this rank's stages (materialised, if on meta)
        # tied embeddings split across two ranks: each keeps a copy whose gradients are added after the step
        self.tied = model.config.tie_embeddings and schedule.placement[0] != schedule.placement[S - 1]

    def to(self, device: torch.device | str) -> "PipelineStages":
        """Move the stages this rank holds (and its messages) to `device`; returns self. Parameters still on
        the meta device are materialised there (`parlab.parallel.meta_init.materialize`), the dense model's values."""
        m = self.module
        tied = m.wte is not None and m.lm_head is not None and m.lm_head.weight is m.wte.weight
        if meta_parameters(m):                                # built on meta: draw only what this rank kept
            materialize(m, device)
        m.to(device)
        if tied and m.lm_head.weight is not m.wte.weight:
            m.lm_head.weight = m.wte.weight                   # keep one tied parameter, whatever .to did
        ref = next(m.parameters())
        self.dtype, self.device = ref.dtype, ref.device       # of the messages
        return self

    def parameters(self):
        return self.module.parameters()

    def grads(self) -> dict[str, torch.Tensor]:
        """Gradient of every parameter this rank holds, under its name in the full model."""
        out = {}
        for name, prm in self.module.named_parameters():
            if prm.grad is not None:
                out["wte.weight" if name == "lm_head.weight" and self.module.config.tie_embeddings else name] = prm.grad
        return out

    def forward_stage(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        """Stage `stage` on ids (B, S) (stage 0) or hidden states (B, S, H); hidden (B, S, H) or logits (B, S, V)."""
        m = self.module
        if stage == 0:
            x = m.embed(x)                                    # (B, S) -> (B, S, H)
        for i in self.layers[stage]:
            x = m.blocks[i](x)                                # (B, S, H)
        if stage == self.schedule.stages - 1:
            x = m.head(x)                                     # (B, S, V)
        return x

    def _sync_tied(self) -> None:
        """First and last stage add their gradients of the tied embedding (wte.weight == lm_head.weight)."""
        if not self.tied:
            return
        S, pl = self.schedule.stages, self.schedule.placement
        mine = {pl[0]: self.module.wte, pl[S - 1]: self.module.lm_head}.get(self.rank)
        if mine is None:
            return
        other = pl[S - 1] if self.rank == pl[0] else pl[0]
        w = mine.weight
        g = w.grad if w.grad is not None else torch.zeros_like(w)
        buf = torch.empty_like(g)
        if self.rank < other:     # the lower rank sends first, the higher receives first: mirrored orders
            work = comm.isend(g.clone(), self.peers[other], group=self.group, label="tied embedding grad")
            comm.recv(buf, self.peers[other], group=self.group, label="tied embedding grad")
            work.wait()
        else:
            comm.recv(buf, self.peers[other], group=self.group, label="tied embedding grad")
            comm.send(g, self.peers[other], group=self.group, label="tied embedding grad")
        w.grad = g + buf
