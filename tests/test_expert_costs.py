"""Expert parallelism in the cost model (`parlab.cluster.expert_costs`): the layout rules, the all-to-all bytes, an
MoE layer against its dense twin, the experts' gradient sync over edp, the planner's memory and ``parlab plan --ep``."""
import dataclasses

import pytest

from parlab.cluster.costs import Cluster, ModelSpec, model_preset
from parlab.cluster.expert_costs import dispatch_bytes
from parlab.cluster.hardware import hardware_preset
from parlab.cluster.plan_cli import main
from parlab.cluster.planner import enumerate_layouts, estimate
from parlab.cluster.step_costs import Layout, StepCosts

MIX = model_preset("mixtral-8x7b")
SMALL = ModelSpec("moe", layers=2, hidden=1024, heads=16, vocab=32000, seq=2048, ffn=2048, swiglu=True, bias=False,
                  tied=False, learned_pos=False, dropout=False, kv_heads=8, experts=8, top_k=2)


@pytest.mark.parametrize("model, layout, words", [
    (MIX, Layout(dp=16, ep=16), "ep=16 must divide the 8 experts of mixtral-8x7b"),
    (model_preset("llama-7b"), Layout(dp=8, ep=2), "llama-7b is dense"),
    (MIX, Layout(dp=2, ep=4), r"etp x ep = 4 must divide the tp x cp x dp = 2 ranks"),
    (MIX, Layout(tp=2, dp=4, ep=2), "needs sequence parallelism"),
    (MIX, Layout(dp=8, ep=8, etp=3), "etp=3 must divide mixtral-8x7b's expert MLP width 14336"),
])
def test_a_layout_the_experts_cannot_take_is_refused_saying_how_to_fix_it(model, layout, words):
    with pytest.raises(ValueError, match=words):
        StepCosts(model, hardware_preset("dgx-h100"), layout, 1)
    with pytest.raises(ValueError, match=words):
        estimate(model, Cluster(gpus_per_node=layout.gpus), 4 * layout.dp, tp=layout.tp, ep=layout.ep, etp=layout.etp,
                 sequence_parallel=layout.sequence_parallel)
    with pytest.raises(ValueError, match="positive integer"):
        Layout(ep=0)


def test_the_dispatch_all_to_all_moves_the_routed_copies_and_ep_minus_one_over_ep_of_them_leave():
    hw = hardware_preset("dgx-h100")
    # dispatch payload: k b s / (cp tp) routed copies of h 16-bit values: top-2, b 2, s 2048 / (cp 2 x tp 1), h 1024
    assert dispatch_bytes(SMALL, 2, tp=1, cp=2) == 2 * 2 * 2 * 1024 * 1024
    c = StepCosts(SMALL, hw, Layout(dp=4, cp=2, ep=8, micro_batch=2), 1)
    x = 2 * 2 * 2 * 2048 / 2 * 1024
    ring = hw.base_latency + 7 * hw.intra_latency + 7 / 8 * x / (hw.intra_bw * hw.intra_efficiency)   # one node
    assert c.experts.nodes["ep"] == 1 and c.experts.ep_layer == pytest.approx(2 * ring, rel=1e-12)
    # four per MoE layer and micro-batch (dispatch and combine, forward and backward); six with full recomputation
    assert c.comm_part("forward", 0, ("ep",)) + c.comm_part("backward", 0, ("ep",)) == pytest.approx(4 * 2 * ring)
    full = StepCosts(SMALL, hw, Layout(dp=4, cp=2, ep=8, micro_batch=2, recompute="full"), 1)
    assert full.comm_part("backward", 0, ("ep",)) == pytest.approx(4 * 2 * ring)


def test_an_moe_layer_without_expert_parallelism_costs_its_dense_twin_plus_the_router_and_the_permutation():
    # top-2 of 8 experts of width f against one dense MLP of width 2f: the same products' FLOPs and activation
    # bytes, so without waves of tiles (FLOPs at the kernel rate) they differ by the router (T x h @ h x E, forward;
    # its two gradients, backward) and the permutation's bytes (module docstring: 2 x 2 x 2 k T h), nothing else
    hw = hardware_preset("dgx-a100").with_(sms=None)
    twin = dataclasses.replace(SMALL, experts=0, top_k=1, ffn=2 * SMALL.ffn)
    moe, dense = (StepCosts(m, hw, Layout(dp=2, micro_batch=2), 1) for m in (SMALL, twin))
    T, h = 2 * 2048, 1024
    router = 2 * T * h * 8 / (hw.peak_flops * hw.efficiency)
    permute = 2 * 2 * 2 * 2 * T * h / (hw.mem_bw * hw.mem_efficiency)
    n = SMALL.layers
    assert moe.action("forward", 0) - dense.action("forward", 0) == pytest.approx(n * (router + permute), rel=1e-9)
    assert moe.action("backward", 0) - dense.action("backward", 0) == pytest.approx(n * (2 * router + permute),
                                                                                    rel=1e-9)


def test_the_experts_gradients_sync_over_their_expert_data_parallel_group():
    hw = hardware_preset("dgx-h100")
    c = StepCosts(SMALL, hw, Layout(dp=16, ep=8), 1)               # 2 nodes: experts split 8 ways, edp = 2
    s = c.sync
    assert c.experts.edp == 2 and c.experts.nodes["edp"] == 2      # rank 0's expert replica is rank 8, next node
    experts = SMALL.layers * 1 * SMALL.mlp_params()                 # 8 / 8 experts per rank and layer
    assert s.expert_params(0) == experts
    one = StepCosts(SMALL, hw, Layout(dp=16), 1).sync               # ep 1: every expert on every rank
    assert one.dense_params(0) + one.expert_params(0) == pytest.approx(one.stage_params(0), rel=1e-12)
    want = (hw.collective_time("all_reduce", 2 * s.dense_params(0), 16, True, 2)
            + hw.collective_time("all_reduce", 2 * experts, 2, True, 2))
    assert s.grad_sync([0]) == pytest.approx(want, rel=1e-12)


def test_the_replay_syncs_the_experts_gradients_even_without_data_parallelism():
    # tp 2 with the experts unsplit (etp 1): each tp rank routes its own sequence shard through whole experts, so
    # the two copies of every expert differ after the backward and sync over edp = 2, though dp = cp = 1
    from parlab.cluster.scaleup import scaleup
    from parlab.parallel.pipeline import one_f_one_b
    layout = Layout(tp=2, pp=2, sequence_parallel=True, etp=1)
    c = StepCosts(SMALL, hardware_preset("dgx-h100"), layout, 2)
    assert c.experts.edp == 2 and c.sync.grad_sync([0]) > 0
    out = scaleup(one_f_one_b(2, 4), SMALL, hardware_preset("dgx-h100"), layout)
    syncs = [e for e in out.events if e.label == "dp grads (virtual)"]
    assert sorted(e.duration for e in syncs) == pytest.approx(sorted(c.sync.grad_sync([s]) for s in (0, 1)), rel=1e-12)


def test_the_planner_keeps_e_over_ep_experts_per_gpu_with_their_states_sharded_over_edp():
    cluster = Cluster(nodes=2)
    e1, e8 = (estimate(MIX, cluster, 64, ep=ep) for ep in (1, 8))
    mlp = MIX.mlp_params()
    # bf16 weights: every expert of the 32 layers on each GPU with ep 1, one of 8 with ep 8
    assert e1.params_bytes - e8.params_bytes == pytest.approx(2 * 32 * 7 * mlp, rel=1e-9)
    # ZeRO-1 shards the experts' optimizer state over their edp = 16 / 8 = 2 replicas, the rest over 16
    z = estimate(MIX, cluster, 64, ep=8, zero=1)
    dense = e8.params_bytes / 2 - 32 * mlp
    assert z.optimizer_bytes == pytest.approx(12 * (dense / 16 + 32 * mlp / 2), rel=1e-9)
    with pytest.raises(ValueError, match="llama-7b is dense"):
        enumerate_layouts(model_preset("llama-7b"), cluster, 64, ep=(1, 2))


def test_plan_tries_the_ep_sizes_asked_for_and_refuses_the_ones_the_model_cannot_take(capsys):
    assert main(["--model", "mixtral-8x7b", "--nodes", "2", "--ep", "1", "8", "--top", "40", "--recompute",
                 "selective"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.lstrip().startswith("#"))
    assert " ep " in head and " EP " in head and "expert parallelism tried: 1 8" in out
    col = head.split().index("ep")
    eps = {line.split()[col] for line in out.splitlines() if "|" in line and line.split()[0].isdigit()}
    assert eps == {"1", "8"}
    for argv, words in ((["--ep", "2"], "gpt3-175b is dense (no experts)"),
                        (["--model", "mixtral-8x7b", "--ep", "3"], "--ep 3 must divide the 8 experts of mixtral-8x7b"),
                        (["--model", "mixtral-8x7b", "--ep", "0"], "--ep takes positive")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and words in err and len(err.strip().splitlines()) <= 2   # usage hint at most
