"""What each step of a big model's pipeline program costs on a layout: the one cost model the replay re-times with.

`parlab.cluster.scaleup` replays a pipeline program (traced from a tiny run, or built from its schedule by
`parlab.cluster.pipeline_program`) as a named model; `StepCosts` says how long every step of it takes. A
`Layout` is how the model is laid out (tp x cp x dp x pp GPUs, virtual stages, micro-batch, recomputation,
sequence parallelism, distributed optimizer, overlap, number format).

Compute of one action (forward, backward, B_input, B_weight of a virtual stage holding n layers):

    matrix products   every GEMM of the layer (`transformer.layer_gemms`: QKV, scores, values, projection, MLP)
                      timed by its shape on the hardware (`Hardware.gemm_time`: tiles in waves over the SMs at
                      the kernel-level efficiency); the backward runs each product's input- and weight-gradient
                      GEMMs (`transformer.backward_gemms`); the last stage adds the logits
    memory-bound ops  their bytes at the memory bandwidth x mem_efficiency (below)
    recomputation     full: the forward again before the backward (products, bytes and its TP communication);
                      selective: the attention scores, their softmax and dropout (Korthikanti et al. 2022)
    TP communication  per layer and forward: 2 all-reduces of the (b, s/cp, h) 16-bit activations over tp, or
                      with sequence parallelism 2 all-gathers + 2 reduce-scatters of the same tensor (the same
                      bytes, twice the calls); the backward the same again, and with sequence parallelism the 2
                      all-gathers of the layer's inputs once more (Megatron keeps the input's sequence shard and
                      gathers it again for the weight gradient). Serial with the compute (Megatron without
                      overlap); with `tp_overlap` the backward's communication hides behind the weight-gradient
                      GEMMs and only what exceeds them is exposed (Megatron-LM's asynchronous TP all-reduce and
                      all-gather in the linear layers' backward).
    CP communication  with cp > 1 (ring attention, lesson 06) each layer passes K and V around the cp ranks in
                      cp - 1 steps beside the attention of the block each rank holds; only the part of a step's
                      transfer longer than its block's compute is exposed (`cp_exposed`); the backward passes
                      K, V and their gradients

Memory-bound ops: their bytes per layer (`parlab.cluster.layer_costs.layer_forward_bytes`) at the memory's
bandwidth; the backward moves them again, and recomputation its recomputed part's once more.

Mixture of experts (`parlab.cluster.expert_costs.ExpertCosts`): each MoE layer adds to the dense layer above its
router, its experts' grouped products in place of the dense MLP's, their bytes, and in place of the MLP's TP
collectives expert parallelism's all-to-alls (dispatch and combine, forward and backward) over `Layout.ep` and the
experts' own TP (`Layout.etp`); the experts' gradients sync over their expert-data-parallel group (`sync_costs`).

Messages: a pipeline message is 2 b s h / (tp cp) bytes (Megatron's scatter/gather between stages, Narayanan et
al. 2021 section 4.1) on the link the pp group crosses; the tied-embedding gradient exchange 2 V h / tp bytes.

Data parallelism and the optimizer (the gradient sync of each ZeRO stage, ZeRO-2/3's traffic per micro-batch, the
Adam step): `parlab.cluster.sync_costs.SyncCosts` (`StepCosts.sync`); ZeRO-2/3's per micro-batch traffic runs
beside the action it belongs to and only what exceeds that action's compute is charged to it.

Attention kernel: `attention` "fused" (the default: FlashAttention, Dao et al. 2022, arXiv:2205.14135, and
cuDNN's fused attention, what Megatron-Core and PyTorch's scaled_dot_product_attention run since then) never
writes the scores: their bytes become Q, K, V read and O written (`attention_core_bytes`), the backward
recomputes Q K^T (FlashAttention-2 section 4.1: 5 products against the forward's 2), and selective recomputation
has nothing left to redo. "materialised" (Megatron's kernels of 2021-2022, which the table 5 runs used; every
reproduction of those papers names it) costs the scores as above.

Number format: `precision` "bf16" (the default: the hardware's peak_flops) or another the hardware lists
(`Hardware.at`) for the matrix products; activations and messages stay 16-bit. "fp8" is mixed as Transformer
Engine runs it: only the four weight GEMMs of a layer (QKV, projection, the MLP's two; forward, input and weight
gradients) at the fp8 rate, the attention products and the logits in bf16, plus the casts of their operands to
8 bits (`fp8_cast_bytes`); any other format runs every product.
Pure Python: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from parlab.cluster import transformer as T
from parlab.cluster.costs import BYTES_16BIT, ModelSpec
from parlab.cluster.hardware import Hardware
from parlab.cluster.closed_form import step_terms
from parlab.cluster.expert_costs import ExpertCosts, check_experts
from parlab.cluster.layer_costs import (WEIGHTS as _WEIGHTS, attention_core_bytes, fp8_cast_bytes,
                                        layer_forward_bytes, layer_forward_flops)
from parlab.cluster.sync_costs import SyncCosts
from parlab.parallel.pipeline.schedules import split_layers

__all__ = ["Layout", "StepCosts", "check_inputs", "layer_forward_flops", "layer_forward_bytes",
           "attention_core_bytes", "fp8_cast_bytes"]



@dataclass(frozen=True)
class Layout:
    """How the big model is laid out: tp x cp x dp x pp GPUs, `virtual` model chunks per pipeline rank
    (interleaved 1F1B), b sequences per micro-batch, recomputation, sequence parallelism, the ZeRO stage (1: the
    distributed optimizer), communication overlap, the number format of the products and the attention kernel:
    "fused" by default (FlashAttention, Dao et al. 2022, what runs use since), "materialised" for the papers of
    2021-2022, whose kernels wrote the scores out (module docstring)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    micro_batch: int = 1
    recompute: str = "none"          # "none" | "full" | "selective"
    sequence_parallel: bool = False
    virtual: int = 1                 # model chunks per pipeline rank (1: plain 1F1B / GPipe / ZB-H1)
    zero: int = 0                    # ZeRO stage over the dp x cp replicas (1: Megatron's distributed optimizer)
    tp_overlap: bool = False         # the backward's TP communication hidden behind weight-gradient GEMMs
    dp_overlap: bool = False         # the gradient sync beside the rank's last backward
    precision: str = "bf16"
    attention: str = "fused"         # the attention kernel: "fused" (FlashAttention, the default since 2022) or
    #                                  "materialised" scores (Megatron 2021-2022: what its papers' runs used)
    ep: int = 1                      # expert parallelism: the experts split over ep ranks (`expert_costs`)
    etp: int | None = None           # the experts' tensor parallelism (None: tp)

    def __post_init__(self):
        for k in ("tp", "pp", "dp", "cp", "micro_batch", "virtual", "ep") + (("etp",) if self.etp is not None else ()):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"layout {k} must be a positive integer, got {v!r}")
        if self.recompute not in T.RECOMPUTE:
            raise ValueError(f"recompute must be 'none', 'full' or 'selective', got {self.recompute!r}")
        if type(self.zero) is not int or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"layout zero is a ZeRO stage 0, 1, 2 or 3 (1: Megatron's distributed optimizer), "
                             f"got {self.zero!r}")
        for k in ("sequence_parallel", "tp_overlap", "dp_overlap"):
            if not isinstance(getattr(self, k), bool):
                raise ValueError(f"layout {k} must be True or False, got {getattr(self, k)!r}")
        if not isinstance(self.precision, str) or not self.precision:
            raise ValueError(f"precision names a number format such as 'bf16' or 'fp8', got {self.precision!r}")
        T.check_attention(self.attention)
        if self.virtual > 1 and self.pp < 2:
            raise ValueError(f"virtual={self.virtual} interleaves model chunks over pipeline ranks: it needs pp >= 2")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def check_inputs(model, hardware, layout) -> None:
    """What a big model's layout must satisfy before it can be costed: the right types, tp dividing the heads and
    the MLP width (Megatron splits both), cp dividing the sequence."""
    if not isinstance(model, ModelSpec):
        raise ValueError(f"model must be a parlab.cluster.costs.ModelSpec (e.g. parlab.cluster.costs.model_preset("
                         f"'gpt3-175b')), got {type(model).__name__}")
    if not isinstance(hardware, Hardware):
        raise ValueError(f"hardware must be a parlab.cluster.hardware.Hardware (e.g. "
                         f"parlab.cluster.hardware.hardware_preset('dgx-a100')), got {type(hardware).__name__}")
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a parlab.cluster.step_costs.Layout, got {type(layout).__name__}")
    check_experts(model, layout.tp, layout.cp, layout.dp, layout.ep, layout.etp, layout.sequence_parallel)
    if model.heads % layout.tp or model.ffn % layout.tp or model.kv_heads % layout.tp:
        raise ValueError(f"tp={layout.tp} must divide {model.name}'s {model.heads} heads, its {model.kv_heads} "
                         f"key/value heads and its MLP width {model.ffn} (tensor parallelism splits all three)")
    if model.seq % layout.cp:
        raise ValueError(f"cp={layout.cp} must divide the sequence of {model.seq} tokens")


class StepCosts:
    """Seconds of every step of `model`'s pipeline program, laid out as `layout` on `hardware`, with the layers
    split over `stages` virtual stages (`split_layers`): `action(op, stage)` for a forward / backward /
    backward_input / backward_weight, `message(tied)`, and per rank `grad_sync(stages)` and `optimizer(stages)`.
    memory_ops: cost the memory-bound ops' bytes; dropout: the model trains with dropout (None: `model.dropout`,
    True for Megatron's GPTs, False for LLaMA)."""

    def __init__(self, model: ModelSpec, hardware: Hardware, layout: Layout, stages: int, *,
                 memory_ops: bool = True, dropout: bool | None = None):
        check_inputs(model, hardware, layout)
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages is the number of virtual pipeline stages, a positive integer, got {stages!r}")
        if stages > model.layers:
            raise ValueError(f"the pipeline has {stages} stages but {model.name} has {model.layers} layers")
        if stages != layout.pp * layout.virtual:
            raise ValueError(f"{stages} virtual stages do not fit the layout: pp={layout.pp} x virtual="
                             f"{layout.virtual} = {layout.pp * layout.virtual}")
        dropout = model.dropout if dropout is None else dropout
        self.model, self.layout, self.stages = model, layout, stages
        self._actions, self._tp_seconds = {}, {}      # memos: seconds of an action by (op, stage), of a TP call by op
        # fp8 runs the weight GEMMs only (Transformer Engine, module docstring); another format runs every product
        fp8 = layout.precision == "fp8"
        self.hw = hardware if layout.precision in ("bf16", "fp8") else hardware.at(layout.precision)
        linear = hardware.at("fp8") if fp8 else self.hw
        self.layers = [len(r) for r in split_layers(model.layers, stages)]
        b, tp, cp, sp = layout.micro_batch, layout.tp, layout.cp, layout.sequence_parallel
        s, h = model.seq, model.hidden
        self.act_bytes = BYTES_16BIT * b * s * h / cp                 # one micro-batch's (b, s/cp, h) on a CP rank
        gemms = T.layer_gemms(model, b, tp, cp)
        def t(gs) -> float:                                                   # seconds of products
            return sum((linear if g[0].split()[0] in _WEIGHTS else self.hw).gemm_time(*g[1:]) for g in gs)
        self.t_fwd_gemm = t(gemms)
        bwd = T.backward_gemms(gemms)
        # the weight gradients of the four weight matrices; every other backward product (an attention
        # product's two) is an input gradient, on the path to the previous layer
        self.t_wgrad = t(g for g in bwd if g[0].endswith("wgrad") and g[0].split()[0] in _WEIGHTS)
        self.t_dgrad = t(bwd) - self.t_wgrad
        self.t_core = t(g for g in gemms if g[0] not in _WEIGHTS)          # the scores and values products
        fused = layout.attention == "fused"
        if fused:   # FlashAttention's backward recomputes the scores Q K^T: 5 products against the forward's 2
            self.t_dgrad += t(g for g in gemms if g[0] == "scores")
        head = T.head_gemms(model, b, tp, cp)
        self.t_head_fwd = t(head)
        self.t_head_wgrad = t(g for g in T.backward_gemms(head) if g[0].endswith("wgrad"))
        self.t_head_dgrad = t(T.backward_gemms(head)) - self.t_head_wgrad
        mem = self.hw.mem_bw * self.hw.mem_efficiency
        self.t_mem = layer_forward_bytes(model, b, tp, cp, sp, dropout, fused) / mem if memory_ops else 0.0
        self.t_cast = tuple(c / mem for c in fp8_cast_bytes(gemms)) if fp8 and memory_ops else (0.0, 0.0)
        self.t_mem_core = attention_core_bytes(model, b, tp, cp, dropout, fused) / mem if memory_ops else 0.0
        # the last stage: final norm (4E) and the logits' softmax, (b, s/cp, V/tp) read and written
        self.t_mem_head = (2 * BYTES_16BIT * b * s * h / (cp * (tp if sp else 1))
                           + 2 * BYTES_16BIT * b * s * model.vocab / (tp * cp)) / mem if memory_ops else 0.0
        self._placement(hardware)
        self.experts = ExpertCosts(self, t)                         # a mixture of experts' layers (expert_costs)
        self.sync = SyncCosts(model, self.hw, layout, self.layers, self.dp_nodes, self.experts)
        self._zero_parts: dict[tuple[str, int], float] = {}

    # ------------------------------------------------------------------ placement and links
    def _placement(self, hardware: Hardware) -> None:
        """Megatron's rank order on a tp x cp x dp x pp grid: how many nodes the tp and dp groups span, and
        whether the pp group crosses nodes."""
        from parlab.parallel.topology import ParallelGrid
        lay = self.layout
        grid = ParallelGrid(lay.gpus, tp=lay.tp, pp=lay.pp, cp=lay.cp, dp=lay.dp,
                            gpus_per_node=min(hardware.gpus_per_node, lay.gpus))
        nodes = lambda g: len({grid.node_of(r) for r in g})
        self.tp_nodes = nodes(grid.group_of(0, "tp"))
        self.cp_cross = nodes(grid.group_of(0, "cp")) > 1
        self.pp_cross = nodes(grid.group_of(0, "pp")) > 1
        self.dp_nodes = nodes(grid.group_of(0, "cp-dp"))

    def _tp(self, op: str) -> float:
        if self.layout.tp == 1:
            return 0.0
        if op not in self._tp_seconds:           # asked for by every layer of every action: ~150 times a layout
            self._tp_seconds[op] = self.hw.collective_time(op, self.act_bytes, self.layout.tp, self.tp_nodes > 1,
                                                           self.tp_nodes)
        return self._tp_seconds[op]

    def tp_forward(self) -> float:
        """Exposed TP communication of one layer's forward: 2 all-reduces, or 2 all-gathers + 2 reduce-scatters."""
        if self.layout.sequence_parallel:
            return 2 * (self._tp("all_gather") + self._tp("reduce_scatter"))
        return 2 * self._tp("all_reduce")

    def tp_backward(self) -> float:
        """TP communication of one layer's backward (before overlap): the forward's calls mirrored, plus with
        sequence parallelism the 2 all-gathers of the inputs again."""
        extra = 2 * self._tp("all_gather") if self.layout.sequence_parallel else 0.0
        return self.tp_forward() + extra

    # ------------------------------------------------------------------ actions
    def action(self, op: str, stage: int) -> float:
        """Seconds of one action (forward, backward, backward_input, backward_weight) of virtual stage `stage`
        for one micro-batch, its exposed TP communication included."""
        key = (op, stage)
        if key not in self._actions:                             # a program asks for each one m times
            self._actions[key] = self._action(op, stage)
        return self._actions[key]

    def _action(self, op: str, stage: int) -> float:
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < self.stages:
            raise ValueError(f"stage must be a virtual stage 0..{self.stages - 1}, got {stage!r}")
        n, last = self.layers[stage], stage == self.stages - 1
        rc = self.layout.recompute
        head_fwd = self.t_head_fwd + self.t_mem_head if last else 0.0
        cast_f, cast_b = self.t_cast
        ex = self.experts.compute
        fwd = (n * (self.t_fwd_gemm + self.t_mem + cast_f) + ex("forward", stage) + self.comm_part("forward", stage)
               + head_fwd)
        if op == "forward":
            return fwd + self._zero_exposed(op, stage, fwd)
        # selective recomputation redoes the materialised scores; a fused kernel stores none to redo (its own
        # recomputation is in its backward, t_dgrad)
        selective = 0.0 if self.layout.attention == "fused" else n * (self.t_core + self.t_mem_core)
        redo = {"none": 0.0, "full": n * (self.t_fwd_gemm + self.t_mem + cast_f) + ex("forward", stage),
                "selective": selective}[rc]
        t_in = (n * (self.t_dgrad + self.t_mem + cast_b) + self.comm_part("backward" if op == "backward" else "backward_input",
                                                                 stage)
                + (self.t_head_dgrad + self.t_mem_head if last else 0.0) + ex("dgrad", stage))
        t_w = n * self.t_wgrad + (self.t_head_wgrad if last else 0.0) + ex("wgrad", stage)
        if op == "backward":
            return redo + t_in + t_w + self._zero_exposed(op, stage, redo + t_in + t_w)
        if op == "backward_input":
            return redo + t_in + self._zero_exposed(op, stage, redo + t_in)
        if op == "backward_weight":
            return t_w + self._zero_exposed(op, stage, t_w)
        raise ValueError(f"no cost for pipeline action {op!r}; actions: forward, backward, backward_input, "
                         f"backward_weight")

    def comm_part(self, op: str, stage: int, dims=("tp", "cp", "ep")) -> float:
        """The exposed communication of `dims` inside `action(op, stage)`: per layer the TP collectives
        (`tp_forward`; the backward's after overlap) and the CP ring (`cp_exposed`); a full recomputation's
        forward pays its forward's again. A mixture of experts' layers change "tp" and add "ep" (`ExpertCosts.comm`)."""
        n = self.layers[stage]
        tp, cp = "tp" in dims, "cp" in dims
        fwd = (self.tp_forward() if tp else 0.0) + (self.cp_exposed("forward") if cp else 0.0)
        if op == "forward":
            return n * fwd + self.experts.comm(op, stage, dims)
        if op == "backward_weight":
            return 0.0
        comm = self.tp_backward()
        # overlap hides the TP traffic behind the weight-gradient GEMMs: not in B_input, which runs without them
        tp_bwd = max(0.0, comm - self.t_wgrad) if self.layout.tp_overlap and op == "backward" else comm
        bwd = (tp_bwd if tp else 0.0) + (self.cp_exposed("backward") if cp else 0.0)
        # full recomputation runs the forward again, its communication with it; selective recomputes the
        # attention core, which under context parallelism needs the K/V blocks around the ring once more
        again = cp and self.layout.attention != "fused"          # a fused kernel stores no scores to recompute
        redo = {"full": fwd, "selective": self.cp_exposed("forward") if again else 0.0}.get(self.layout.recompute, 0.0)
        return n * (bwd + redo) + self.experts.comm(op, stage, dims)

    def cp_exposed(self, op: str) -> float:
        """What the CP ring of one layer adds to its forward or backward (ring attention, lesson 06): cp - 1 steps,
        each passing this rank's K and V block (2 b (s/cp) h/tp 16-bit values each) to the next rank while the
        attention of the block it holds computes ((scores + values products and the softmax bytes) / cp); the
        backward passes K, V and their gradients, twice the bytes beside twice the compute. Only a transfer
        longer than its block's compute is exposed."""
        cp = self.layout.cp
        if cp == 1:
            return 0.0
        k = 1 if op == "forward" else 2
        block = BYTES_16BIT * self.layout.micro_batch * self.model.seq / cp * self.model.hidden / self.layout.tp
        msg = self.hw.collective_time("send", k * 2 * block, 2, self.cp_cross)
        compute = k * (self.t_core + self.t_mem_core) / cp
        return (cp - 1) * max(0.0, msg - compute)

    def step_terms(self, m: int, schedule: str = "1f1b", simulate: bool = False) -> dict[str, float]:
        """The step of `schedule` over m micro-batches in closed form (`parlab.cluster.closed_form.step_terms`;
        `simulate`: its bubble from running the schedule, `parlab.cluster.pipeline_time`)."""
        return step_terms(self, m, schedule, simulate)

    def message(self, tied: bool = False) -> float:
        """One pipeline message (2 b s h / (tp cp) bytes), or the tied-embedding gradient (2 V h / tp)."""
        tp = self.layout.tp
        nbytes = BYTES_16BIT * self.model.vocab * self.model.hidden / tp if tied else self.act_bytes / tp
        return self.hw.collective_time("send", nbytes, 2, self.pp_cross)

    # ------------------------------------------------------------------ per rank, once per step

    def zero_part(self, op: str, stage: int) -> float:
        """The exposed ZeRO-2/3 traffic inside `action(op, stage)` (for reporting it apart)."""
        self.action(op, stage)
        return self._zero_parts[(op, stage)]

    def _zero_exposed(self, op: str, stage: int, compute: float) -> float:
        """The exposed ZeRO-2/3 traffic of one micro-batch's action `op` on `stage`, run beside `compute`
        seconds of it: ZeRO-3 gathers the stage's weights before its forward and before its backward, ZeRO-2 and 3
        reduce-scatter its gradients after the backward; only what exceeds the compute is exposed."""
        t = self.sync.zero_traffic(op, stage)
        self._zero_parts[(op, stage)] = exposed = max(0.0, t - compute)
        return exposed

    def exposed_grad_sync(self, stages, last: str = "backward") -> float:
        """What the step waits for of the gradient sync: all of it, or with `dp_overlap` what exceeds the rank's
        last action, `last` of its first virtual stage (the last it runs: "backward", or ZB-H1's
        "backward_weight")."""
        t = self.sync.grad_sync(stages)
        if not self.layout.dp_overlap or not t:
            return t
        return max(0.0, t - self.action(last, min(stages)))
