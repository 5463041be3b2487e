"""The pipeline program built from a schedule (parlab.cluster.pipeline_program) against a traced run of the same
schedule, and the step cost model (parlab.cluster.step_costs) the scale-up replay re-times it with."""
import math

import pytest
import torch

import parlab
from parlab.cluster.costs import model_preset
from parlab.cluster.hardware import GEMM_TILE, hardware_preset
from parlab.cluster.pipeline_program import pipeline_trace
from parlab.cluster.published import KORTHIKANTI
from parlab.cluster.replay import step_time
from parlab.cluster.scaleup import Layout, scaleup
from parlab.cluster import transformer as T
from parlab.cluster.step_costs import StepCosts, fp8_cast_bytes
from parlab.cluster.sync_costs import OPTIMIZER_BYTES_PER_PARAM
from parlab.models import GPT, GPTConfig
from parlab.parallel import pipeline as sch
from parlab.parallel.pipeline import PipelineParallel

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=8, n_head=2, n_embd=16)
SCHEDULES = {"1f1b": lambda p, m: sch.one_f_one_b(p, m), "interleaved": lambda p, m: sch.interleaved_1f1b(p, m, 2),
             "zb-h1": lambda p, m: sch.zero_bubble_h1(p, m), "gpipe": lambda p, m: sch.gpipe(p, m)}


def _step(name, p, m):
    x = torch.randint(CFG.vocab_size, (m, CFG.seq_len), generator=torch.Generator().manual_seed(0))   # (m, S)
    PipelineParallel(GPT(CFG, seed=0), SCHEDULES[name](p, m)).step(x, x)


def _program(trace):
    """Each rank's steps in order, without times: what a replay keeps of a trace."""
    return sorted((e.rank, e.start, e.kind, e.op, e.label, e.asynchronous, e.waited is not None) for e in trace.events)


def _order(trace):
    by_rank = {}
    for e in sorted(trace.events, key=lambda e: (e.rank, e.start)):
        by_rank.setdefault(e.rank, []).append((e.kind, e.op, e.label, e.asynchronous))
    return by_rank


@pytest.mark.parametrize("name,p,m", [("1f1b", 2, 4), ("interleaved", 2, 4), ("zb-h1", 3, 6)])
def test_the_built_program_is_the_traced_program_and_replays_to_the_same_time(name, p, m):
    traced = parlab.run(_step, p, name, p, m, trace=True, echo=False).trace
    built = pipeline_trace(SCHEDULES[name](p, m))
    assert _order(built) == _order(traced)          # the same steps, in the same order, on every rank
    v = 2 if name == "interleaved" else 1
    model, hw = model_preset("gpt3-175b"), hardware_preset("dgx-a100")
    layout = Layout(tp=8, pp=p, dp=4, micro_batch=1, recompute="selective", sequence_parallel=True, virtual=v)
    a, b = scaleup(traced, model, hw, layout), scaleup(built, model, hw, layout)
    # the same costs summed in the same program order: equal to float rounding
    assert step_time(b) == pytest.approx(step_time(a), rel=1e-12)
    assert step_time(scaleup(SCHEDULES[name](p, m), model, hw, layout)) == pytest.approx(step_time(a), rel=1e-12)


def test_a_built_program_needs_a_schedule():
    with pytest.raises(ValueError, match="needs a parlab.parallel.pipeline.Schedule"):
        pipeline_trace("1f1b")
    with pytest.raises(ValueError, match="a parlab.Trace of a PipelineParallel step or a"):
        scaleup([1, 2], model_preset("gpt3-175b"), hardware_preset("dgx-a100"), Layout(pp=2))


def test_gemm_time_counts_waves_of_tiles_over_the_sms():
    hw = hardware_preset("dgx-a100")
    rate = hw.peak_flops * hw.efficiency
    tm, tn = GEMM_TILE
    # 8 x 36 = 288 tiles on 108 SMs: 3 waves, the last one 2/3 full
    assert hw.gemm_time(2048, 4608, 12288) == pytest.approx(3 * 108 * 2 * tm * tn * 12288 / rate, rel=1e-12)
    assert hw.gemm_time(2048, 4608, 12288) > 2 * 2048 * 4608 * 12288 / rate
    # 108 x 16 tiles fill 16 waves exactly: the FLOP count at peak x efficiency
    m, n = 108 * tm, 16 * tn
    assert hw.gemm_time(m, n, 4096) == pytest.approx(2 * m * n * 4096 / rate, rel=1e-12)
    assert hw.with_(sms=None).gemm_time(2048, 4608, 12288) == pytest.approx(2 * 2048 * 4608 * 12288 / rate)
    assert hw.gemm_time(0, 4608, 12288) == 0.0
    with pytest.raises(ValueError, match="sms must be a positive integer"):
        hw.with_(sms=0)


def test_nvlink_transfers_run_at_nccls_planned_bandwidth():
    hw = hardware_preset("dgx-a100")
    assert hw.link(False)[0] == pytest.approx(240e9)          # 12 links x 20 GB/s (NCCL topo.h)
    assert hw.link(True)[0] == hw.inter_bw
    with pytest.raises(ValueError, match="intra_efficiency is a fraction"):
        hw.with_(intra_efficiency=1.5)


def test_an_interleaved_rank_pays_the_sync_and_the_optimizer_of_all_its_stages():
    model, hw = model_preset("gpt3-175b"), hardware_preset("dgx-a100")
    lay = Layout(tp=8, pp=2, dp=4, virtual=2)
    out = scaleup(sch.interleaved_1f1b(2, 4, 2), model, hw, lay)
    costs = StepCosts(model, hw, lay, 4)
    opt = {e.rank: e.duration for e in out.events if e.op == "optimizer"}
    assert opt[0] == pytest.approx(costs.sync.optimizer({0, 2}), rel=1e-12)
    assert opt[1] == pytest.approx(costs.sync.optimizer({1, 3}), rel=1e-12)
    psi = costs.sync.stage_params(0) + costs.sync.stage_params(2)
    assert opt[0] == pytest.approx(OPTIMIZER_BYTES_PER_PARAM * psi / (hw.mem_bw * hw.mem_efficiency), rel=1e-12)
    sync = {e.rank: e.duration for e in out.events if e.label == "dp grads (virtual)"}
    assert sync[0] == pytest.approx(costs.sync.grad_sync({0, 2}), rel=1e-12) and sync[0] > costs.sync.grad_sync({0})
    # the last virtual stage (3, on rank 1) carries the logits: 24 layers each, it alone is longer
    fwd = {s: costs.action("forward", s) for s in range(4)}
    assert fwd[0] == pytest.approx(fwd[1]) and fwd[3] > fwd[2]
    assert fwd[3] - fwd[2] == pytest.approx(costs.t_head_fwd + costs.t_mem_head, rel=1e-9)


def test_layout_options_change_the_costs_they_name():
    model, hw = model_preset("gpt3-175b"), hardware_preset("dgx-a100")
    base = StepCosts(model, hw, Layout(tp=8, pp=2, dp=8), 2)
    zero1 = StepCosts(model, hw, Layout(tp=8, pp=2, dp=8, zero=1), 2)
    assert zero1.sync.optimizer({0}) == pytest.approx(base.sync.optimizer({0}) / 8, rel=1e-12)   # each rank updates 1/dp
    assert zero1.sync.grad_sync({0}) > 0 and base.sync.grad_sync({0}) > 0
    over = StepCosts(model, hw, Layout(tp=8, pp=2, dp=8, tp_overlap=True), 2)
    assert over.action("forward", 0) == base.action("forward", 0)       # the forward's all-reduces stay serial
    assert over.action("backward", 0) < base.action("backward", 0)      # the backward's hide behind wgrad GEMMs
    dpo = StepCosts(model, hw, Layout(tp=8, pp=2, dp=8, dp_overlap=True), 2)
    assert dpo.exposed_grad_sync({0}) == pytest.approx(max(0.0, base.sync.grad_sync({0}) - base.action("backward", 0)))
    assert base.exposed_grad_sync({0}) == base.sync.grad_sync({0})
    h100 = hardware_preset("dgx-h100")
    fp8 = StepCosts(model, h100, Layout(tp=8, pp=2, precision="fp8"), 2)
    bf16 = StepCosts(model, h100, Layout(tp=8, pp=2), 2)
    # fp8 as Transformer Engine runs it: the four weight GEMMs at the fp8 rate (989 -> 1,979 dense TFLOP/s, the
    # datasheet's, of which 80% and 71% measured), the attention products and the logits in bf16, the casts as bytes
    weights = [g for g in T.layer_gemms(model, 1, 8) if g[0] in ("qkv", "proj", "mlp_in", "mlp_out")]
    core = [g for g in T.layer_gemms(model, 1, 8) if g not in weights]
    time_of = lambda hw_, gs: sum(hw_.gemm_time(*g[1:]) for g in gs)          # noqa: E731
    assert fp8.t_fwd_gemm == pytest.approx(time_of(h100.at("fp8"), weights) + time_of(h100, core), rel=1e-12)
    assert bf16.t_fwd_gemm == pytest.approx(time_of(h100, weights + core), rel=1e-12)
    assert fp8.t_head_fwd == bf16.t_head_fwd
    fwd_cast, bwd_cast = fp8_cast_bytes(T.layer_gemms(model, 1, 8))
    T_, h, f = model.seq, model.hidden, model.ffn
    # inputs (T x h, T x h/8, T x h, T x f/8) and weights, 3 bytes each element (read 16 bits, write 8)
    assert fwd_cast == 3 * (T_ * h * 2 + T_ * h / 8 + T_ * f / 8 + 4 * h * h / 8 + 2 * h * f / 8)
    assert bwd_cast == 3 * T_ * (3 * h / 8 + h + f / 8 + h)                      # the output gradients
    assert fp8.action("forward", 0) < bf16.action("forward", 0)
    with pytest.raises(ValueError, match="DGX A100 has no 'fp8' rate"):
        StepCosts(model, hw, Layout(tp=8, pp=2, precision="fp8"), 2)
    for bad, msg in ((dict(virtual=0), "virtual must be a positive integer"),
                     (dict(virtual=2), "needs pp >= 2"),
                     (dict(tp_overlap="yes"), "tp_overlap must be True or False"),
                     (dict(precision=""), "precision names a number format")):
        with pytest.raises(ValueError, match=msg):
            Layout(**bad)
    with pytest.raises(ValueError, match="has 96 layers"):
        StepCosts(model, hw, Layout(pp=2), 97)


def test_sequence_parallel_gathers_the_inputs_again_in_the_backward():
    model, hw = model_preset("gpt3-175b"), hardware_preset("dgx-a100")
    sp = StepCosts(model, hw, Layout(tp=8, sequence_parallel=True), 1)
    ag, rs = sp._tp("all_gather"), sp._tp("reduce_scatter")
    assert sp.tp_forward() == pytest.approx(2 * (ag + rs))
    assert sp.tp_backward() == pytest.approx(2 * (ag + rs) + 2 * ag)


@pytest.mark.parametrize("run", KORTHIKANTI[:4], ids=lambda r: r.label)
def test_the_replay_of_korthikanti_table_5_is_within_ten_percent(run):
    # the 22B and 175B rows (the 530B and 1T ones take seconds each: benchmarks/cost_model.py replays all 8);
    # the paper's layouts, the interleaving Megatron ran (3 chunks per rank for 175B, Calculon's validation
    # configuration), nothing fitted to these rows: the acceptance bound of issue 31, not a tolerance of ours
    schedule, layout = run.replay_inputs()
    t = step_time(scaleup(schedule, run.model, hardware_preset("dgx-a100"), layout))
    assert abs(t / run.step_s - 1) <= 0.10
    assert math.isfinite(t)


@pytest.mark.parametrize("case", ["175b-full", "175b-sp-selective", "llama-dp-zero1", "gpt3-h100-tp-overlap"])
def test_the_planner_times_a_layout_as_the_replay_does(case):
    from parlab.cluster.scaleup import compare
    gpt3, llama = model_preset("gpt3-175b"), model_preset("llama-7b")
    a100, h100 = hardware_preset("dgx-a100"), hardware_preset("dgx-h100")
    model, hw, schedule, layout, batch = {
        "175b-full": (gpt3, a100, sch.interleaved_1f1b(8, 64, 3),
                      Layout(tp=8, pp=8, recompute="full", virtual=3), 64),
        "175b-sp-selective": (gpt3, a100, sch.one_f_one_b(8, 32),
                              Layout(tp=8, pp=8, recompute="selective", sequence_parallel=True), 32),
        "llama-dp-zero1": (llama, a100, sch.one_f_one_b(4, 8),
                           Layout(tp=2, pp=4, dp=4, zero=1, sequence_parallel=True), 32),
        "gpt3-h100-tp-overlap": (gpt3, h100, sch.one_f_one_b(4, 8),
                                 Layout(tp=8, pp=4, recompute="full", tp_overlap=True), 8),
    }[case]
    res = compare(schedule, model, hw, layout, batch)
    # the planner reads the same costs and runs the schedule as the replay does (parlab.cluster.pipeline_time);
    # its closed form alone is 0.1-0.4% off on Korthikanti's runs (benchmarks/README.md)
    assert res["planner_s"] == pytest.approx(res["replay_s"], rel=1e-9)


@pytest.mark.parametrize("name", ["gpipe", "zb-h1"])
def test_the_closed_form_of_gpipe_and_zb_h1_is_their_replay(name):
    model, hw = model_preset("gpt3-175b"), hardware_preset("dgx-a100")
    for rc in ("none", "full"):
        layout = Layout(tp=8, pp=8, recompute=rc)
        closed = StepCosts(model, hw, layout, 8).step_terms(32, name)["step"]
        replayed = step_time(scaleup(SCHEDULES[name](8, 32), model, hw, layout))
        assert closed == pytest.approx(replayed, rel=0.01)          # measured: 0.1-0.2% (fill and drain order)
    with pytest.raises(ValueError, match="no closed form for schedule 'naive'"):
        StepCosts(model, hw, Layout(tp=8, pp=8), 8).step_terms(32, "naive")


def test_the_planner_knows_the_schedules_memory_and_bubble():
    from parlab.cluster.costs import Cluster
    from parlab.cluster.planner import estimate
    model, cluster = model_preset("gpt3-175b"), Cluster(nodes=8)
    one = estimate(model, cluster, 64, tp=8, pp=8, recompute="selective")
    gp = estimate(model, cluster, 64, tp=8, pp=8, recompute="selective", schedule="gpipe")
    zb = estimate(model, cluster, 64, tp=8, pp=8, recompute="selective", schedule="zb-h1")
    assert gp.activation_bytes == pytest.approx(one.activation_bytes * 64 / 8)   # m = 64 in flight, not pp = 8
    assert gp.bubble_s == pytest.approx(one.bubble_s) and zb.bubble_s < one.bubble_s / 2
    assert zb.activation_bytes == one.activation_bytes and "zb-h1" in zb.layout
    with pytest.raises(ValueError, match="schedule must be '1f1b'"):
        estimate(model, cluster, 64, tp=8, pp=8, schedule="1F1B")
    with pytest.raises(ValueError, match="zb-h1 runs one chunk per rank"):
        estimate(model, cluster, 64, tp=8, pp=8, schedule="zb-h1", virtual=2)


def test_context_parallel_ring_hides_behind_the_attention_it_computes():
    import dataclasses
    from parlab.cluster.costs import Cluster
    from parlab.cluster.planner import estimate
    hw = hardware_preset("dgx-h100")
    long = dataclasses.replace(model_preset("llama-7b"), seq=32768)
    inside = StepCosts(long, hw, Layout(tp=2, cp=4, pp=2), 2)               # tp x cp = 8: one node
    assert inside.cp_exposed("forward") == 0.0                                # NVLink moves a block faster than its attention
    assert StepCosts(long, hw, Layout(tp=1, pp=2), 2).cp_exposed("forward") == 0.0   # no ring without cp
    short = dataclasses.replace(model_preset("llama-7b"), seq=2048)
    across = StepCosts(short, hw, Layout(tp=8, cp=4, pp=2), 2)               # cp groups cross InfiniBand
    block = 2 * 1 * 2048 / 4 * 4096 / 8                                      # bytes of K or V on one rank
    msg = hw.collective_time("send", 2 * block, 2, True)
    assert across.cp_exposed("forward") == pytest.approx(3 * max(0.0, msg - (across.t_core + across.t_mem_core) / 4))
    assert across.cp_exposed("forward") > 0 and across.cp_exposed("backward") > across.cp_exposed("forward")
    assert across.action("forward", 0) > StepCosts(short, hw, Layout(tp=8, pp=2), 2).action("forward", 0) / 4
    # the planner with the hardware reports the ring's exposed time as its CP term, and the replay agrees
    layout = Layout(tp=8, cp=4, pp=2, sequence_parallel=True)                  # as the planner assumes by default
    res_planner = estimate(short, Cluster(nodes=8, intra_gbps=450.0, inter_gbps=50.0, peak_tflops=989.0), 16, tp=8,
                           pp=2, cp=4, hardware=hw)
    m = 16                                                                    # 64 GPUs = tp 8 x cp 4 x pp 2: dp 1
    assert res_planner.cp_s == pytest.approx(m * (across.comm_part("forward", 1, ("cp",))
                                                  + across.comm_part("backward", 1, ("cp",))), rel=1e-9)
    replayed = step_time(scaleup(sch.one_f_one_b(2, m), short, hw, layout))
    assert res_planner.step_s == pytest.approx(replayed, rel=0.02)


def test_zero_stages_move_their_traffic_where_zero_puts_it():
    model, hw = model_preset("llama-7b"), hardware_preset("dgx-a100")
    lay = {z: Layout(tp=2, pp=2, dp=16, zero=z) for z in range(4)}
    c = {z: StepCosts(model, hw, lay[z], 2) for z in range(4)}
    ag, rs, ar = (c[0].sync._dp(op, [0]) for op in ("all_gather", "reduce_scatter", "all_reduce"))
    assert c[0].sync.grad_sync([0]) == ar and c[1].sync.grad_sync([0]) == pytest.approx(rs + ag)
    assert c[2].sync.grad_sync([0]) == ag and c[3].sync.grad_sync([0]) == 0.0        # ZeRO-3 keeps the weights sharded
    assert c[1].sync.optimizer([0]) == pytest.approx(c[0].sync.optimizer([0]) / 16)   # each replica updates its 1/16
    # per micro-batch: ZeRO-2 reduce-scatters after the backward, ZeRO-3 also gathers before forward and backward;
    # what the compute beside it hides is not charged (dp 16 crosses nodes: 25 GB/s)
    for z, op, traffic in ((2, "forward", 0.0), (2, "backward", rs), (3, "forward", ag), (3, "backward", ag + rs)):
        base = c[0].action(op, 0)
        assert c[z].zero_part(op, 0) == pytest.approx(max(0.0, traffic - base))
        assert c[z].action(op, 0) == pytest.approx(base + c[z].zero_part(op, 0))
    terms = c[3].step_terms(8)
    assert terms["dp"] == pytest.approx(8 * (c[3].zero_part("forward", 1) + c[3].zero_part("backward", 1)))
    moved = [8 * (2 * c[3].sync._dp("all_gather", [s]) + c[3].sync._dp("reduce_scatter", [s])) for s in (0, 1)]
    assert terms["dp_traffic"] == pytest.approx(max(moved))                 # the rank that moves the most
    with pytest.raises(ValueError, match="layout zero is a ZeRO stage 0, 1, 2 or 3"):
        Layout(zero=4)
    # the planner with the hardware reads the same: its terms are step_terms', the bubble simulated
    from parlab.cluster.costs import Cluster
    from parlab.cluster.planner import estimate
    est = estimate(model, Cluster(nodes=8), 256, tp=2, pp=2, zero=3, micro_batch=2, hardware=hw,
                   sequence_parallel=False)
    closed = StepCosts(model, hw, Layout(tp=2, pp=2, dp=16, zero=3, micro_batch=2), 2).step_terms(8, simulate=True)
    assert est.dp_s == pytest.approx(closed["dp"]) and est.step_s == pytest.approx(closed["step"])


def test_the_closed_form_follows_zb_h1_with_few_micro_batches_and_overlap():
    model, h100 = model_preset("gpt3-175b"), hardware_preset("dgx-h100")
    for layout, m in ((Layout(tp=8, pp=4), 1), (Layout(tp=8, pp=4), 3),
                      (Layout(tp=8, pp=4, dp=2, zero=3, tp_overlap=True), 8)):
        closed = StepCosts(model, h100, layout, 4).step_terms(m, "zb-h1")["step"]
        replayed = step_time(scaleup(sch.zero_bubble_h1(4, m), model, h100, layout))
        assert closed == pytest.approx(replayed, rel=0.01)   # measured 0.2%: m < pp leaves fewer W for the drain
    # where ZeRO-2's gradient traffic makes W longer than F + B_input the closed form does not hold: it says so
    heavy = StepCosts(model, h100, Layout(tp=8, pp=4, dp=4, zero=2), 4)
    with pytest.raises(ValueError, match="ZB-H1's closed form holds while"):
        heavy.step_terms(8, "zb-h1")


def test_the_closed_form_refuses_what_its_schedule_cannot_run():
    model, hw = model_preset("gpt3-175b"), hardware_preset("dgx-a100")
    inter = StepCosts(model, hw, Layout(tp=8, pp=8, virtual=2), 16)
    for m, schedule, msg in ((0, "1f1b", "m is the number of micro-batches"), (True, "1f1b", "m is the number"),
                             (16, "gpipe", "virtual=2 is interleaved 1F1B"), (12, "1f1b", "m divisible by pp")):
        with pytest.raises(ValueError, match=msg):
            inter.step_terms(m, schedule)
    uneven = StepCosts(model_preset("llama-7b"), hw, Layout(tp=2, pp=8, virtual=3), 24)   # 32 layers, 24 stages
    with pytest.raises(ValueError, match="the layers by pp x v"):
        uneven.step_terms(8)


def test_the_tied_embedding_is_exchanged_only_by_a_tied_model():
    gpt3, llama, hw = model_preset("gpt3-175b"), model_preset("llama-7b"), hardware_preset("dgx-a100")
    tied = [e for e in scaleup(sch.one_f_one_b(4, 8), gpt3, hw, Layout(tp=8, pp=4)).events if "tied" in e.label]
    untied = [e for e in scaleup(sch.one_f_one_b(4, 8), llama, hw, Layout(tp=8, pp=4)).events if "tied" in e.label]
    assert len(tied) == 4 and untied == []
    costs = StepCosts(gpt3, hw, Layout(tp=8, pp=4), 4)
    assert costs.step_terms(8)["pp"] == pytest.approx(2 * 3 * costs.message() + 2 * costs.message(tied=True))
    # the last stage keeps its own copy of the tied embedding: its sync and Adam move it too
    copy = gpt3.vocab * gpt3.hidden / 8
    assert costs.sync.stage_params(3) == pytest.approx(24 * gpt3.layer_params(8) + gpt3.head_params(8) + copy)
    assert max(costs.sync.stage_params(s) for s in range(4)) == pytest.approx(gpt3.stage_params(8, 4))


def test_bad_layouts_and_arguments_are_refused_with_what_to_fix():
    from parlab.cluster.costs import Cluster
    from parlab.cluster.planner import enumerate_layouts, estimate
    from parlab.cluster.scaleup import compare
    gpt3, hw = model_preset("gpt3-175b"), hardware_preset("dgx-a100")
    for args, msg in (((gpt3, hw, Layout(tp=5), 1), "tp=5 must divide gpt3-175b's 96 heads"),
                      ((gpt3, hw, Layout(cp=3), 1), "cp=3 must divide the sequence of 2048 tokens"),
                      ((gpt3, "dgx-a100", Layout(), 1), "hardware must be a parlab.cluster.hardware.Hardware"),
                      ((gpt3, hw, Layout(tp=8, pp=4), 2), "2 virtual stages do not fit the layout: pp=4"),
                      ((gpt3, hw, Layout(), "1"), "stages is the number of virtual pipeline stages")):
        with pytest.raises(ValueError, match=msg):
            StepCosts(*args)
    with pytest.raises(ValueError, match="stage must be a virtual stage 0..0, got 9"):
        StepCosts(gpt3, hw, Layout(), 1).action("forward", 9)
    with pytest.raises(ValueError, match="layout zero is a ZeRO stage"):
        Layout(zero=1.0)
    cluster = Cluster(nodes=8)
    for kw, msg in ((dict(tp=0), "tp must be a positive integer"), (dict(tp="8"), "tp must be a positive integer"),
                    (dict(micro_batch=0), "micro_batch must be a positive integer"),
                    (dict(zero=1.0), "zero is a ZeRO stage"), (dict(tp=5), "tp=5 must divide"),
                    (dict(tp=8, tp_overlap=True), "give hardware= too")):
        with pytest.raises(ValueError, match=msg):
            estimate(gpt3, cluster, 64, **kw)
    assert {e.virtual for e in enumerate_layouts(gpt3, cluster, 64, virtual=2)} == {2}    # an int is one choice
    with pytest.raises(ValueError, match="virtual lists the interleaving chunks"):
        enumerate_layouts(gpt3, cluster, 64, virtual=(0,))
    with pytest.raises(ValueError, match="layout must be a parlab.cluster.step_costs.Layout"):
        scaleup(sch.one_f_one_b(2, 4), gpt3, hw, {"tp": 8, "pp": 2})
    with pytest.raises(ValueError, match="global batch 32 is not the program's: dp 1 x micro-batch 1 x 16"):
        compare(sch.one_f_one_b(2, 16), gpt3, hw, Layout(tp=8, pp=2), 32)


def test_selective_recomputation_under_context_parallelism_passes_the_ring_again():
    import dataclasses
    hw = hardware_preset("dgx-h100")
    short = dataclasses.replace(model_preset("llama-7b"), seq=2048)
    mat = dict(attention="materialised")        # selective recomputation redoes written-out scores (fused: none)
    sel = StepCosts(short, hw, Layout(tp=8, cp=4, pp=2, recompute="selective", **mat), 2)
    none = StepCosts(short, hw, Layout(tp=8, cp=4, pp=2, **mat), 2)
    ring = sel.cp_exposed("forward")
    assert ring > 0
    assert sel.comm_part("backward", 0, ("cp",)) == pytest.approx(none.comm_part("backward", 0, ("cp",))
                                                                   + 16 * ring)     # 16 layers on stage 0
    # ZB-H1 with dp_overlap: the end-of-step sync overlaps the rank's last action, its W
    zb = StepCosts(model_preset("gpt3-175b"), hw, Layout(tp=8, pp=4, dp=2, dp_overlap=True), 4)
    t = zb.sync.grad_sync([0])
    assert zb.exposed_grad_sync([0], "backward_weight") == pytest.approx(max(0.0, t - zb.action("backward_weight", 0)))


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("1f1b", 2), ("gpipe", 1), ("zb-h1", 1)])
def test_the_planners_simulation_is_the_replay_of_the_built_program(name, v):
    # pipeline_time runs the schedule with the replay's rules (receives posted in the merged order, a message
    # moving once both ends posted it, the tied exchange, sync and Adam at the end): the same step to float
    # rounding, without building the program. With every receive posted early (simulation.simulate, a message
    # arriving its time after its sender finished) the pipeline ends earlier, here 0.1-0.9%: a receive posted late
    # pays the whole transfer after it
    from parlab.cluster.pipeline_time import _ends, _shape, schedule_for, simulated_step
    from parlab.cluster.replay import step_time
    from parlab.cluster.scaleup import scaleup
    from parlab.cluster.costs import ModelSpec
    from parlab.parallel.pipeline.simulation import simulate
    model = ModelSpec("m", layers=16, hidden=1024, heads=16, vocab=50000, seq=2048, tied=True, kv_heads=8)
    hw, layout = hardware_preset("dgx-h100"), Layout(tp=2, pp=4, dp=2, virtual=v, zero=1, sequence_parallel=True)
    costs, schedule = StepCosts(model, hw, layout, 4 * v), schedule_for(name, 4, 8, v)
    replayed = step_time(scaleup(schedule, model, hw, layout))
    assert simulated_step(costs, 8, name) == pytest.approx(replayed, rel=1e-12)
    ops = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
    early = simulate(schedule, lambda a: costs.action(ops[a.kind], a.stage), comm=costs.message()).makespan
    _, actions, needs, sends = _shape(name, 4, 8, v)
    posted = _ends(needs, sends, [[costs.action(*a) for a in r] for r in actions], costs.message())[0]
    assert early < max(posted)
