"""Hybrid (4D, and 5D with experts) parallelism: every strategy of the course composed on the tiny GPT for one
`ParallelGrid`.

A real large-model run uses all the techniques at once, each along its own dimension of the rank grid
(`parlab.parallel.topology`): with ``world = tp * cp * dp * pp`` ranks, a rank at coordinates (t, c, d, p)

    holds   pipeline stage p of the layers                 (PP: send activations to stage p + 1)
            1/tp of every weight matrix of those layers    (TP: all-reduce / gather inside its tp group)
            1/cp of every sequence's positions             (CP: ring or Ulysses attention in its cp group)
    sees    1/dp of the global batch                       (DP: average gradients over its dp-cp group)

Gradients are averaged over the *dp-cp* group (Megatron's "data-parallel group with context parallelism"):
cp ranks hold the same weights but different tokens, so for the weights they are data parallel too. The
one-process model's loss is the mean over the global batch's N non-ignored targets (-100 marks padding), which
the ranks may share unevenly; so each rank's loss is its share D * (its sum) / N, N counted over dp-cp (one
all-reduce of an integer per step), and the average of the D ranks' gradients is the one-process gradient.

`build_hybrid(model, groups, ...)` applies the strategies in one visible order, torchtitan's composition
contract: the pipeline first cuts the model into this rank's stage(s), then each technique applies itself to
that part, then data parallelism wraps the result. Each step is a function of its own, using only the group it
needs (groups are passed explicitly, from `parlab.parallel.groups.build_groups`):

    1. PP     `apply_pp`: keep this rank's stage(s) of the schedule over `groups.pp`
              (`parlab.parallel.pipeline.executor`). First, because `PipelineParallel` deep-copies its model
              and a communicator cannot be copied; sharding a stage is the same as cutting a sharded model
    2. TP/SP  `apply_tp`: shard the stage's layers over `groups.tp` (Megatron plan of
              `parlab.parallel.tensor.layers`); the last stage keeps its logits split over the vocabulary,
              (b, S, V/tp), and its loss is the vocab-parallel cross-entropy (three all-reduces of (b, S) numbers
              instead of gathering (b, S, V) logits)
    3. CP     `apply_cp`: attention of every kept layer over `groups.cp`; position embeddings at global positions
    4. EP     `apply_ep`: a model with MoE layers (``GPTConfig(experts=E)``) on a grid with ep > 1: each kept MoE
              layer's experts spread over `groups.ep` (`parlab.parallel.expert`); the auxiliary losses' gradient
              scaled by 1/(m tp) (m micro-batches', with SP the tp ranks', gradients are summed). With tp > 1,
              as Megatron-Core: SP, the MoE layer routes this rank's (b, S/(cp tp), H) tokens, its router's
              gradient summed over tp like the layer norms', the experts whole (etp = 1) or split over the
              tp group (etp = tp: rows gathered over it after dispatch). The one-process
              model that matches routes the same groups (`routing_groups`; `expert.routed_as_ranks`)
    5. DP     `make_optimizer`: plain DP averages the gradients over `groups.dp_cp` (one flat all-reduce, in
              `HybridGPT.forward_backward`); ZeRO-1/2 shards the optimizer over the same group
              (`parlab.parallel.zero.optimizer.ShardedOptimizer`: reduce-scatter, shard step, all-gather). The
              experts' gradients are averaged over `groups.edp` and divided by ep instead; with ZeRO they get
              their own sharded optimizer over `groups.edp`, whose reduce-scatter averages over the replicas,
              the 1/ep applied before it (1/(ep etp/tp) with SP: `parlab.parallel.expert.grads`)

`HybridGPT.train_step(x, y)` takes the global batch (B, S) (the same on every rank), keeps this rank's
rows (dp) and positions (cp), runs the chosen pipeline schedule over `schedule.microbatches` micro-batches,
reduces the gradients and steps the optimizer; it returns the global mean loss on every rank.

Supported: any tp x cp x dp x pp whose sizes the model allows, with these limits (a ValueError says which):
sequence parallelism needs seq_len / cp divisible by tp (with SP the pipeline's messages are (b, S/tp, H),
as in Megatron, a tp-th of the bytes); Ulysses needs (n_head / tp) % cp == 0; dropout 0; ep > 1 with
tp > 1 needs SP, and etp is 1 or tp.

References
    [1] D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
        Megatron-LM", SC 2021, arXiv:2104.04473 (PTD-P: tensor x pipeline x data, section 3).
    [2] Megatron-LM, megatron/core/parallel_state.py (group order tp-cp-dp-pp, the dp-cp group).
    [3] S. Rajbhandari et al., "ZeRO", SC 2020, arXiv:1910.02054 (optimizer-state sharding over dp).
    [4] H. Liu et al., "Ring Attention", arXiv:2310.01889; S. A. Jacobs et al., "DeepSpeed Ulysses",
        arXiv:2309.14509 (context parallelism).
"""
from __future__ import annotations

import functools
from collections import defaultdict

import torch

from parlab import comm
from parlab.models import GPT, moe_layers
from parlab.parallel.context import (check_seq_len, ring_attention, shard_positions, shard_sequence,
                                     ulysses_attention)
from parlab.parallel.expert import average_expert_gradients, expert_parallel, is_expert_param
from parlab.parallel.groups import ProcessGroups
from parlab.parallel.pipeline import (SCHEDULES, PipelineParallel, Schedule, add_back_grads,
                                      set_aside_grads)
from parlab.parallel.tensor import (check_divisible, dense_state_dict, gpt_plan, mark_sequence_parallel, parallelize,
                                    plan_matches, sync_sequence_parallel_grads, vocab_parallel_mean_loss)
from parlab.parallel.topology import ParallelGrid
from parlab.parallel.zero import ShardedOptimizer

__all__ = ["HybridGPT", "OptimizerSet", "build_hybrid", "apply_pp", "apply_tp", "apply_cp", "apply_ep",
           "make_optimizer", "make_schedule", "check_layout", "routing_groups", "group_dim", "traffic_by_dim",
           "SUPPORTED"]

SUPPORTED = ("any tp x cp x dp x pp the model's sizes allow; sequence_parallel needs seq_len / cp divisible by "
             "tp; cp attention 'ulysses' needs (n_head/tp) % cp == 0; ZeRO stage 0, 1 or 2; dropout 0")


# ---------------------------------------------------------------------- checks and the schedule
def make_schedule(name: str | Schedule, pp: int, microbatches: int, chunks: int = 1) -> Schedule:
    """A schedule by name ('gpipe', '1f1b', 'interleaved', 'zb-h1', 'naive') for pp ranks, or `name` itself."""
    if isinstance(name, Schedule):
        return name
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)} or pass a Schedule")
    if name == "interleaved":
        return SCHEDULES[name](pp, microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"chunks={chunks} needs the 'interleaved' schedule, not {name!r}")
    return SCHEDULES[name](pp, microbatches)


def check_layout(config, grid: ParallelGrid, schedule: Schedule, *, batch_size: int | None = None,
                 seq_len: int | None = None, sequence_parallel: bool = False, cp_attention: str = "ring",
                 cp_layout: str = "zigzag", zero_stage: int = 0) -> None:
    """Raise a ValueError naming the first thing the layout, model and batch disagree on."""
    tp, cp, dp, pp = grid.tp, grid.cp, grid.dp, grid.pp
    for what, value in (("n_head", config.n_head), ("vocab_size", config.vocab_size),
                        ("MLP hidden size", config.mlp_ratio * config.n_embd)):
        check_divisible(what, value, tp)
    if schedule.ranks != pp:
        raise ValueError(f"schedule {schedule.name!r} is for {schedule.ranks} pipeline ranks but the grid has pp={pp}")
    if config.n_layer < schedule.stages:
        raise ValueError(f"n_layer {config.n_layer} < {schedule.stages} pipeline stages (pp x chunks); "
                         f"use a model with n_layer >= {schedule.stages} or a smaller pp")
    if sequence_parallel and seq_len is not None and (seq_len // cp) % tp:
        raise ValueError(f"sequence parallelism splits each rank's {seq_len // cp} positions (seq_len / cp) over "
                         f"tp={tp} ranks; use a seq_len that is a multiple of cp * tp = {cp * tp}")
    if cp_attention not in ("ring", "ulysses"):
        raise ValueError(f"cp_attention must be 'ring' or 'ulysses', got {cp_attention!r}")
    if cp_attention == "ulysses" and (config.n_head // tp) % cp:
        raise ValueError(f"Ulysses splits the {config.n_head // tp} heads per tp rank over cp={cp} ranks; "
                         f"choose cp dividing n_head/tp, or cp_attention='ring'")
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"zero_stage must be 0 (plain DP), 1 or 2 (parlab.parallel.zero.optimizer); got {zero_stage!r}. ZeRO-3 "
                         f"(parlab.parallel.zero.fsdp) is not composed with TP/PP here: under PP it would all-gather each stage's "
                         f"weights again for every micro-batch (DeepSpeed's pipeline engine, too, allows ZeRO-1 "
                         f"only). For ZeRO-3 use parlab.parallel.zero.fsdp.FullyShardedDataParallel on its own (pure DP)")
    if config.dropout:
        raise ValueError("the hybrid model needs dropout=0 (ranks would draw different masks)")
    if grid.ep > 1:
        if not config.experts or config.experts % grid.ep:
            raise ValueError(f"ep={grid.ep} spreads the experts of the MoE layers over ep ranks: give the model "
                             f"GPTConfig(experts=E) with E a multiple of {grid.ep} (it has experts={config.experts})")
        if grid.tp > 1 and not sequence_parallel:
            raise ValueError(f"expert parallelism with tensor parallelism (tp={grid.tp}) needs sequence parallelism, "
                             f"as in Megatron-Core: each tp rank routes its own S/tp tokens; pass "
                             f"sequence_parallel=True (lab: --sp)")
        if grid.etp > 1 and grid.expert.groups("etp") != grid.groups("tp"):
            raise ValueError(f"expert tensor parallelism composes here with etp=1 (experts whole) or etp=tp on the tp "
                             f"ranks (the default order); got etp={grid.etp}, tp={grid.tp}, order {grid.order}")
    if batch_size is not None and batch_size % (dp * schedule.microbatches):
        raise ValueError(f"global batch {batch_size} must split into dp={dp} replicas x "
                         f"{schedule.microbatches} micro-batches; use a multiple of {dp * schedule.microbatches}")
    if seq_len is not None and cp > 1:
        check_seq_len(seq_len, cp, cp_layout)


# ---------------------------------------------------------------------- the composed model
class HybridGPT:
    """This rank's part of the tiny GPT on a 4D grid, with its optimizer. Build it with `build_hybrid`."""

    def __init__(self, pipeline: PipelineParallel, groups: ProcessGroups, optimizer: torch.optim.Optimizer,
                 sequence_parallel: bool, cp_layout: str, zero_stage: int):
        self.pipeline, self.groups, self.grid = pipeline, groups, groups.grid
        self.module = pipeline.module                         # the stage(s) kept here, TP-sharded
        self.optimizer, self.sequence_parallel = optimizer, sequence_parallel
        self.cp_layout, self.zero_stage = cp_layout, zero_stage
        self.schedule = pipeline.schedule
        self.is_last_stage = self.schedule.stages - 1 in pipeline.my_stages
        self.last_stage_rank = groups.ranks("pp")[self.schedule.placement[-1]]  # global rank

    def parameters(self):
        return self.module.parameters()

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global (B, S) -> this rank's (B/dp, S/cp): its dp replica's rows and its cp positions."""
        c = self.groups.coords
        x, y = x.chunk(self.grid.dp, 0)[c["dp"]], y.chunk(self.grid.dp, 0)[c["dp"]]   # (B/dp, S)
        if self.grid.cp > 1:
            x = shard_sequence(x, self.grid.cp, c["cp"], self.cp_layout, dim=1)         # (B/dp, S/cp)
            y = shard_sequence(y, self.grid.cp, c["cp"], self.cp_layout, dim=1)
        return x, y

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the global batch (B, S); returns the global mean loss on every rank."""
        self.optimizer.zero_grad(set_to_none=True)            # (here, so the last gradients can be inspected)
        loss = self.forward_backward(x, y)
        self.optimizer.step()                                 # ZeRO: reduce-scatter + shard step + all-gather
        return loss

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the global batch (B, S), gradients synchronised over tp and dp-cp (ZeRO:
        at the optimizer's step) and added to `.grad`: k calls without zeroing accumulate the gradient of the
        k batches' losses, as k backward calls of the one-process model do. Returns the global mean loss."""
        g = self.groups
        x, y = self.local_batch(x, y)
        earlier = set_aside_grads(self.module.parameters())  # the syncs below act on this call's grads only
        loss = self.pipeline.step(x, y)                       # schedule: F/B over micro-batches, PP p2p
        if self.sequence_parallel:                            # partial grads of params used on S/tp tokens
            sync_sequence_parallel_grads(self.module, g.tp)
        ep = self.grid.ep > 1                                 # experts: their own average (step 5)
        tokens_tp = self.grid.tp if self.sequence_parallel else 1   # the tp ranks' tokens: one loss
        dense = [p for n, p in self.module.named_parameters() if not (ep and is_expert_param(n))]
        if self.zero_stage == 0 and g.size("dp-cp") > 1:     # plain DP: one flat all-reduce
            comm.average_grads(dense, g.dp_cp, "pipeline dp grads")
        if ep:          # ZeRO: its expert optimizer averages over edp at the step; the 1/ep is here either way
            average_expert_gradients(self.module, g.ep, g.edp if g.size("edp") > 1 and not self.zero_stage else None,
                                     divide_by=self.grid.ep * self.grid.etp / tokens_tp)
        add_back_grads(earlier)
        return self._global_loss(loss)

    @torch.no_grad()
    def _global_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """Average the last stage's local losses over dp-cp, then hand the result to every pipeline stage."""
        g = self.groups
        out = loss.clone() if loss is not None else torch.zeros((), dtype=self.pipeline.dtype,
                                                                 device=self.pipeline.device)
        if self.is_last_stage and g.size("dp-cp") > 1:
            comm.all_reduce(out, op=comm.ReduceOp.AVG, group=g.dp_cp, label="loss average")
        if self.grid.pp > 1:
            comm.broadcast(out, src=self.last_stage_rank, group=g.pp, label="loss to all stages")
        return out

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense parameters of the stage(s) this rank holds (TP shards gathered over the tp group)."""
        return dense_state_dict(self.module, self.groups.tp)


def _stage_plan(module, sequence_parallel: bool) -> dict:
    """Megatron's GPT plan, restricted to the modules this stage holds (lm_head: vocabulary-split logits)."""
    plan = gpt_plan()
    names = [n for n, _ in module.named_modules()]
    return {p: s for p, s in plan.items() if any(plan_matches(p, n) for n in names)}


def _global_positions(P: int, rank: int, layout: str):
    """wpe pre-hook: the local arange(S/P) becomes this cp rank's global positions (GPT.embed is unchanged)."""
    def hook(_module, args):
        pos = args[0]                                         # (S/P,) = arange(S/P)
        return (shard_positions(pos.numel() * P, P, rank, layout).to(pos.device),) + tuple(args[1:])
    return hook


def build_hybrid(model: GPT, groups: ProcessGroups, *, schedule: str | Schedule = "1f1b",
                 microbatches: int | None = None, chunks: int = 1, sequence_parallel: bool = False,
                 cp_attention: str = "ring", cp_layout: str = "zigzag", zero_stage: int = 0,
                 copy: bool = True, device: torch.device | str | None = None,
                 optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW, **optimizer_kwargs) -> HybridGPT:
    """Compose TP/SP, PP, CP and DP/ZeRO on `model` (the same dense GPT on every rank) for `groups.grid`.

    groups        from `build_groups(grid)`; needs the tp, cp, pp and dp-cp groups
    schedule      pipeline schedule name ('1f1b', 'gpipe', 'interleaved' with `chunks`, 'zb-h1') or a Schedule
    microbatches  per step (default: pp); the per-replica batch B/dp must be a multiple of it
    zero_stage    0: average gradients with one all-reduce; 1 / 2: ZeRO over the dp-cp group
    copy          False: hand `model` over (`PipelineParallel(copy=False)`: no deep copy; `model` becomes this
                  rank's part). With `device`, build `model` on the CPU: only this rank's stage, TP-sharded,
                  moves to `device`, so the accelerator never holds the dense model. Or build it on the meta
                  device (``GPT(config, seed, device="meta")``): only the stage's TP shards are then drawn, on
                  `device`, with the dense model's values (`parlab.parallel.meta_init.materialize`), and the host never
                  holds the dense model either.
    optimizer_kwargs go to `optimizer_cls` (e.g. lr=1e-3)."""
    grid = groups.grid
    sch = make_schedule(schedule, grid.pp, microbatches or grid.pp, chunks)
    check_layout(model.config, grid, sch, sequence_parallel=sequence_parallel, cp_attention=cp_attention,
                 cp_layout=cp_layout, zero_stage=zero_stage)
    pipe = apply_pp(model, sch, groups, sequence_parallel, copy)       # 1. this rank's stage(s)
    apply_tp(pipe, groups, sequence_parallel)                          # 2. its layers sharded over tp
    apply_cp(pipe.module, groups, cp_attention, cp_layout)             # 3. its attention over cp
    apply_ep(pipe.module, groups, sch.microbatches, sequence_parallel)  # 4. its experts over ep
    if device is not None:                                             # only the stage's shards reach the device
        pipe.to(device)
    opt = make_optimizer(pipe.module, groups, zero_stage, optimizer_cls, **optimizer_kwargs)   # 5. DP / ZeRO
    return HybridGPT(pipe, groups, opt, sequence_parallel, cp_layout, zero_stage)


def apply_pp(model: GPT, sch: Schedule, groups: ProcessGroups, sequence_parallel: bool,
             copy: bool) -> PipelineParallel:
    """Step 1: this rank's stage(s) of `model` under `sch` over `groups.pp`. The loss is the mean over the
    non-ignored targets of all dp-cp ranks (their gradients are averaged); with SP the stages exchange hidden
    states split along the sequence over tp: (b, S/tp, H)."""
    dp_cp = groups.dp_cp if groups.size("dp-cp") > 1 else None
    return PipelineParallel(model, sch, group=groups.pp, loss_group=dp_cp,
                            sequence_split=groups.grid.tp if sequence_parallel else 1, copy=copy)


def apply_tp(pipe: PipelineParallel, groups: ProcessGroups, sequence_parallel: bool) -> None:
    """Step 2: every layer of the stage sharded over `groups.tp` (nothing with tp = 1)."""
    stage = pipe.module
    if groups.grid.tp == 1:
        return
    parallelize(stage, _stage_plan(stage, sequence_parallel), groups.tp, sequence_parallel)
    if stage.lm_head is not None:                                      # the last stage: loss on (b, S, V/tp) logits
        stage.loss = functools.partial(vocab_parallel_mean_loss, group=groups.tp)


def apply_cp(stage: GPT, groups: ProcessGroups, cp_attention: str, cp_layout: str) -> None:
    """Step 3: attention over `groups.cp`, position embeddings at this rank's global positions (nothing with
    cp = 1)."""
    cp = groups.grid.cp
    if cp == 1:
        return
    attend = ring_attention if cp_attention == "ring" else ulysses_attention
    for block in stage.blocks:
        if block is not None:
            block.attn.core_attention = functools.partial(attend, group=groups.cp, causal=True, layout=cp_layout)
    if stage.wpe is not None:                                          # prepend: before the SP split of positions
        stage.wpe.register_forward_pre_hook(_global_positions(cp, groups.local_rank("cp"), cp_layout), prepend=True)


def apply_ep(stage: GPT, groups: ProcessGroups, microbatches: int, sequence_parallel: bool = False) -> None:
    """Step 4: the MoE layers' experts over `groups.ep`; every micro-batch's aux-loss gradient weighs 1/m, and
    1/tp with SP (the tp ranks route different tokens of one loss). With SP the router (and, with ep = 1, the
    experts, whole on every tp rank) runs on S/tp tokens: its gradient is summed over tp (step 2's sync)."""
    grid = groups.grid
    if grid.ep > 1:
        expert_parallel(stage, groups.ep, groups.tp if grid.etp > 1 else None)   # etp = tp: the tp group
    sp = sequence_parallel and grid.tp > 1
    for moe in moe_layers(stage):
        moe.aux_grad_scale = 1.0 / (microbatches * (grid.tp if sp else 1))
        for name, p in moe.named_parameters() if sp else ():
            if grid.ep == 1 or not is_expert_param(name):              # ep > 1: experts averaged over edp
                mark_sequence_parallel(p)


def routing_groups(grid: ParallelGrid, seq_len: int, microbatches: int, cp_layout: str = "zigzag",
                   sequence_parallel: bool = False) -> tuple[int, list[torch.Tensor]]:
    """How the ranks of this layout route a global batch, for the one-process model that matches it
    (``routed_as_ranks(model, *routing_groups(...))``): (groups, positions), dp x m row blocks (each replica's
    micro-batches) times the sequence shards: each cp rank's positions (`cp_layout`), cut in tp chunks with SP."""
    tp = grid.tp if sequence_parallel else 1
    per_cp = [shard_positions(seq_len, grid.cp, c, cp_layout) for c in range(grid.cp)] if grid.cp > 1 else \
        [torch.arange(seq_len)]
    positions = [q for pos in per_cp for q in pos.chunk(tp)]                           # (S/(cp tp),) each
    return grid.dp * microbatches * len(positions), positions


def make_optimizer(stage: GPT, groups: ProcessGroups, zero_stage: int,
                   optimizer_cls: type[torch.optim.Optimizer], **optimizer_kwargs):
    """Step 5: the optimizer over this rank's (sharded) parameters: plain, or ZeRO-1/2 over dp-cp for the dense
    weights and over edp for the experts (a plain optimizer where an expert has no replica, edp = 1). overlap
    is off: reduce once at the step, not once per micro-batch backward (the pipeline runs several)."""
    params = list(stage.parameters())
    if not zero_stage:
        return optimizer_cls(params, **optimizer_kwargs)
    experts = [q for n, q in stage.named_parameters() if groups.grid.ep > 1 and is_expert_param(n)]
    dense = [q for q in params if id(q) not in {id(e) for e in experts}]
    opts = [ShardedOptimizer(dense, optimizer_cls, stage=zero_stage, group=groups.dp_cp, overlap=False,
                             **optimizer_kwargs)]
    if experts:
        opts.append(ShardedOptimizer(experts, optimizer_cls, stage=zero_stage, group=groups.edp, overlap=False,
                                     **optimizer_kwargs) if groups.size("edp") > 1 else
                    optimizer_cls(experts, **optimizer_kwargs))
    return OptimizerSet(opts)


class OptimizerSet:
    """Several optimizers stepped as one (ZeRO over dp-cp for the dense weights, over edp for the experts):
    `step`, `zero_grad` and `state` (every parameter's, for `parlab.parallel.zero.memory.measure`)."""

    def __init__(self, optimizers: list):
        self.optimizers = list(optimizers)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def state(self) -> dict:
        return {k: v for opt in self.optimizers for k, v in opt.state.items()}

    @property
    def param_groups(self) -> list:
        return [g for opt in self.optimizers for g in opt.param_groups]


# ---------------------------------------------------------------------- which group did each message use
def group_dim(grid: ParallelGrid, event) -> str:
    """The grid dimension whose group (of the event's rank) carried `event`: 'tp', 'cp', 'pp', 'dp', 'dp-cp',
    the expert grid's 'ep' or 'edp', or '?' for another group. Dimensions of size 1 never match (their groups
    hold one rank). An all-to-all is the experts' even where the ep group is also a dense one (ep over dp)."""
    dense = [(grid, d) for d in ("tp", "cp", "pp", "dp", "dp-cp", "tp-pp")]
    experts = [(grid.expert, d) for d in ("ep", "edp")] if grid.ep > 1 else []
    order = experts + dense if event.op == "all_to_all" else dense + experts
    members = sorted(event.group)
    for g, dims in order:
        group = g.group_of(event.rank, dims)
        if len(group) > 1 and sorted(group) == members:
            return dims
    return "?"


def traffic_by_dim(trace, grid: ParallelGrid) -> dict[str, dict[str, float]]:
    """Per grid dimension: number of messages and payload bytes sent, summed over ranks."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"messages": 0, "bytes": 0.0})
    for e in trace.comm().events:
        if e.op in ("recv", "irecv"):
            continue
        row = out[group_dim(grid, e)]
        row["messages"] += 1
        row["bytes"] += e.nbytes
    return dict(out)
