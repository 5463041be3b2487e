"""Data parallelism and the optimizer in a big model's step: the gradient sync over the replicas per ZeRO stage,
and the Adam step, per pipeline rank (`parlab.cluster.step_costs.StepCosts` charges them to its program).

Per rank and step, over the parameters psi of the virtual stages it holds (on one of its tp GPUs), with
N = dp x cp replicas:

    ZeRO-0    an all-reduce of 2 psi bytes at the end of the step
    ZeRO-1    (Megatron's distributed optimizer) a reduce-scatter of the gradients and an all-gather of the
              updated 16-bit weights at the end (the same bytes as the all-reduce); Adam on psi / N
    ZeRO-2    only a gradient shard is kept, so the reduce-scatter runs after every micro-batch's backward,
              beside it; the all-gather at the end
    ZeRO-3    the weights too are sharded: all-gathered before every micro-batch's forward and again before its
              backward (prefetched, beside the compute), the gradients reduce-scattered after it; nothing at the end
    Adam      a memory-bound pass: per parameter the fp32 gradient read (4 B), the fp32 master weight, momentum
              and variance read and written (3 x 8 B), the 16-bit weight written (2 B):
              OPTIMIZER_BYTES_PER_PARAM = 30 (the 2 + 2 + 12 bytes of state of mixed-precision Adam; Megatron
              keeps fp32 main gradients, hence 4 B for the gradient)

Collectives are timed by `Hardware.collective_time` on the link the dp group crosses. A mixture of experts'
experts (E / ep per MoE layer, / etp; `parlab.cluster.expert_costs`) are replicated over their edp expert-data-
parallel ranks, not the dp x cp replicas: their gradients sync over edp (beside the dense parameters' collective
over dp x cp, one after the other), and from ZeRO-1 on Adam updates an edp-th of them.

    S. Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020,
    arXiv:1910.02054, sections 3.1 (the bytes of mixed-precision Adam), 5 and 7 (what each stage moves).
Pure Python: no torch.
"""
from __future__ import annotations

import dataclasses

from parlab.cluster.costs import BYTES_16BIT, ModelSpec
from parlab.cluster.hardware import Hardware

__all__ = ["SyncCosts", "OPTIMIZER_BYTES_PER_PARAM"]

#: bytes one mixed-precision Adam step moves per parameter (module docstring)
OPTIMIZER_BYTES_PER_PARAM = 30


class SyncCosts:
    """The data-parallel sync and the optimizer step of `model` on `layout` (its tp, dp, cp and zero), with
    `layers[s]` layers in virtual stage s, over a dp group spanning `dp_nodes` nodes."""

    def __init__(self, model: ModelSpec, hardware: Hardware, layout, layers: list[int], dp_nodes: int,
                 experts=None):
        self.model, self.hw, self.layout, self.layers, self.dp_nodes = model, hardware, layout, layers, dp_nodes
        self.stages = len(layers)
        self.experts = experts if experts is not None and model.experts else None    # an `ExpertCosts`
        self._dp_seconds: dict[tuple, float] = {}     # (op, stages) -> seconds: asked for per action and stage

    def expert_params(self, stage: int) -> float:
        """The experts of virtual stage `stage` on one rank: E / ep MLPs / etp per MoE layer (0 for a dense model)."""
        if self.experts is None:
            return 0.0
        e = self.experts
        return e.layers[stage] * (self.model.experts // e.ep) * self.model.mlp_params(e.etp)

    def dense_params(self, stage: int) -> float:
        """Every other parameter of virtual stage `stage` on one of its tp GPUs (all of them for a dense model)."""
        if self.experts is None:
            return self.stage_params(stage)
        m, k = self.model, self.experts.layers[stage]
        mean = m.layer_params(self.layout.tp)          # a layer's share of the experts, taken out exactly below
        from parlab.cluster.expert_costs import local_layer_params
        moe_dense = local_layer_params(m, self.layout.tp)[0]
        base = dataclasses.replace(m, experts=0, top_k=1).layer_params(self.layout.tp)
        return self.stage_params(stage) - self.layers[stage] * mean + (self.layers[stage] - k) * base + k * moe_dense

    def stage_params(self, stage: int) -> float:
        """Parameters of virtual stage `stage` on one of its tp GPUs: its layers, the embedding on the first
        stage, the output layer on the last; with a tied head on another rank than the first stage, the last
        stage keeps its own copy of the embedding (Megatron's embedding group, Narayanan et al. 2021)."""
        tp, m, pp = self.layout.tp, self.model, self.layout.pp
        last = stage == self.stages - 1
        copy = m.vocab * m.hidden / tp if last and m.tied and (self.stages - 1) % pp != 0 else 0.0
        return (self.layers[stage] * m.layer_params(tp) + (m.embedding_params(tp) if stage == 0 else 0.0)
                + (m.head_params(tp) if last else 0.0) + copy)

    def _dp(self, op: str, stages) -> float:
        """One collective `op` of the 16-bit parameters (or gradients) of `stages` over the dp x cp replicas (and of
        their experts over the edp replicas)."""
        key = (op, tuple(stages))
        if key not in self._dp_seconds:
            self._dp_seconds[key] = self._dp_time(op, key[1])
        return self._dp_seconds[key]

    def _dp_time(self, op: str, stages: tuple) -> float:
        n, e = self.layout.dp * self.layout.cp, self.experts
        psi = sum(self.dense_params(s) for s in stages)
        t = 0.0 if n == 1 else self.hw.collective_time(op, BYTES_16BIT * psi, n, self.dp_nodes > 1, self.dp_nodes)
        if e is not None and e.edp > 1:
            nodes = e.nodes["edp"]
            t += self.hw.collective_time(op, BYTES_16BIT * sum(self.expert_params(s) for s in stages), e.edp,
                                         nodes > 1, nodes)
        return t

    def grad_sync(self, stages) -> float:
        """The end-of-step sync of a rank holding virtual `stages` over its dp x cp replicas (module docstring),
        before any overlap: ZeRO-0 all-reduce, ZeRO-1 reduce-scatter + all-gather, ZeRO-2 the all-gather (its
        reduce-scatters ran with each micro-batch), ZeRO-3 nothing."""
        z = self.layout.zero
        if z == 0:
            return self._dp("all_reduce", stages)
        return (self._dp("reduce_scatter", stages) if z == 1 else 0.0) + (self._dp("all_gather", stages) if z < 3
                                                                           else 0.0)

    def zero_traffic(self, op: str, stage: int) -> float:
        """Seconds of ZeRO-2/3 traffic one micro-batch's action `op` on `stage` moves (before overlap)."""
        z = self.layout.zero
        if z < 2:
            return 0.0
        if op == "forward":
            return self._dp("all_gather", [stage]) if z == 3 else 0.0
        gather = self._dp("all_gather", [stage]) if z == 3 and op != "backward_weight" else 0.0
        scatter = self._dp("reduce_scatter", [stage]) if op != "backward_input" else 0.0
        return gather + scatter

    def optimizer(self, stages) -> float:
        """Adam over the parameters of `stages` on one GPU (/ dp x cp from ZeRO-1 on: each updates its shard)."""
        psi = sum(self.dense_params(s) for s in stages)
        share = self.layout.dp * self.layout.cp if self.layout.zero >= 1 else 1
        experts = sum(self.expert_params(s) for s in stages)
        if experts:
            psi = psi / share + experts / (self.experts.edp if self.layout.zero >= 1 else 1)
            share = 1
        return self.hw.compute_time(0.0, OPTIMIZER_BYTES_PER_PARAM * psi / share)
