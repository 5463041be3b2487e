"""Expert parallelism in the cost model: what a mixture-of-experts layer costs on a layout, and the rules its layout
must satisfy (`parlab.cluster.step_costs.StepCosts` adds it to the dense layer it times; `parlab.cluster.sync_costs`
syncs the experts' gradients; the planner's memory reads `stage_states`).

The expert grid (MoE parallel folding [3]): the dense layers run on tp x cp x dp x pp GPUs, the expert layers on the
same GPUs as etp x ep x edp x pp: each pipeline stage's tp x cp x dp ranks are re-read as etp (the experts' own
tensor parallelism, default tp) x ep (the experts split over ep ranks, E / ep each) x edp = tp cp dp / (etp ep)
replicas of each expert. So ep must divide the E experts, and etp x ep must divide tp x cp x dp. Which layers have
experts: layer i (from 0) when (i + 1) is a multiple of `moe_every` (every layer for Mixtral; the 2nd, 4th, ...
for Switch and GShard), `ModelSpec.moe_layers` of them.

One MoE layer, one micro-batch of b sequences, on one rank (Megatron-Core's alltoall token dispatcher [4]; the
cost model requires sequence parallelism when tp > 1, as Megatron-Core does when experts meet tensor parallelism):

    tokens        the rank's sequence shard, T = b s / (cp tp), enters the layer; the router (T x h @ h x E)
                  picks top_k experts per token: k T routed copies leave the rank
    routing       balanced (every expert gets the same number of tokens; real routers are not, and an expert
                  with more tokens sets the pace: the model leaves that out)
    dispatch      an all-to-all over ep of the k T copies (2 k T h bytes; (ep - 1) / ep of it leaves the rank),
                  then with etp > 1 an all-gather over etp (each expert's etp ranks see the same tokens)
    experts       E / ep local experts, each with k b s etp ep / (tp cp E) tokens: grouped GEMMs
                  (T_e x h @ h x g f / etp) and (T_e x f / etp @ f / etp x h), g = 2 for SwiGLU (gate, up)
    combine       a reduce-scatter over etp, then the all-to-all back
    bytes         the activation (SwiGLU / GeLU) over the k T copies (k times a dense MLP's), and the
                  permutation before the dispatch and after the combine: each reads and writes the 2 k T h bytes
                  of the copies (the router's softmax over E is left out: E / h of a hidden state)
    backward      the products' input and weight gradients; the four collectives mirrored (the same bytes)
    recompute     full: the forward again, its all-to-alls with it; selective: nothing of the experts

These replace the dense MLP's products, bytes and TP collectives (SP: an all-gather and a reduce-scatter of the
layer's hidden state, and the all-gather again in the backward) that `StepCosts` counts for every layer. The
collectives run on the link their group crosses (the rank order of `parlab.parallel.topology.ParallelGrid.expert`);
an all-to-all across nodes gets its rank's share of the network cards (`Hardware.inter_bandwidth`) for all its bytes,
though those to ranks on its own node go over NVLink. EP's collectives are not overlapped with compute.

    [1] D. Lepikhin et al., "GShard", arXiv:2006.16668, sections 2.2-3.1 (top-k gating, experts over devices,
        the all-to-all dispatch and combine).
    [2] W. Fedus, B. Zoph, N. Shazeer, "Switch Transformers", JMLR 2022, arXiv:2101.03961, section 2.2 and
        figure 16 (expert parallelism; experts in every other layer).
    [3] D. Liu et al., "MoE Parallel Folding: Heterogeneous Parallelism Mappings for Efficient Large-Scale MoE
        Model Training with Megatron Core", arXiv:2504.14960, section 3 (the expert grid on the attention's ranks).
    [4] Megatron-LM, megatron/core/transformer/moe/README.md and token_dispatcher.py (the alltoall dispatcher:
        all-to-all over EP, all-gather / reduce-scatter over the experts' TP; "sequence parallelism must be
        enabled" with EP and TP).
    [5] A. Jiang et al., "Mixtral of Experts", arXiv:2401.04088, section 2 (8 experts, top-2, every layer).
Pure Python: no torch.
"""
from __future__ import annotations

import dataclasses
import functools

from parlab.cluster import transformer as T
from parlab.cluster.costs import BYTES_16BIT
from parlab.cluster.layer_costs import fp8_cast_bytes
from parlab.i18n import _
from parlab.parallel.pipeline.schedules import split_layers

__all__ = ["check_experts", "is_moe", "ExpertCosts", "expert_gemms", "dispatch_bytes", "stage_states",
           "local_layer_params", "ep_seconds"]


def check_experts(model, tp: int, cp: int, dp: int, ep: int = 1, etp: int | None = None,
                  sequence_parallel: bool = True) -> int:
    """The experts' tensor parallelism (etp, default tp) if `model` can be laid out with ep and etp on tp x cp x dp
    ranks per stage (module docstring), else a ValueError saying what is wrong and how to fix it."""
    etp = tp if etp is None else etp
    for name, v in (("ep", ep), ("etp", etp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(_("{name} must be a positive integer, got {value!r}").format(name=name, value=v))
    if not model.experts:
        if ep > 1 or etp != tp:
            raise ValueError(_("ep={ep} (etp={etp}) lays out experts, but {model} is dense (no experts): use ep=1, "
                               "or a mixture of experts such as mixtral-8x7b").format(ep=ep, etp=etp, model=model.name))
        return etp
    if model.experts % ep:
        raise ValueError(_("ep={ep} must divide the {experts} experts of {model} (each expert-parallel rank holds "
                           "experts / ep of them)").format(ep=ep, experts=model.experts, model=model.name))
    if model.ffn % etp:
        raise ValueError(_("etp={etp} must divide {model}'s expert MLP width {ffn}").format(
            etp=etp, model=model.name, ffn=model.ffn))
    if (tp * cp * dp) % (etp * ep):
        raise ValueError(_("etp x ep = {n} must divide the tp x cp x dp = {ranks} ranks of a pipeline stage (the "
                           "experts fold onto them); choose ep dividing {ranks} / etp").format(
            n=etp * ep, ranks=tp * cp * dp))
    if tp > 1 and not sequence_parallel:
        raise ValueError(_("tp={tp} with a mixture of experts needs sequence parallelism (Megatron-Core requires it "
                           "when experts meet tensor parallelism): turn sequence_parallel on").format(tp=tp))
    return etp


def is_moe(model, layer: int) -> bool:
    """Does layer `layer` (from 0) hold experts: every `moe_every`-th, the last of each group of moe_every."""
    return bool(model.experts) and (layer + 1) % model.moe_every == 0


def dispatch_bytes(model, b: int, tp: int = 1, cp: int = 1) -> float:
    """Payload of one all-to-all of the dispatch on one rank: the k b s / (cp tp) routed copies of its tokens,
    2 h bytes each; (ep - 1) / ep of it leaves the rank (`parlab.trace.wire`)."""
    return BYTES_16BIT * model.top_k * b * model.seq / (cp * tp) * model.hidden


def expert_gemms(model, b: int, tp: int, cp: int, ep: int, etp: int) -> list[tuple]:
    """The router's and the local experts' products of one MoE layer's forward on one rank (module docstring), as
    `transformer.layer_gemms` gives them: (name, m, n, k, batch); the expert products are grouped, batch E / ep."""
    tokens = b * model.seq / (cp * tp)
    per_expert = model.top_k * tokens * etp * ep / model.experts
    local, f, h = model.experts // ep, model.ffn // etp, model.hidden
    return [("router", tokens, model.experts, h, 1), ("mlp_in", per_expert, (2 if model.swiglu else 1) * f, h, local),
            ("mlp_out", per_expert, h, f, local)]


class ExpertCosts:
    """The part of `costs` (a `StepCosts`) that a mixture of experts changes: per virtual stage, what its MoE layers
    add to the dense layers' compute (`compute`) and communication (`comm`), with `gemm_s` timing products as
    `costs` does (fp8 for the weight products). Zero everywhere for a dense model."""

    def __init__(self, costs, gemm_s):
        m, lay = costs.model, costs.layout
        self.costs, self.model = costs, m
        self.ep, self.etp = lay.ep, check_experts(m, lay.tp, lay.cp, lay.dp, lay.ep, lay.etp, lay.sequence_parallel)
        self.edp = lay.tp * lay.cp * lay.dp // (self.etp * self.ep)
        self.layers = [sum(is_moe(m, i) for i in r) for r in split_layers(m.layers, costs.stages)]
        self.parts = {"forward": 0.0, "dgrad": 0.0, "wgrad": 0.0}
        self.nodes = {"ep": 1, "etp": 1, "edp": 1}
        if not m.experts:
            return
        self._placement(costs.hw.gpus_per_node)
        b, tp, cp = lay.micro_batch, lay.tp, lay.cp
        dense = [g for g in T.layer_gemms(m, b, tp, cp) if g[0].startswith("mlp")]
        moe = expert_gemms(m, b, tp, cp, self.ep, self.etp)
        bwd = lambda gs, kind: [g for g in T.backward_gemms(gs) if g[0].endswith(kind)]   # noqa: E731
        hw = costs.hw
        mem = hw.mem_bw * hw.mem_efficiency if costs.t_mem else 0.0
        act = (5 if m.swiglu else 2) * BYTES_16BIT * b * m.seq * m.ffn / (tp * cp)          # a dense MLP's
        extra = ((m.top_k - 1) * act + 2 * 2 * dispatch_bytes(m, b, tp, cp)) / mem if mem else 0.0
        fp8 = lay.precision == "fp8" and mem
        cast = [(x - y) / mem for x, y in zip(fp8_cast_bytes(moe), fp8_cast_bytes(dense))] if fp8 else (0.0, 0.0)
        self.parts = {"forward": gemm_s(moe) - gemm_s(dense) + extra + cast[0],
                      "dgrad": gemm_s(bwd(moe, "dgrad")) - gemm_s(bwd(dense, "dgrad")) + extra + cast[1],
                      "wgrad": gemm_s(bwd(moe, "wgrad")) - gemm_s(bwd(dense, "wgrad"))}
        x = dispatch_bytes(m, b, tp, cp)
        def coll(op, n, dim, nbytes):
            return hw.collective_time(op, nbytes, n, self.nodes[dim] > 1, self.nodes[dim]) if n > 1 else 0.0
        # dispatch and combine: two all-to-alls over ep, an all-gather and a reduce-scatter over etp
        self.ep_layer = (2 * coll("all_to_all", self.ep, "ep", x) + coll("all_gather", self.etp, "etp", self.etp * x)
                         + coll("reduce_scatter", self.etp, "etp", self.etp * x))
        # the dense MLP's TP collectives an MoE layer does not run (sequence parallel: all-gather + reduce-scatter,
        # the backward's all-gather again; without sequence parallelism tp is 1: nothing)
        self.tp_share = costs._tp("all_gather") + costs._tp("reduce_scatter")

    def _placement(self, gpus_per_node: int) -> None:
        """How many nodes the ep, etp and edp groups of rank 0 span (`ParallelGrid.expert`, Megatron's order)."""
        from parlab.parallel.topology import ParallelGrid
        lay = self.costs.layout
        grid = ParallelGrid(lay.gpus, tp=lay.tp, pp=lay.pp, cp=lay.cp, dp=lay.dp, ep=self.ep, etp=self.etp,
                            gpus_per_node=min(gpus_per_node, lay.gpus))
        for dim in self.nodes:
            self.nodes[dim] = len({grid.node_of(r) for r in grid.expert.group_of(0, dim)})

    def compute(self, part: str, stage: int) -> float:
        """Seconds the MoE layers of `stage` add to its dense layers' "forward" (products, bytes, fp8 casts),
        "dgrad" (input gradients and the backward's bytes) or "wgrad" (weight gradients)."""
        return self.layers[stage] * self.parts[part] if self.layers[stage] else 0.0

    def comm(self, op: str, stage: int, dims) -> float:
        """What the MoE layers of `stage` change in `costs.comm_part(op, stage, dims)`: "tp" loses the dense MLP's
        collectives (the backward's after overlap), "ep" gains the dispatch and combine (module docstring)."""
        k = self.layers[stage]
        if not k or op == "backward_weight":
            return 0.0
        c = self.costs
        tp, ep = "tp" in dims, "ep" in dims
        fwd = (-self.tp_share if tp else 0.0) + (self.ep_layer if ep else 0.0)
        if op == "forward":
            return k * fwd
        share = self.tp_share + c._tp("all_gather")
        tp_bwd = -share
        if c.layout.tp_overlap and op == "backward":    # the overlap hides TP traffic behind the weight gradients
            full = c.tp_backward()
            tp_bwd = max(0.0, full - share - c.t_wgrad - self.parts["wgrad"]) - max(0.0, full - c.t_wgrad)
        bwd = (tp_bwd if tp else 0.0) + (self.ep_layer if ep else 0.0)
        return k * (bwd + (fwd if c.layout.recompute == "full" else 0.0))


def local_layer_params(model, tp: int, ep: int = 1, etp: int | None = None) -> tuple[float, float]:
    """(dense, expert) parameters of one MoE layer on one rank: attention, norms and the router (/ tp where
    Megatron splits them), and E / ep experts / etp."""
    base = dataclasses.replace(model, experts=0, top_k=1)         # the same layer with one dense MLP
    etp = tp if etp is None else etp
    dense = base.layer_params(tp) - base.mlp_params(tp) + model.hidden * model.experts
    return dense, model.experts // ep * model.mlp_params(etp)


def stage_states(model, tp: int, pp: int, nd: int, zero: int, ep: int = 1, etp: int | None = None) -> dict:
    """Model-state bytes (`parlab.parallel.zero.model_state_bytes`) of the fullest pipeline stage of a mixture of
    experts: its dense parameters sharded over the nd = dp x cp replicas, its experts (E / ep per MoE layer, / etp)
    over their edp = tp nd / (etp ep) replicas where ZeRO shards them. The embedding, head and tied copy as
    `ModelSpec.stage_params` counts them."""
    from parlab.parallel.zero import model_state_bytes
    etp = tp if etp is None else etp
    edp = tp * nd // (etp * ep)
    base = dataclasses.replace(model, experts=0, top_k=1)
    moe_dense, moe_expert = local_layer_params(model, tp, ep, etp)
    ranges = split_layers(model.layers, pp)
    best = None
    for s, r in enumerate(ranges):
        k = sum(is_moe(model, i) for i in r)
        dense = (len(r) - k) * base.layer_params(tp) + k * moe_dense
        dense += model.embedding_params(tp) if s == 0 else 0.0
        if s == len(ranges) - 1:
            dense += model.head_params(tp) + (model.vocab * model.hidden / tp if model.tied and pp > 1 else 0.0)
        a, e = model_state_bytes(dense, nd, zero), model_state_bytes(k * moe_expert, edp, zero)
        states = {key: a[key] + e[key] for key in a}
        best = states if best is None or states["total"] > best["total"] else best
    return best


def ep_seconds(model, cluster, tp: int, pp: int, cp: int, ep: int, etp: int, b: int, m: int, recompute: str):
    """(seconds, bytes) of the all-to-alls and etp gathers the fullest stage's MoE layers move per step for the
    planner without hardware: 4 all-to-alls per layer and micro-batch (6 with full recomputation) of
    `dispatch_bytes`, (ep - 1) / ep of each leaving the rank, and the etp all-gathers and reduce-scatters (as many),
    at the cluster's bandwidth on the link the ep group crosses."""
    from parlab.trace.wire import wire_bytes
    if not model.experts:
        return 0.0, 0.0
    layers = max(sum(is_moe(model, i) for i in r) for r in split_layers(model.layers, pp))
    x = dispatch_bytes(model, b, tp, cp)
    calls = (6 if recompute == "full" else 4) * layers * m
    nbytes = calls * (wire_bytes("all_to_all", x, ep) + wire_bytes("all_gather", etp * x, etp))
    return nbytes / cluster.bandwidth(_crosses(cluster.world, tp, pp, cp, ep, etp, cluster.gpus_per_node)), nbytes


@functools.lru_cache(maxsize=4096)
def _crosses(world: int, tp: int, pp: int, cp: int, ep: int, etp: int, gpus_per_node: int) -> bool:
    """Does an etp x ep group of the expert grid span several nodes (ranks fill nodes in order)?"""
    from parlab.parallel.topology import ParallelGrid
    grid = ParallelGrid(world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, gpus_per_node=gpus_per_node)
    return any(g[0] // gpus_per_node != g[-1] // gpus_per_node for g in grid.expert.groups("etp-ep"))
