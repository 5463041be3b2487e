"""Layout planner: which (dp, tp, pp, cp, micro-batch, ZeRO stage, recomputation) to train a model with.

`plan(model, cluster, global_batch)` enumerates every layout the model and the cluster allow, estimates
the memory of the fullest GPU and the time of one step with the formulas of `parlab.cluster.costs` (and of the
lessons), rejects the layouts that do not fit, ranks the rest by step time; `explain(ranked)` says in
words why the winner has its tp, pp and dp; `format_table` prints them; ``parlab plan`` is `plan_cli.main`.

A layout is valid when tp divides the heads, pp divides the layers, cp divides the sequence, and
tp * pp * cp divides the GPUs (dp is the rest); the global batch of B sequences is m micro-batches of
b sequences on each of the dp replicas: B = dp * b * m (cp ranks share a sequence, s / cp tokens each).
Ranks are placed in Megatron's order tp-cp-dp-pp (`parlab.parallel.topology.ParallelGrid`): a group whose ranks
sit on several nodes talks at the inter-node bandwidth. tp > gpus_per_node is allowed, and pays for it.

Memory of the fullest GPU (first pipeline stage) = model states + activations (+ ZeRO-3 buffers):
    states        2 + 2 + 12 bytes per parameter of its stage, sharded over dp * cp by ZeRO [1]
    activations   (L / pp) layers x min(pp, m) micro-batches in flight (1F1B's first stage [3])
                  x `transformer.activation_bytes_per_layer` (Korthikanti [2] table 2: sequence parallelism
                  on by default, recomputation none / selective / full; full adds one layer's whole set
                  while that layer is recomputed)
    ZeRO-3        two gathered 16-bit layers (the one computing and the one prefetched)

Time of one step = compute + bubble + TP + CP + exposed DP + PP communication:
    compute   hardware FLOPs of the step / (GPUs x peak x efficiency): `transformer.hardware_flops`, the
              model FLOPs 72 B s l h^2 (1 + s/6h + V/12lh) of [2] eq. 7 plus what recomputation repeats
              (eq. 8, selective; [3] eq. 3, full); `cluster.mfu` is the fraction of peak the kernels reach.
              The planner's achieved TFLOP/s count model FLOPs only: MFU x peak, as Megatron reports it
    bubble    (pp - 1) / (v m) x compute: 1F1B's idle time relative to the ideal step [3], v chunks per rank
              when interleaved (v = 1: plain 1F1B; the fraction of the *step* is (pp - 1)/(v m + pp - 1),
              `schedules.bubble_formula`); interleaving also keeps (1 + (pp - 1)/(pp v)) times the first
              stage's activations [2] and sends v times the point-to-point messages
    TP        per layer and micro-batch 4 all-reduces of 2 s b h / cp bytes (2 forward, 2 backward;
              +2 with recomputation), 2(tp-1)/tp of it per rank [4], on the critical path (no overlap)
    CP        ring attention: each layer passes (cp-1) K/V blocks of 2 x 2 s b h / (cp tp) bytes
              forward, twice that backward (K, V and their gradients); counted unhidden
    DP        gradient all-reduce of 2 psi_stage bytes over dp * cp ranks (ZeRO-1/2: reduce-scatter +
              all-gather, the same bytes). With m > 1 micro-batches the stages differ [1, 3]: ZeRO-2 keeps
              only a gradient shard, so it reduce-scatters after *every* micro-batch, (m + 1)(N-1)/N 2 psi;
              ZeRO-3 also all-gathers the weights forward and backward, 3 m (N-1)/N 2 psi_stage.
              Overlap assumption: ZeRO 0/1 hide the all-reduce behind the backward pass of the last
              micro-batch (the only one after which gradients are final); ZeRO-2 behind every backward
              pass (2/3 of compute); ZeRO-3 prefetches, hiding behind the whole compute. Only the rest
              is exposed. Equal step times go to the layout with less memory.
    PP        per micro-batch one activation forward and one gradient backward of 2 s b h /(tp cp)
              bytes per stage boundary (Megatron's scatter/gather optimisation [3]), unhidden

Given a `Hardware` (`estimate(..., hardware=...)`, ``parlab plan --hardware dgx-a100``) the time terms are instead
the replay's own cost model, `parlab.cluster.step_costs.StepCosts.step_terms`: every GEMM timed by its shape at
the kernel-level efficiency, the memory-bound ops, the exposed TP communication, m times the slowest pipeline
rank's work, the message chain, the gradient sync (ZeRO-1: the distributed optimizer) and Adam; `cluster.mfu` is
then not used. The bubble (fill, drain, and the waits of ranks that differ) is simulated: `estimate` runs the
schedule with those costs as the replay does (`parlab.cluster.pipeline_time`), so one layout's step is the
replay's to float rounding (tests/test_cost_model_property.py); `enumerate_layouts` ranks every layout by the
closed form's (pp - 1)/v chunk-times of fill and drain (`closed_form`, off by up to 3-12% on small models with a
slow last stage, 0.4% on Korthikanti et al.'s eight runs) and simulates the `SIMULATED` (50) fastest fitting
pipelined ones, whose numbers `plan` then ranks and prints. Memory is the same either way.

References: see `parlab.cluster.costs`; [1] ZeRO arXiv:1910.02054; [2] Korthikanti et al. arXiv:2205.05198;
[3] Narayanan et al. arXiv:2104.04473 (1F1B, placement; their GPT-3 175B run: t = 8, p = 8 on 1024
A100s, batch 1536, table 1); [4] Patarasuk & Yuan 2009 (ring collectives). Seed 000: TP > DP > PP in
volume, so TP stays inside a node and PP crosses nodes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from parlab.cluster import expert_costs as X, transformer as T
from parlab.cluster.costs import (BYTES_16BIT, CLUSTERS, PRESETS, Cluster, ModelSpec, from_gpt_config, model_preset,
                                  preset)
from parlab.cluster.plan_report import DIMS, GB, explain, format_table, format_volume_table
from parlab.i18n import _
from parlab.parallel.zero import model_state_bytes
from parlab.parallel.pipeline import bubble_formula, split_layers
from parlab.parallel.topology import ParallelGrid
from parlab.trace.wire import wire_bytes

__all__ = ["Estimate", "estimate", "enumerate_layouts", "plan", "explain", "format_table", "volume_table",
           "format_volume_table", "tiny_state_bytes", "cluster_for", "ModelSpec", "Cluster", "PRESETS", "CLUSTERS",
           "model_preset", "preset"]        # preset: model_preset's old name, for saved notebooks

SIMULATED = 50      # enumerate_layouts: how many of the fastest fitting pipelined layouts it times by simulation


@dataclass(frozen=True)
class Estimate:
    """One layout and everything the planner estimated for it (bytes per GPU, seconds per step)."""

    tp: int
    pp: int
    dp: int
    cp: int
    micro_batch: int          # b sequences per micro-batch
    micro_batches: int        # m per step on each pipeline
    zero: int                 # ZeRO stage 0-3
    recompute: bool           # full activation recomputation
    # memory of the fullest GPU
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    buffer_bytes: float       # ZeRO-3 gathered layers
    total_bytes: float
    # time of one step
    compute_s: float
    bubble_s: float
    tp_s: float
    cp_s: float
    dp_s: float               # exposed part
    dp_total_s: float         # before overlap
    pp_s: float
    step_s: float
    volume: dict              # bytes each GPU sends per step, per dimension
    crosses: dict             # per dimension: whether its groups cross nodes
    fits: bool
    reason: str               # why it does not fit ("" when it does)
    tokens_per_s: float
    achieved_tflops: float    # model FLOPs ([2] eq. 7) per GPU per second, in TFLOP/s: MFU x peak
    selective: bool = False   # selective recomputation (the attention scores; [2] section 5)
    sequence_parallel: bool = True
    virtual: int = 1          # model chunks per pipeline rank (interleaved 1F1B [3] section 2.2.2; 1: plain 1F1B)
    schedule: str = "1f1b"    # the pipeline schedule: 1f1b (interleaved when virtual > 1), gpipe or zb-h1
    precision: str = "bf16"   # the number format of the products (the hardware's rate for it; memory unchanged)
    attention: str = "fused"  # the attention kernel (`transformer.ATTENTION`): "fused" stores no scores
    ep: int = 1               # expert parallelism (a mixture of experts; `expert_costs`), the experts' tp etp
    etp: int = 1
    ep_s: float = 0.0         # the all-to-alls (and etp gathers) of the MoE layers, exposed

    @property
    def layout(self) -> str:
        return (f"tp{self.tp} pp{self.pp} dp{self.dp} cp{self.cp} b{self.micro_batch} m{self.micro_batches}"
                f"{f' v{self.virtual}' if self.virtual > 1 else ''}{'' if self.schedule == '1f1b' else ' ' + self.schedule}"
                f" Z{self.zero}{' rc' if self.recompute else ''}{' sel' if self.selective else ''}"
                f"{'' if self.sequence_parallel or self.tp == 1 else ' no-sp'}"
                f"{'' if self.precision == 'bf16' else ' ' + self.precision}{' materialised' * (self.attention != 'fused')}"
                f"{f' ep{self.ep}' if self.ep > 1 else ''}{f' etp{self.etp}' if self.etp != self.tp else ''}")

    @property
    def recomputation(self) -> str:
        """"none", "selective" or "full" (`parlab.cluster.transformer.RECOMPUTE`)."""
        return "full" if self.recompute else "selective" if self.selective else "none"


@functools.lru_cache(maxsize=4096)
def crossing(world: int, tp: int, pp: int, cp: int, gpus_per_node: int) -> dict[str, bool]:
    """Does any group of each dimension span several nodes (Megatron order, `ParallelGrid`)?"""
    grid = ParallelGrid(world, tp=tp, pp=pp, cp=cp, gpus_per_node=gpus_per_node)
    # ranks fill nodes in order, so an ascending group crosses iff its first and last ranks do
    # DP gradients are reduced over the dp x cp ranks holding the same weights (Megatron's dp-cp group)
    group = {"tp": "tp", "cp": "cp", "dp": "cp-dp", "pp": "pp"}
    return {d: any(g[0] // gpus_per_node != g[-1] // gpus_per_node for g in grid.groups(group[d])) for d in DIMS}


def estimate(model: ModelSpec, cluster: Cluster, global_batch: int, *, tp: int = 1, pp: int = 1, cp: int = 1,
             micro_batch: int = 1, zero: int = 0, recompute: bool | str = False,
             sequence_parallel: bool = True, virtual: int = 1, hardware=None, tp_overlap: bool = False,
             dp_overlap: bool = False, schedule: str = "1f1b", precision: str = "bf16",
             attention: str = "fused", ep: int = 1, etp: int | None = None, simulate: bool = True) -> Estimate:
    """Memory and step time of one layout (see the module docstring for every formula). `recompute`: False or
    "none", "selective", True or "full"; `sequence_parallel`: Megatron's SP with tensor parallelism [2];
    `virtual`: chunks per pipeline rank of the interleaved schedule [3] (1: plain 1F1B). `hardware`: a
    `parlab.cluster.hardware.Hardware` (e.g. hardware_preset("dgx-a100")); given, the time is the closed form of the
    replay's own cost model (`step_costs.StepCosts.step_terms`: GEMMs by shape at the kernel-level efficiency,
    memory-bound ops, exposed TP communication, the slowest rank, fill and drain), not `cluster.mfu`; with it,
    `tp_overlap` and `dp_overlap` are those of `step_costs.Layout`. `schedule`: "1f1b" (interleaved with
    `virtual` > 1), "gpipe" (every micro-batch's activations held until the backwards: m in flight, the same
    bubble) or "zb-h1" (Qi et al.: 1F1B's memory, the bubble (pp - 1)(F + B_input - W)). `precision`: the number
    format the products run in ("bf16", or "fp8" where the hardware lists its rate), as `step_costs.Layout`'s; an
    option of the replay's cost model, so it needs `hardware` too. The memory counted is the same (bf16 weights and
    activations, fp32 Adam states) in either. `attention`: the attention kernel, "fused" (default: FlashAttention,
    Dao et al. 2022, arXiv:2205.14135, Megatron-Core's and PyTorch SDPA's kernel since: no a s^2 scores kept) or
    "materialised" (the scores written out, as Megatron's runs of 2021-22 and [2] did); timed as `step_costs` says.
    `ep`, `etp`: a mixture of experts' expert parallelism and the experts' tensor parallelism (default tp), folded
    onto each stage's tp x cp x dp ranks (`parlab.cluster.expert_costs`): E / ep experts per rank, their states
    sharded over their edp replicas, the all-to-alls timed ("ep_s"). `simulate` (with `hardware` and pp > 1): the
    bubble from running the schedule with those costs as the replay does (`parlab.cluster.pipeline_time`), so
    the step is the replay's; False: the closed form's fill and drain (what `enumerate_layouts` ranks by)."""
    for name, v in (("tp", tp), ("pp", pp), ("cp", cp), ("micro_batch", micro_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(_("{name} must be a positive integer, got {value!r}").format(name=name, value=v))
    if type(zero) is not int or zero not in (0, 1, 2, 3):
        raise ValueError(_("zero is a ZeRO stage 0, 1, 2 or 3, got {value!r}").format(value=zero))
    if model.heads % tp or model.kv_heads % tp:
        raise ValueError(_("tp={tp} must divide {model}'s {heads} heads and {kv} key/value heads (each "
                           "tensor-parallel rank computes whole heads)").format(tp=tp, model=model.name,
                                                                               heads=model.heads, kv=model.kv_heads))
    if model.seq % cp:
        raise ValueError(_("cp={cp} must divide the sequence of {seq} tokens").format(cp=cp, seq=model.seq))
    if hardware is None and (tp_overlap or dp_overlap or precision != "bf16"):
        raise ValueError(_("tp_overlap, dp_overlap and precision are options of the replay's cost model: give "
                           "hardware= too (e.g. parlab.cluster.hardware.hardware_preset('dgx-h100'))"))
    rc = T.recompute_mode(recompute)
    T.check_attention(attention)
    world = cluster.world
    dp, rest = divmod(world, tp * pp * cp)
    if rest:
        raise ValueError(_("tp*pp*cp = {n} does not divide the {world} GPUs").format(n=tp * pp * cp, world=world))
    etp = X.check_experts(model, tp, cp, dp, ep, etp, sequence_parallel)
    m, rest = divmod(global_batch, dp * micro_batch)
    if rest or m < 1:
        raise ValueError(_("global batch {batch} is not divisible by dp * micro_batch = {n}").format(
            batch=global_batch, n=dp * micro_batch))
    if schedule not in ("1f1b", "gpipe", "zb-h1"):
        raise ValueError(_("schedule must be '1f1b' (interleaved with virtual > 1), 'gpipe' or 'zb-h1', got "
                           "{schedule!r}").format(schedule=schedule))
    if schedule != "1f1b" and virtual != 1:
        raise ValueError(_("virtual={virtual} interleaves 1F1B; {schedule} runs one chunk per rank (virtual=1)").format(
            virtual=virtual, schedule=schedule))
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(_("virtual must be a positive integer (model chunks per pipeline rank), got "
                           "{virtual!r}").format(virtual=virtual))
    if virtual > 1 and (pp < 2 or m % pp or model.layers % (pp * virtual)):
        raise ValueError(_("the interleaved schedule needs pp >= 2, micro-batches divisible by pp and layers divisible "
                           "by pp * virtual: pp {pp}, {m} micro-batches, {layers} layers, virtual {virtual}").format(
            pp=pp, m=m, layers=model.layers, virtual=virtual))
    s, h, nd = model.seq, model.hidden, dp * cp
    cross = crossing(world, tp, pp, cp, cluster.gpus_per_node)
    # ---- memory of the first stage (the fullest: embedding + the most micro-batches in flight)
    psi_stage = model.stage_params(tp, pp)
    states = (X.stage_states(model, tp, pp, nd, zero, ep, etp) if model.experts
              else model_state_bytes(psi_stage, nd, zero))
    layers = max(len(r) for r in split_layers(model.layers, pp))   # the fullest stage's layers (L / pp if pp | L)
    # min(pp, m) micro-batches in flight, (1 + (pp - 1)/(pp v)) times more when interleaved ([2] eq. 6)
    act = T.first_stage_activation_bytes(model, micro_batch, tp, pp, virtual, m, sequence_parallel, rc, cp,
                                         stage_layers=layers, attention=attention)
    if schedule == "gpipe":            # all m micro-batches' activations live until the first backward
        act *= m / min(pp, m)
    if rc == "full":   # the layer being recomputed holds its full set for a moment
        act += T.activation_bytes_per_layer(model, micro_batch, tp, sequence_parallel, "none", cp, attention)
    local = sum(X.local_layer_params(model, tp, ep, etp)) if model.experts else model.layer_params(tp)
    buffers = 2 * BYTES_16BIT * local if zero == 3 else 0.0
    total = states["total"] + act + buffers
    fits = total <= cluster.mem_bytes
    reason = "" if fits else _("needs {total:.1f} GB > {usable:.1f} GB usable (states {states:.1f}, activations "
                               "{act:.1f})").format(total=total / GB, usable=cluster.mem_bytes / GB,
                                                    states=states["total"] / GB, act=act / GB)
    # ---- time
    tokens = global_batch * s
    flops = T.hardware_flops(model, global_batch, rc)          # what the GPUs execute, recomputation included
    compute = flops / (world * cluster.peak_tflops * 1e12 * cluster.mfu)
    f = bubble_formula("interleaved" if schedule == "1f1b" else schedule, pp, m, virtual)   # v = 1: 1F1B's
    bubble = f / (1 - f) * compute                    # (pp - 1) / (v m) relative to the ideal step
    act_msg = BYTES_16BIT * s * micro_batch * h / cp  # one micro-batch's activations of one layer, on a CP rank
    vol = {
        "tp": (6 if rc == "full" else 4) * layers * m * wire_bytes("all_reduce", act_msg, tp),
        "cp": (4 if rc == "full" else 3) * layers * m * (cp - 1) * 2 * act_msg / tp,
        "dp": {3: 3 * m, 2: m + 1}.get(zero, 2) * wire_bytes("all_gather", BYTES_16BIT * psi_stage, nd),
        "pp": 2 * m * virtual * act_msg / tp if pp > 1 else 0.0,     # v times the messages when interleaved
    }
    t = {d: vol[d] / cluster.bandwidth(cross[d]) for d in DIMS}
    # what the DP traffic can hide behind: ZeRO-3 the whole compute (prefetch), ZeRO-2 every backward
    # (a reduce-scatter per micro-batch), ZeRO 0/1 only the backward of the last micro-batch
    window = {3: compute, 2: compute * 2 / 3}.get(zero, compute * 2 / 3 / m)
    dp_exposed = max(0.0, t["dp"] - window)
    t["ep"], vol["ep"] = X.ep_seconds(model, cluster, tp, pp, cp, ep, etp, micro_batch, m, rc)
    if hardware is not None:           # the replay's cost model in closed form (step_costs.StepCosts.step_terms)
        compute, bubble, t["tp"], t["cp"], t["pp"], dp_exposed, t["dp"], t["ep"] = _closed_form(
            model, hardware, tp, pp, dp, cp, micro_batch, m, zero, rc, sequence_parallel, virtual, tp_overlap,
            dp_overlap, schedule, precision, attention, ep, etp, simulate)
    step = compute + bubble + t["tp"] + t["cp"] + dp_exposed + t["pp"] + t["ep"]
    return Estimate(tp, pp, dp, cp, micro_batch, m, zero, rc == "full", states["params"], states["grads"],
                    states["optimizer"], act, buffers, total, compute, bubble, t["tp"], t["cp"], dp_exposed,
                    t["dp"], t["pp"], step, vol, cross, fits, reason, tokens / step,
                    T.model_flops(model, global_batch) / step / world / 1e12, rc == "selective", sequence_parallel,
                    virtual, schedule, precision, attention, ep, etp, t["ep"])


def cluster_for(hardware, gpus: int, gpu_mem_gb: float = 80.0) -> Cluster:
    """The `Cluster` of `gpus` GPUs described by `hardware`: its GPUs per node (fewer when all fit in one),
    link bandwidths, peak and end-to-end MFU; for `estimate(..., hardware=hardware)` on that machine."""
    per_node = min(hardware.gpus_per_node, gpus)
    return Cluster(nodes=max(1, gpus // per_node), gpus_per_node=per_node, gpu_mem_gb=gpu_mem_gb,
                   intra_gbps=hardware.intra_bw / 1e9, inter_gbps=hardware.inter_bw / 1e9,
                   peak_tflops=hardware.peak_flops / 1e12, mfu=hardware.end_to_end_mfu)


def _closed_form(model, hardware, tp, pp, dp, cp, b, m, zero, rc, sp, virtual, tp_overlap, dp_overlap,
                 schedule, precision, attention, ep=1, etp=None, simulate=True) -> tuple:
    """(compute incl. Adam, bubble, tp, cp, pp, dp exposed, dp total, ep) from `StepCosts.step_terms`, ZeRO stage
    included (its per micro-batch traffic beside the compute it overlaps)."""
    from parlab.cluster.step_costs import Layout, StepCosts
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, micro_batch=b, recompute=rc, sequence_parallel=sp and tp > 1,
                    virtual=virtual, zero=zero, tp_overlap=tp_overlap, dp_overlap=dp_overlap, precision=precision,
                    attention=attention, ep=ep, etp=etp)
    terms = StepCosts(model, hardware, layout, pp * virtual).step_terms(m, schedule, simulate)
    return (terms["compute"] + terms["optimizer"], terms["bubble"], terms["tp"], terms["cp"], terms["pp"], terms["dp"],
            terms["dp_traffic"], terms["ep"])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model: ModelSpec, cluster: Cluster, global_batch: int, *, micro_batches=(1, 2, 4, 8),
                      zero_stages=(0, 1, 2, 3), recompute=(False, True), cp_max: int = 8,
                      min_cp_chunk: int = 4096, sequence_parallel: bool = True, hardware=None,
                      virtual=(1,), precision: str = "bf16", attention: str = "fused",
                      ep=(1,)) -> list[Estimate]:
    """Every valid layout with its estimate, fitting or not (see `plan` for the ranked fitting ones).
    `recompute`: the recomputation settings tried (False / "none", "selective", True / "full"); `hardware`:
    time every layout with the replay's cost model in closed form (`estimate`); `virtual`: the interleaving chunks
    per pipeline rank tried (v > 1 where the interleaved schedule applies: pp >= 2, pp dividing the micro-batches
    and pp x v the layers); `precision`: the number format of every layout's products (needs `hardware`);
    `attention`: the attention kernel of every layout ("fused", the default, or "materialised"); `ep`: the
    expert-parallel sizes tried for a mixture of experts (those that fold onto a layout's tp x cp x dp ranks; etp tp).
    With `hardware`, every layout is timed by the closed form and the `SIMULATED` fastest fitting ones with pp > 1
    again by simulating their schedule (`estimate(..., simulate=True)`); layouts without a pipeline are exact
    either way, the others beyond those keep the closed form's bubble.

    Context parallelism (cp > 1) is tried only while each rank keeps at least `min_cp_chunk` tokens of
    the sequence: the cost model charges CP for its K/V ring (less traffic than TP's all-reduces) but
    not for the smaller matrix multiplications and attention blocks it leaves each GPU, so it would
    overrate CP on short sequences (Megatron-Core recommends CP for long contexts). Pass 1 to try all."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(_("global batch must be a positive number of sequences, got {batch!r}").format(
            batch=global_batch))
    virtual = (virtual,) if isinstance(virtual, int) and not isinstance(virtual, bool) else tuple(virtual)
    if not virtual or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in virtual):
        raise ValueError(_("virtual lists the interleaving chunks to try, positive integers such as (1, 2, 4); "
                           "got {virtual!r}").format(virtual=virtual))
    eps = tuple(dict.fromkeys((ep,) if isinstance(ep, int) and not isinstance(ep, bool) else ep))
    for e in eps:
        X.check_experts(model, 1, 1, e, e)                   # ep a positive integer dividing the experts, or 1
    if attention == "fused":     # FlashAttention keeps no scores: selective recomputation has nothing to redo
        recompute = tuple(dict.fromkeys({"selective": "none"}.get(m, m) for m in map(T.recompute_mode, recompute)))
    world = cluster.world
    out, kw = [], []
    common = dict(sequence_parallel=sequence_parallel, hardware=hardware, precision=precision, attention=attention)
    for tp in _divisors(world):
        if model.heads % tp or model.kv_heads % tp or (model.experts and tp > 1 and not sequence_parallel):
            continue
        for pp in _divisors(world // tp):
            if model.layers % pp:
                continue
            for cp in _divisors(world // (tp * pp)):
                if cp > 1 and (cp > cp_max or model.seq % cp or model.seq // cp < min_cp_chunk):
                    continue
                dp = world // (tp * pp * cp)
                for b in micro_batches:
                    if global_batch % (dp * b):
                        continue
                    m = global_batch // (dp * b)
                    chunks = [v for v in virtual if v == 1 or (pp > 1 and m % pp == 0 and model.layers % (pp * v) == 0)]
                    for z in (z for z in zero_stages if z == 0 or dp * cp > 1):   # ZeRO needs dp*cp > 1
                        for rc in recompute:
                            for v, e in ((v, e) for v in chunks for e in eps if (tp * cp * dp) % (tp * e) == 0):
                                kw.append(dict(tp=tp, pp=pp, cp=cp, micro_batch=b, zero=z, recompute=rc,
                                               virtual=v, ep=e))
                                out.append(estimate(model, cluster, global_batch, **kw[-1], simulate=False,
                                                    **common))
    if not out:
        raise ValueError(_(
            "no valid layout for {model} on {world} GPUs with global batch {batch}: the batch must be a multiple of "
            "dp * micro_batch, tp must divide the {heads} heads and pp the {layers} layers; try a global batch that "
            "is a multiple of {world}, or another number of GPUs").format(
            model=model.name, world=world, batch=global_batch, heads=model.heads, layers=model.layers))
    # the SIMULATED fastest fitting pipelined layouts by the closed form, timed again by running their schedule
    best = sorted((i for i, e in enumerate(out) if e.fits and e.pp > 1 and hardware is not None),
                  key=lambda i: out[i].step_s)[:SIMULATED]
    for i in best:
        out[i] = estimate(model, cluster, global_batch, **kw[i], **common)
    return out


def plan(model: ModelSpec, cluster: Cluster, global_batch: int, every=None, **kw) -> list[Estimate]:
    """The layouts that fit, fastest first (ties: less memory). Raises if none fits, saying by how much. `every`:
    `enumerate_layouts` of the same arguments when the caller has it already (``parlab plan`` prints both)."""
    allk = enumerate_layouts(model, cluster, global_batch, **kw) if every is None else every
    ok = sorted((e for e in allk if e.fits), key=lambda e: (e.step_s, e.total_bytes))
    if not ok:
        best = min(allk, key=lambda e: e.total_bytes)
        raise ValueError(_("no layout of {model} ({params:.1f}B parameters) fits on {world} GPUs of {mem:g} GB: the "
                           "smallest, {layout}, {reason}; use more GPUs, GPUs with more memory, or a smaller "
                           "model").format(model=model.name, params=model.param_count() / 1e9, world=cluster.world,
                                           mem=cluster.gpu_mem_gb, layout=best.layout, reason=best.reason))
    return ok


def volume_table(model: ModelSpec, grid: ParallelGrid, global_batch: int, micro_batch: int = 1, zero: int = 0,
                 recompute: bool = False) -> list[dict]:
    """Bytes each GPU sends per step along each dimension of `grid` (TP > DP > PP for large models).

    Rows: {'dim', 'size', 'bytes', 'crosses_nodes', 'what'}; the formulas are those of `estimate`."""
    cluster = Cluster(nodes=grid.num_nodes, gpus_per_node=grid.gpus_per_node)
    e = estimate(model, cluster, global_batch, tp=grid.tp, pp=grid.pp, cp=grid.cp, micro_batch=micro_batch,
                 zero=zero, recompute=recompute)
    what = {"tp": _("4 all-reduces of activations per layer and micro-batch"),
            "cp": _("K/V blocks around the ring, per layer and micro-batch"),
            "dp": _("gradient all-reduce once per step") if zero < 3 else _("ZeRO-3 gathers + reduce-scatters"),
            "pp": _("activation + gradient per micro-batch at each stage boundary")}
    return [{"dim": d, "size": grid.sizes[d], "bytes": e.volume[d], "crosses_nodes": bool(e.crosses[d]),
             "what": what[d]} for d in sorted(DIMS, key=lambda d: -e.volume[d])]


def tiny_state_bytes(config, *, tp: int = 1, pp: int = 1, dp: int = 1, zero: int = 0, param_bytes: float = 4,
                     grad_bytes: float = 4, k: float = 8) -> dict[str, float]:
    """The planner's parameter / gradient / optimizer bytes on the fullest rank of the tiny parlab GPT
    (`GPTConfig`) for a layout; defaults are parlab's fp32 AdamW runs (4 + 4 + 8 bytes per parameter),
    so it can be compared with `parlab.parallel.zero.memory.measure` on real ranks (ratio = measured / planned)."""
    psi = from_gpt_config(config).stage_params(tp, pp)
    return model_state_bytes(psi, dp, zero, param_bytes=param_bytes, grad_bytes=grad_bytes, k=k)
