"""Scale-up: replay a tiny pipeline run as if it had trained a named model (GPT-3 175B, LLaMA) on a big cluster.

The tiny run supplies the *program*: the schedule every pipeline rank ran (its forwards, backwards, messages
and waits, in their real order). `scaleup(trace, model, hardware, layout)` keeps that program and re-costs
every step with the big model's shapes (`parlab.cluster.costs.ModelSpec`), then replays it (`parlab.cluster.replay`):

    forward of stage s, micro-batch of b sequences   n_s layers x F_layer (+ the LM head on the last stage)
        F_layer = 2 b s (4 h^2 + k h f) + 4 b s^2 h     (k = 2 for a GELU MLP, 3 for SwiGLU; the s^2 term is
                                                         q k^T and the weighted sum of v), all / (tp cp)
        + TP communication, serial (Megatron without overlap): 2 all-reduces of 2 b s h / cp bytes per layer
          (with sequence parallelism an all-gather + reduce-scatter pair instead: the same bytes per rank)
    backward = 2 x forward FLOPs, 2 TP all-reduces per layer; recomputation adds one forward ("full": the whole
        layer, +2 all-reduces) or only the attention core 4 b s^2 h ("selective", Korthikanti et al. 2022)
    backward_input / backward_weight (zero bubble): the backward split evenly, TP traffic with the input part
    pipeline messages: 2 b s h / (tp cp) bytes (Megatron's scatter/gather between stages), on the link the pp
        group crosses; the tied-embedding gradient exchange: 2 V h / tp bytes
    data parallel: one gradient all-reduce of 2 psi_stage bytes over dp (x cp) ranks after the step, exposed
        (all replicas are alike, so the tiny run need not have had them: a run with pp ranks stands for pp x dp)

Memory-bound ops (`layer_forward_bytes`): the layer's layer norms, residual adds, dropouts, softmax and GeLU
move their inputs and outputs through HBM (16-bit elements, 1-byte dropout masks), at the hardware's memory
bandwidth x mem_efficiency. Per layer and forward, with E = b s h / cp elements of one hidden state (/ tp as
well with sequence parallelism, which splits these ops along the sequence: Korthikanti et al. 2022, section
4.2.2), A = a b s^2 / (tp cp) of one attention-score tensor and F = b s f / (tp cp) of the MLP's hidden layer:

    2 layer norms      2 x (2E read + 2E written)            =  8E
    2 residual adds    2 x (4E read + 2E written)            = 12E
    2 dropouts         2 x (2E read + 2E written + E mask)   = 10E   (dropout=True, Megatron's GPT runs)
    softmax            2A read + 2A written                  =  4A
    attention dropout  2A read + 2A written + A mask         =  5A   (dropout=True)
    GeLU               2F read + 2F written                  =  4F   (SwiGLU: SiLU 4F + the product 6F = 10F)

the op list of a Megatron layer as Calculon builds it (calculon/llm/llm.py `_build_attn_block` /
`_build_mlp_block`, commit caa4b11: LayerNorm, SoftMax, DropOut, DropOut, ElementWise residual, LayerNorm, GeLU,
DropOut, ElementWise residual) with the tensor sizes of Korthikanti et al. 2022, section 4.1 (attention: the
s^2 tensors of softmax and its dropout, 2 bytes per element, 1 byte per mask element). The backward moves the
same bytes again (Calculon's layers.py: the activation-gradient memory traffic of LayerNorm, SoftMax, DropOut,
GeLU equals their forward's) and, with recomputation, the recomputed part's forward bytes once more (selective:
softmax and attention dropout only, 4A + 5A). The last stage adds its final norm (4E) and the logits' softmax
(2 bytes x b s V / tp read and written, forward and backward again).

Optimizer step (`optimizer=True`): mixed-precision Adam on every rank after its data-parallel all-reduce, a
memory-bound pass over the rank's parameters psi_stage (already / tp): per parameter it reads the fp32 gradient
(4 B), reads and writes the fp32 master weight, momentum and variance (3 x 8 B) and writes the 16-bit weight
(2 B): OPTIMIZER_BYTES_PER_PARAM = 30 (the 2 + 2 + 12 bytes of state per parameter of mixed-precision Adam:
Rajbhandari et al., ZeRO, SC'20, section 3.1; Megatron keeps fp32 main gradients, hence 4 B for the gradient).
Not sharded (no distributed optimizer, as in Narayanan et al. 2021).

Each traced rank stands for one stage's tp x cp GPUs. Placement is Megatron's order on a grid of
tp x cp x dp x pp GPUs (`parlab.parallel.topology.ParallelGrid`) with the hardware's GPUs per node, so the pp and dp
groups cross nodes when tp x cp (x dp) fills a node. The compute model is the roofline of `parlab.cluster.hardware`:
the matrix products' FLOPs at the hardware's kernel-level efficiency plus the memory-bound ops' bytes above at
its memory bandwidth (the replay adds the bubble and the communication itself; `compare` gives the planner the
end-to-end MFU instead). `memory_ops=False, optimizer=False` gives the FLOPs-only model of before. Kernel launch
gaps and GEMMs below the kernel-level efficiency at these shapes are still left out.

`scale_work(trace, flops=k, comm_bytes=j)` is the blunt tool for any other run (DDP, ring attention): every
compute span's metered work times k (its memory-bound bytes too, or `mem_bytes`, all of them then at the memory's
bandwidth), every message and collective times j, e.g. k = (c_big / c)^2 and j = c_big / c to give a ring-attention run c_big tokens per rank.

`compare(...)` puts the replay next to `parlab.cluster.planner.estimate` for the same layout (and a published time).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from parlab.cluster.costs import BYTES_16BIT, Cluster, ModelSpec
from parlab.cluster.hardware import Hardware
from parlab.cluster.replay import replay, step_time
from parlab.parallel.pipeline import split_layers
from parlab.parallel.topology import ParallelGrid
from parlab.trace import Event, Trace

__all__ = ["Layout", "scaleup", "layer_forward_flops", "layer_forward_bytes", "attention_core_bytes", "compare",
           "scale_work", "OPTIMIZER_BYTES_PER_PARAM"]

#: bytes one mixed-precision Adam step moves per parameter (module docstring)
OPTIMIZER_BYTES_PER_PARAM = 30
_MASK_BYTES = 1                      # a dropout mask element (Korthikanti et al. 2022, section 4.1)

_LABEL = re.compile(r"stage (\d+) mb (\d+)")
_ACTIONS = ("forward", "backward", "backward_input", "backward_weight")
_OPT_LABEL = "optimizer (virtual)"


@dataclass(frozen=True)
class Layout:
    """How the big model is laid out: tp x cp x dp x pp GPUs, b sequences per micro-batch, recomputation."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    micro_batch: int = 1
    recompute: str = "none"          # "none" | "full" | "selective"
    sequence_parallel: bool = False

    def __post_init__(self):
        for k in ("tp", "pp", "dp", "cp", "micro_batch"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"layout {k} must be a positive integer, got {v!r}")
        if self.recompute not in ("none", "full", "selective"):
            raise ValueError(f"recompute must be 'none', 'full' or 'selective', got {self.recompute!r}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def layer_forward_flops(m: ModelSpec, b: int, tp: int = 1, cp: int = 1) -> float:
    """Forward FLOPs of one layer on one of tp x cp GPUs for b sequences (module docstring)."""
    s, h, f = m.seq, m.hidden, m.ffn
    k = 3 if m.swiglu else 2
    return (2 * b * s * (4 * h * h + k * h * f) + 4 * b * s * s * h) / (tp * cp)


def attention_core_bytes(m: ModelSpec, b: int, tp: int = 1, cp: int = 1, dropout: bool = True) -> float:
    """Forward bytes of one layer's attention-score ops (softmax 4A, its dropout 5A; module docstring) on one of
    tp x cp GPUs for b sequences: A = a b s^2 / (tp cp) elements."""
    A = m.heads * b * m.seq * m.seq / (tp * cp)
    return 2 * BYTES_16BIT * A + ((2 * BYTES_16BIT + _MASK_BYTES) * A if dropout else 0.0)


def layer_forward_bytes(m: ModelSpec, b: int, tp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                        dropout: bool = True) -> float:
    """Forward bytes of one layer's memory-bound ops (norms, residual adds, dropouts, softmax, GeLU / SwiGLU;
    module docstring) on one of tp x cp GPUs for b sequences."""
    E = b * m.seq * m.hidden / (cp * (tp if sequence_parallel else 1))     # one hidden state (b, s/cp, h)
    F = b * m.seq * m.ffn / (tp * cp)                                      # the MLP's hidden layer (b, s/cp, f/tp)
    norms = 2 * (2 * BYTES_16BIT * E)
    residual = 2 * (3 * BYTES_16BIT * E)
    drops = 2 * ((2 * BYTES_16BIT + _MASK_BYTES) * E) if dropout else 0.0
    act = (5 if m.swiglu else 2) * BYTES_16BIT * F
    return norms + residual + drops + act + attention_core_bytes(m, b, tp, cp, dropout)


def scaleup(trace: Trace, model: ModelSpec, hardware: Hardware, layout: Layout, *, memory_ops: bool = True,
            optimizer: bool = True, dropout: bool = True) -> Trace:
    """Replay the tiny pipeline run `trace` (one rank per stage, `parlab.parallel.pipeline.executor`) as `model` laid out
    as `layout` on `hardware`. Returns the replayed `Trace`, labelled "<hardware> as <model>".
    memory_ops: cost the memory-bound ops' bytes (`layer_forward_bytes`); optimizer: add each rank's Adam step;
    dropout: the model trains with dropout (Megatron's GPT; LLaMA does not)."""
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model must be a parlab.cluster.costs.ModelSpec (e.g. parlab.cluster.costs.preset('gpt3-175b')), "
                         f"got {type(model).__name__}")
    ranks = trace.ranks
    if len(ranks) != layout.pp:
        raise ValueError(f"the trace has {len(ranks)} ranks but the layout has pp={layout.pp}: scale-up replays a "
                         f"pipeline run with one rank per stage; trace a run with {layout.pp} pipeline ranks")
    stages_seen = [int(m[1]) for e in trace.events if e.kind == "compute" and e.op in _ACTIONS
                   for m in [_LABEL.search(e.label)] if m]
    if not stages_seen:
        raise ValueError("the trace has no pipeline actions (compute spans 'forward'/'backward' labelled 'stage s "
                         "mb i'): trace a step of parlab.parallel.pipeline.executor.PipelineParallel")
    S = max(stages_seen) + 1
    if S > model.layers:
        raise ValueError(f"the traced pipeline has {S} stages but {model.name} has {model.layers} layers")
    layers = [len(r) for r in split_layers(model.layers, S)]
    b, tp, cp = layout.micro_batch, layout.tp, layout.cp
    s, h = model.seq, model.hidden
    grid = ParallelGrid(layout.gpus, tp=tp, pp=layout.pp, cp=cp, dp=layout.dp,
                        gpus_per_node=min(hardware.gpus_per_node, layout.gpus))
    act = BYTES_16BIT * b * s * h / cp                            # one micro-batch's hidden states on a CP rank
    tp_nodes = grid.num_nodes if grid.crosses_nodes(grid.group_of(0, "tp")) else 1
    t_tp = hardware.collective_time("all_reduce", act, tp, tp_nodes > 1, tp_nodes) if tp > 1 else 0.0
    pp_cross = grid.crosses_nodes(grid.group_of(0, "pp"))
    dp_group = grid.group_of(0, "cp-dp")
    dp_nodes = len({grid.node_of(r) for r in dp_group})
    f_layer = layer_forward_flops(model, b, tp, cp)
    attn_core = 4 * b * s * s * h / (tp * cp)
    sp = layout.sequence_parallel
    m_layer = layer_forward_bytes(model, b, tp, cp, sp, dropout) if memory_ops else 0.0
    m_core = attention_core_bytes(model, b, tp, cp, dropout) if memory_ops else 0.0
    # the last stage: final norm (4E) and the logits' softmax, (b, s/cp, V/tp) read and written
    m_head = (2 * BYTES_16BIT * b * s * h / (cp * (tp if sp else 1))
              + 2 * BYTES_16BIT * b * s * model.vocab / (tp * cp)) if memory_ops else 0.0

    def stage_params(st: int) -> float:
        return layers[st] * model.layer_params(tp) + (model.embedding_params(tp) if st == 0 else 0.0) \
            + (model.head_params(tp) if st == S - 1 else 0.0)

    def compute_time(e: Event) -> float:
        if e.label == _OPT_LABEL:                                 # the virtual Adam step (module docstring)
            return hardware.compute_time(0.0, OPTIMIZER_BYTES_PER_PARAM * stage_params(_stage_of_rank(trace, e.rank)))
        hit = _LABEL.search(e.label)
        if e.op not in _ACTIONS or not hit:
            return 0.0                                            # anything else the tiny run did: not the model's
        st = int(hit[1])
        n = layers[st]
        fwd = n * f_layer + (2 * b * s * h * model.vocab / tp if st == S - 1 else 0.0)
        extra = {"none": 0.0, "full": fwd, "selective": n * attn_core}[layout.recompute]
        mem = n * m_layer + (m_head if st == S - 1 else 0.0)      # forward bytes of the memory-bound ops
        mem_extra = {"none": 0.0, "full": mem, "selective": n * m_core}[layout.recompute]
        calls = {"forward": 2, "backward": 2 + (2 if layout.recompute == "full" else 0)}
        if e.op == "forward":
            flops, nbytes, ar = fwd, mem, 2 * n
        elif e.op == "backward":
            flops, nbytes, ar = 2 * fwd + extra, mem + mem_extra, calls["backward"] * n
        elif e.op == "backward_input":                           # the activation gradients: all memory-bound ops
            flops, nbytes, ar = fwd + extra, mem + mem_extra, calls["backward"] * n
        else:
            flops, nbytes, ar = fwd, 0.0, 0
        return hardware.compute_time(flops, nbytes) + ar * t_tp

    def comm_time(e: Event) -> float:
        if e.kind == "p2p":
            nbytes = (BYTES_16BIT * model.vocab * h / tp) if "tied" in e.label else act / tp
            return hardware.collective_time(e.op, nbytes, 2, pp_cross)
        if e.op == "all_reduce" and (e.label.startswith("dp grads") or len(e.group) <= 1):
            psi = stage_params(_stage_of_rank(trace, e.rank))
            n = layout.dp * cp
            return hardware.collective_time("all_reduce", BYTES_16BIT * psi, n, dp_nodes > 1, dp_nodes)
        return 0.0                                                # other collectives of the tiny run: free

    events = list(trace.events)
    if layout.dp * cp > 1 and not any(e.op == "all_reduce" for e in events):
        for r in ranks:                                           # the replicas' gradient all-reduce, once per step
            last = max(e.end for e in events if e.rank == r)
            events.append(Event(r, "collective", "all_reduce", last, last, group=(r,), label="dp grads (virtual)"))
    if optimizer:
        for r in ranks:                                           # each rank's Adam step, after everything else
            last = max(e.end for e in events if e.rank == r) + 1e-6
            events.append(Event(r, "compute", "optimizer", last, last, label=_OPT_LABEL))
    out = replay(Trace(events), hardware, grid=None, gpus_per_node=1, compute_time=compute_time, comm_time=comm_time)
    return dataclasses.replace(out, hardware=f"{hardware.name} as {model.name} ({layout.gpus} GPUs)")


def _stage_of_rank(trace: Trace, rank: int) -> int:
    for e in trace.events:
        if e.rank == rank and e.kind == "compute":
            hit = _LABEL.search(e.label)
            if hit:
                return int(hit[1])
    return 0


def compare(trace: Trace, model: ModelSpec, hardware: Hardware, layout: Layout, global_batch: int,
            published_s: float | None = None, **options) -> dict:
    """The replayed step time next to the planner's estimate (`parlab.cluster.planner.estimate`) for the same layout,
    model, batch and hardware (and, when given, a published step time; errors are relative to it). The replay
    computes at the hardware's kernel-level `efficiency` and adds bubbles and communication itself; the planner,
    which adds less of them, at its end-to-end MFU (`Hardware.end_to_end_mfu`). `options` go to `scaleup`
    (memory_ops, optimizer, dropout)."""
    from parlab.cluster.planner import estimate
    rep = step_time(scaleup(trace, model, hardware, layout, **options))
    nodes = max(1, layout.gpus // hardware.gpus_per_node)
    cluster = Cluster(nodes=nodes, gpus_per_node=min(hardware.gpus_per_node, layout.gpus),
                      intra_gbps=hardware.intra_bw / 1e9, inter_gbps=hardware.inter_bw / 1e9,
                      peak_tflops=hardware.peak_flops / 1e12, mfu=hardware.end_to_end_mfu)
    est = estimate(model, cluster, global_batch, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                   micro_batch=layout.micro_batch, zero=1 if layout.dp > 1 else 0,
                   recompute=layout.recompute, sequence_parallel=layout.sequence_parallel)
    out = {"replay_s": rep, "planner_s": est.step_s}
    if published_s is not None:
        out.update(published_s=published_s, replay_error=rep / published_s - 1, planner_error=est.step_s / published_s - 1)
    return out


def scale_work(trace: Trace, flops: float = 1.0, comm_bytes: float = 1.0, mem_bytes: float | None = None) -> Trace:
    """A copy of `trace` whose compute spans do `flops` times the work (memory-bound bytes times `mem_bytes`,
    default the same factor; kernels unchanged) and whose communication moves `comm_bytes` times the bytes.
    For replaying a small run as a bigger one of the same program (`parlab.cluster.replay.replay` the result)."""
    for name, k in (("flops", flops), ("comm_bytes", comm_bytes), ("mem_bytes", mem_bytes)):
        if k is not None and not (isinstance(k, (int, float)) and k > 0):
            raise ValueError(f"{name} must be a positive factor, got {k!r}")
    if not any(e.kind == "compute" and (e.flops or e.nbytes) for e in trace.events):
        raise ValueError("the trace's compute spans carry no metered work: record it inside "
                         "parlab.trace.count_costs() (or give regions flops=...)")
    mem = flops if mem_bytes is None else mem_bytes
    out = []

    def scaled(t):
        # the meter's running totals are scaled alike (a replay splits spans by them); the size classes of the
        # memory-bound ops are dropped: the bigger model's ops do not fit any cache, every byte goes at mem_bw
        # (kernels, and the plain ones among them, are unchanged)
        return ((t[0] * flops, t[1] * mem, t[2], (), t[4] * flops, *(v * mem for v in t[5:6]), *t[6:])
                if len(t) in (5, 6, 7) else t)
    for e in trace.events:
        at, waited = scaled(e.meter_at), scaled(e.meter_waited)
        if e.kind == "compute":
            out.append(dataclasses.replace(e, flops=e.flops * flops, nbytes=round(e.nbytes * mem), mem_hist=(),
                                           batched_flops=e.batched_flops * flops, special=e.special * mem,
                                           meter_at=at))
        elif e.kind in ("collective", "p2p"):
            out.append(dataclasses.replace(e, nbytes=round(e.nbytes * comm_bytes), numel=round(e.numel * comm_bytes),
                                           meter_at=at, meter_waited=waited))
        else:
            out.append(dataclasses.replace(e, meter_at=at, meter_waited=waited))
    return Trace(out, trace.hardware)
