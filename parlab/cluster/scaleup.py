"""Scale-up: replay a pipeline program as if it had trained a named model (GPT-3 175B, LLaMA) on a big cluster.

The *program* is the schedule every pipeline rank runs (its forwards, backwards, messages and waits, in order):
either traced from a tiny run (`parlab.parallel.pipeline.PipelineParallel` under ``parlab.run(..., trace=True)``,
one rank per stage) or built from a `Schedule` without running anything (`parlab.cluster.pipeline_program`: the
same steps, so GPT 1T on 512 GPUs, pp 64 and 512 micro-batches, replays in seconds). `scaleup(program, model,
hardware, layout)` keeps that program, gives every step the big model's cost on the layout
(`parlab.cluster.step_costs.StepCosts`: GEMMs by shape, memory-bound ops, TP communication, recomputation,
pipeline messages), adds each rank's gradient sync over its data-parallel replicas and its optimizer step, and
replays it (`parlab.cluster.replay`). Each rank stands for one pipeline rank's tp x cp GPUs; all data-parallel
replicas are alike, so the program need not have them. A rank holding several virtual stages (interleaving) pays
the sync and the optimizer for all of them.

`scale_work(trace, flops=k, comm_bytes=j)` is the blunt tool for any other run (DDP, ring attention): every
compute span's metered work times k (its memory-bound bytes too, or `mem_bytes`, all of them then at the memory's
bandwidth), every message and collective times j, e.g. k = (c_big / c)^2 and j = c_big / c to give a
ring-attention run c_big tokens per rank.

`compare(...)` puts the replay next to `parlab.cluster.planner.estimate` for the same layout (and a published time).
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from parlab.cluster.costs import ModelSpec
from parlab.cluster.hardware import Hardware
from parlab.cluster.pipeline_program import pipeline_trace
from parlab.cluster.replay import replay, step_time
from parlab.cluster.step_costs import (Layout, StepCosts, attention_core_bytes, check_inputs, layer_forward_bytes,
                                       layer_forward_flops)
from parlab.cluster.sync_costs import OPTIMIZER_BYTES_PER_PARAM
from parlab.parallel.pipeline.schedules import Schedule
from parlab.trace import Event, Trace

__all__ = ["Layout", "scaleup", "layer_forward_flops", "layer_forward_bytes", "attention_core_bytes", "compare",
           "planner_estimate", "scale_work", "OPTIMIZER_BYTES_PER_PARAM", "program_of"]

_LABEL = re.compile(r"stage (\d+) mb (\d+)")
_ACTIONS = ("forward", "backward", "backward_input", "backward_weight")
_OPT_LABEL = "optimizer (virtual)"
_DP_LABEL = "dp grads (virtual)"


def program_of(program: Trace | Schedule, tied_embedding: bool = True) -> Trace:
    """A pipeline program as a trace: a traced run as it is, a `Schedule` built (`pipeline_trace`; with the tied
    embedding's gradient exchange when `tied_embedding`)."""
    if isinstance(program, Schedule):
        return pipeline_trace(program, tied_embedding)
    if isinstance(program, Trace):
        return program
    raise ValueError(f"scale-up replays a pipeline program: a parlab.Trace of a PipelineParallel step or a "
                     f"parlab.parallel.pipeline.Schedule (e.g. one_f_one_b(8, 64)), got {type(program).__name__}")


def scaleup(program: Trace | Schedule, model: ModelSpec, hardware: Hardware, layout: Layout, *,
            memory_ops: bool = True, optimizer: bool = True, dropout: bool | None = None) -> Trace:
    """Replay the pipeline `program` (a traced tiny run, one rank per pipeline rank, or a `Schedule`) as `model`
    laid out as `layout` on `hardware`. Returns the replayed `Trace`, labelled "<hardware> as <model>".
    memory_ops: cost the memory-bound ops' bytes; optimizer: add each rank's Adam step; dropout: the model
    trains with dropout (None: `model.dropout`: Megatron's GPT does, LLaMA does not). A `Schedule` is built with
    the tied embedding's exchange only when `model.tied`. Costs: `parlab.cluster.step_costs`."""
    check_inputs(model, hardware, layout)          # types, and tp / cp dividing what they split
    trace = program_of(program, model.tied)
    ranks = trace.ranks
    if len(ranks) != layout.pp:
        raise ValueError(f"the program has {len(ranks)} ranks but the layout has pp={layout.pp}: scale-up replays a "
                         f"pipeline program with one rank per pipeline rank; trace or build one with {layout.pp}")
    held: dict[int, set[int]] = defaultdict(set)                  # rank -> the virtual stages it runs
    for e in trace.events:
        if e.kind == "compute" and e.op in _ACTIONS:
            hit = _LABEL.search(e.label)
            if hit:
                held[e.rank].add(int(hit[1]))
    if not held:
        raise ValueError("the trace has no pipeline actions (compute spans 'forward'/'backward' labelled 'stage s "
                         "mb i'): trace a step of parlab.parallel.pipeline.executor.PipelineParallel")
    S = max(max(v) for v in held.values()) + 1
    if S != layout.pp * layout.virtual:
        raise ValueError(f"the program has {S} virtual stages but the layout says pp={layout.pp} x virtual="
                         f"{layout.virtual} = {layout.pp * layout.virtual}; give the layout the program's virtual "
                         f"stages per rank")
    costs = StepCosts(model, hardware, layout, S, memory_ops=memory_ops, dropout=dropout)
    last_op = "backward_weight" if any(e.op == "backward_weight" for e in trace.events) else "backward"  # ZB-H1: W last

    def compute_time(e: Event) -> float:
        if e.label == _OPT_LABEL:                                 # the virtual Adam step
            return costs.sync.optimizer(held[e.rank])
        hit = _LABEL.search(e.label)
        if e.op not in _ACTIONS or not hit:
            return 0.0                                            # anything else the tiny run did: not the model's
        return costs.action(e.op, int(hit[1]))

    def comm_time(e: Event) -> float:
        if e.kind == "p2p":
            return costs.message(tied="tied" in e.label)
        if e.op == "all_reduce" and (e.label.startswith("dp grads") or len(e.group) <= 1):
            return costs.exposed_grad_sync(held[e.rank], last_op)
        return 0.0                                                # other collectives of the tiny run: free

    events = list(trace.events)
    ends = _last_ends(events)                                     # rank -> when its last event ends
    # the replicas' gradient sync, once per step: over dp x cp, and for a mixture of experts over the experts'
    # own replicas (edp), which exist even with dp = cp = 1 when the experts are split finer than tp (etp < tp)
    syncs = layout.dp * layout.cp > 1 or any(costs.sync.grad_sync(held[r]) for r in ranks)
    if syncs and not any(e.op == "all_reduce" for e in events):
        for r in ranks:
            events.append(Event(r, "collective", "all_reduce", ends[r], ends[r], group=(r,), label=_DP_LABEL))
    if optimizer:
        for r in ranks:                                           # each rank's Adam step, after everything else
            t = ends[r] + 1e-6
            events.append(Event(r, "compute", "optimizer", t, t, label=_OPT_LABEL))
    out = replay(Trace(events), hardware, grid=None, gpus_per_node=1, compute_time=compute_time, comm_time=comm_time)
    return dataclasses.replace(out, hardware=f"{hardware.name} as {model.name} ({layout.gpus} GPUs)")


def _last_ends(events) -> dict[int, float]:
    out: dict[int, float] = {}
    for e in events:
        if e.end > out.get(e.rank, float("-inf")):
            out[e.rank] = e.end
    return out


def compare(program: Trace | Schedule, model: ModelSpec, hardware: Hardware, layout: Layout, global_batch: int,
            published_s: float | None = None, **options) -> dict:
    """The replayed step time next to the planner's estimate (`parlab.cluster.planner.estimate`) for the same layout,
    model, batch and hardware (and, when given, a published step time; errors are relative to it). The planner is
    given the hardware, so it reads the same cost model (`StepCosts.step_terms`, the pipeline's bubble from
    running the schedule as the replay does, `parlab.cluster.pipeline_time`): on a program built from a `Schedule`
    the two agree to float rounding; a traced one keeps what its tiny run did (e.g. a tied embedding's exchange
    that the named model does not make). The schedule is the program's (`_planner_schedule`: ZB-H1 when it
    splits the backward, GPipe when every rank runs all its forwards first); `global_batch` must be dp x
    micro-batch x the program's micro-batches. `options` go to `scaleup` only (memory_ops, optimizer, dropout):
    the planner always counts the memory-bound ops and Adam, and the model's own dropout."""
    trace = program_of(program, model.tied)
    mbs = {int(hit[2]) for e in trace.events if e.kind == "compute" for hit in [_LABEL.search(e.label)] if hit}
    m = len(mbs)
    if global_batch != layout.dp * layout.micro_batch * m:
        raise ValueError(f"global batch {global_batch} is not the program's: dp {layout.dp} x micro-batch "
                         f"{layout.micro_batch} x {m} micro-batches = {layout.dp * layout.micro_batch * m}")
    schedule = _planner_schedule(trace, layout.virtual)
    rep = step_time(scaleup(trace, model, hardware, layout, **options))
    est = planner_estimate(model, hardware, layout, global_batch, schedule)
    out = {"replay_s": rep, "planner_s": est.step_s}
    if published_s is not None:
        out.update(published_s=published_s, replay_error=rep / published_s - 1, planner_error=est.step_s / published_s - 1)
    return out


def _planner_schedule(trace: Trace, virtual: int) -> str:
    """The planner's name of a pipeline program's schedule: "zb-h1" when it splits the backward, "gpipe" when every
    rank runs all its forwards before its first backward (1F1B's last rank alternates them from the first
    micro-batch on; with one micro-batch the two are the same program), else "1f1b" (interleaved with virtual > 1)."""
    runs: dict[int, list[str]] = defaultdict(list)
    for e in sorted(trace.events, key=lambda e: e.start):
        if e.kind == "compute" and e.op in _ACTIONS and _LABEL.search(e.label):
            runs[e.rank].append(e.op)
    if any("backward_weight" in ops for ops in runs.values()):
        return "zb-h1"
    forwards_first = all(ops.index("backward") == ops.count("forward") for ops in runs.values() if "backward" in ops)
    return "gpipe" if virtual == 1 and forwards_first else "1f1b"


def planner_estimate(model: ModelSpec, hardware: Hardware, layout: Layout, global_batch: int,
                     schedule: str = "1f1b", simulate: bool = True):
    """`parlab.cluster.planner.estimate` of one `Layout` (every field of it) on `hardware`, on the cluster of
    `layout.gpus` GPUs that `hardware` describes: the replay's cost model in closed form, its pipeline bubble
    simulated (`parlab.cluster.pipeline_time`; `simulate` False: the closed form's)."""
    from parlab.cluster.planner import cluster_for, estimate
    return estimate(model, cluster_for(hardware, layout.gpus), global_batch, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                    micro_batch=layout.micro_batch, zero=layout.zero, recompute=layout.recompute,
                    sequence_parallel=layout.sequence_parallel, virtual=layout.virtual, hardware=hardware,
                    tp_overlap=layout.tp_overlap, dp_overlap=layout.dp_overlap, schedule=schedule,
                    precision=layout.precision, attention=layout.attention, ep=layout.ep, etp=layout.etp,
                    simulate=simulate)


def scale_work(trace: Trace, flops: float = 1.0, comm_bytes: float = 1.0, mem_bytes: float | None = None,
               optimizer_bytes: float | None = None) -> Trace:
    """A copy of `trace` whose compute spans do `flops` times the work (memory-bound bytes times `mem_bytes`,
    default the same factor; kernels unchanged) and whose communication moves `comm_bytes` times the bytes.
    Spans named "optimizer" (`parlab.trace.region("optimizer")`: the optimizer step, whose traffic is per
    parameter, not per token) scale their bytes by `optimizer_bytes` instead, when given (e.g. the ratio of the
    parameter counts). For replaying a small run as a bigger one of the same program (`parlab.cluster.replay.replay`
    the result)."""
    for name, k in (("flops", flops), ("comm_bytes", comm_bytes), ("mem_bytes", mem_bytes),
                    ("optimizer_bytes", optimizer_bytes)):
        if k is not None and not (isinstance(k, (int, float)) and k > 0):
            raise ValueError(f"{name} must be a positive factor, got {k!r}")
    if not any(e.kind == "compute" and (e.flops or e.nbytes) for e in trace.events):
        raise ValueError("the trace's compute spans carry no metered work: record it inside "
                         "parlab.trace.count_costs() (or give regions flops=...)")
    mem = flops if mem_bytes is None else mem_bytes
    out = []

    def scaled(t, mem=mem):
        # the meter's running totals are scaled alike (a replay splits spans by them); the size classes of the
        # memory-bound ops are dropped: the bigger model's ops do not fit any cache, every byte goes at mem_bw
        # (kernels, and the plain ones among them, are unchanged)
        return ((t[0] * flops, t[1] * mem, t[2], (), t[4] * flops, *(v * mem for v in t[5:6]), *t[6:])
                if len(t) in (5, 6, 7) else t)
    for e in trace.events:
        at, waited = scaled(e.meter_at), scaled(e.meter_waited)
        if e.kind == "compute":
            k = optimizer_bytes if e.op == "optimizer" and optimizer_bytes is not None else mem
            out.append(dataclasses.replace(e, flops=e.flops * flops, nbytes=round(e.nbytes * k), mem_hist=(),
                                           batched_flops=e.batched_flops * flops, special=e.special * k,
                                           meter_at=at))
        elif e.kind in ("collective", "p2p"):
            out.append(dataclasses.replace(e, nbytes=round(e.nbytes * comm_bytes), numel=round(e.numel * comm_bytes),
                                           meter_at=at, meter_waited=waited))
        else:
            out.append(dataclasses.replace(e, meter_at=at, meter_waited=waited))
    return Trace(out, trace.hardware)
