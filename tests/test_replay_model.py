"""The virtual cluster's compute model: kernel-level efficiency vs end-to-end MFU, the two-level memory model and
its calibration fit, JSON back-compatibility, and the split of a span at its communication by metered work."""
import dataclasses
import json
import statistics

import pytest
import torch

import parlab
from parlab import comm
from parlab.cluster.calibrate import fit_compute
from parlab.cluster.hardware import Hardware, load, hardware_preset
from parlab.trace.histogram import hist_add, hist_sub, size_class
from parlab.cluster.replay import replay
from parlab.trace import Event, Trace, count_costs, recording, region

# Round numbers: 10 GFLOP/s (batched products 4), 20 GB/s for ops whose working set fits in 1 MiB, 5 GB/s beyond,
# 2 us per kernel.
TWO = Hardware("two-level", peak_flops=1e10, mem_bw=5e9, intra_bw=1e9, inter_bw=1e9, efficiency=1.0,
               mem_efficiency=1.0, kernel_overhead=2e-6, cache_bw=2e10, cache_bytes=2.0 ** 20, bmm_flops=4e9)
# Only FLOPs cost time (one FLOP per second); memory, kernels and communication are free.
FLOPS_ONLY = Hardware("flops", peak_flops=1.0, mem_bw=1e300, intra_bw=1e300, inter_bw=1e300, efficiency=1.0,
                      mem_efficiency=1.0, base_latency=0.0, intra_latency=0.0, inter_latency=0.0)


def _pipeline_pattern(p, m):
    """On every rank: one tiny 1F1B step (the program a scale-up replays)."""
    from parlab.parallel import pipeline as sch
    from parlab.models import GPT, GPTConfig
    from parlab.parallel.pipeline import PipelineParallel
    cfg = GPTConfig(vocab_size=32, seq_len=8, n_layer=2 * p, n_head=2, n_embd=16)
    x = torch.randint(32, (m, 8), generator=torch.Generator().manual_seed(0))     # (m, S)
    PipelineParallel(GPT(cfg, seed=0), sch.one_f_one_b(p, m)).step(x, x)


# ---------------------------------------------------------------------- efficiency vs MFU
def test_presets_split_kernel_efficiency_from_end_to_end_mfu():
    for name in ("dgx-a100", "dgx-h100"):
        h = hardware_preset(name)
        assert (h.efficiency, h.mfu, h.end_to_end_mfu) == (0.8, 0.5, 0.5)
        # the replay's products run at the kernel-level rate
        assert h.compute_time(1e12) == pytest.approx(1e12 / (h.peak_flops * 0.8), rel=1e-12)
    assert hardware_preset("dgx-h100").with_(mfu=None).end_to_end_mfu == 0.8        # no MFU given: the one efficiency


def test_an_old_description_with_one_efficiency_loads_meaning_what_it_meant(tmp_path):
    old = {"name": "old A100", "peak_flops": 312e12, "mem_bw": 2.039e12, "intra_bw": 300e9, "inter_bw": 25e9,
           "gpus_per_node": 8, "efficiency": 0.5, "mem_efficiency": 0.8, "kernel_overhead": 0.0,
           "base_latency": 8.4e-6, "intra_latency": 5.7e-6, "inter_latency": 6.6e-6, "source": "",
           "p2p_bw": None, "p2p_latency": None}                 # the fields a file had before the split
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    h = load(str(path))
    # the one factor meant both: the replay's compute rate and the planner's MFU
    assert h.efficiency == 0.5 and h.end_to_end_mfu == 0.5 and h.mfu is None and h.cache_bw is None
    F, M, K = 3e12, 4e9, 7
    assert h.compute_time(F, M, K) == F / (312e12 * 0.5) + M / (2.039e12 * 0.8)        # the old formula, exactly
    h.save(str(path))
    assert load(str(path)) == h                                 # and it round-trips with the new fields
    new = TWO.with_(mfu=0.4)
    new.save(str(path))
    assert load(str(path)) == new


@pytest.mark.parametrize("change, words", [
    (dict(mfu=0.0), "mfu is a fraction"),
    (dict(mfu=True), "mfu is a fraction"),
    (dict(cache_bw=-1.0), "cache_bw must be a positive rate"),
    (dict(cache_bytes=-4), "cache_bytes must be a size >= 0"),
    (dict(bmm_flops=0), "bmm_flops must be a positive rate"),
])
def test_bad_mfu_and_cache_fields_are_refused_with_the_field_named(change, words):
    with pytest.raises(ValueError, match=words):
        TWO.with_(**change)


def test_compare_gives_the_planner_the_replays_cost_model():
    from parlab.cluster.costs import model_preset
    from parlab.cluster.scaleup import Layout, compare
    tr = parlab.run(_pipeline_pattern, 2, 2, 4, trace=True, echo=False).trace
    model, lay, a100 = model_preset("llama-7b"), Layout(tp=8, pp=2), hardware_preset("dgx-a100")
    base = compare(tr, model, a100, lay, 4)
    faster = compare(tr, model, a100.with_(efficiency=0.9), lay, 4)     # faster kernels: both move
    assert faster["planner_s"] < base["planner_s"] and faster["replay_s"] < base["replay_s"]
    lower = compare(tr, model, a100.with_(mfu=0.25), lay, 4)            # the end-to-end MFU: neither reads it
    assert lower["replay_s"] == base["replay_s"] and lower["planner_s"] == base["planner_s"]


# ---------------------------------------------------------------------- two-level memory
def test_size_classes_and_histograms():
    assert [size_class(n) for n in (1, 2, 3, 1023, 1024, 12 << 20)] == [0, 1, 1, 9, 10, 23]
    a, b = ((3, 10), (5, 4)), ((3, 10), (7, 1))
    assert hist_add(a, b) == ((3, 20), (5, 4), (7, 1)) and hist_sub(a, b) == ((5, 4), (7, -1))
    assert hist_sub(a, a) == ()


def test_two_level_memory_charges_cache_sized_ops_at_the_cache_rate():
    small, big = 12 << 10, 12 << 20                              # working sets of 12 KiB and 12 MiB
    hist = ((size_class(small), small), (size_class(big), big))
    # exact to float rounding: small at 20 GB/s (its class 2^13..2^14 fits in 1 MiB), big at 5 GB/s, 2 kernels
    assert TWO.compute_time(0.0, small + big, 2, hist) == pytest.approx(small / 2e10 + big / 5e9 + 4e-6, rel=1e-12)
    # a class counts as cached only when all of it fits: [2^20, 2^21) does not fit in 2^20 bytes
    assert TWO.cached_bytes(((19, 5), (20, 7))) == 5
    # without a histogram (an unmetered span, a scaled-up one) or without a cache level: every byte at mem_bw
    assert TWO.compute_time(0.0, small, 1) == pytest.approx(small / 5e9 + 2e-6, rel=1e-12)
    assert TWO.with_(cache_bw=None).compute_time(0.0, small, 1, hist[:1]) == pytest.approx(small / 5e9 + 2e-6,
                                                                                          rel=1e-12)


def test_batched_products_run_at_their_own_rate():
    # exact to float rounding: 1e9 plain FLOPs at 10 GFLOP/s, 4e8 batched at 4 GFLOP/s, one kernel
    assert TWO.compute_time(1.4e9, 0, 1, (), 4e8) == pytest.approx(0.1 + 0.1 + 2e-6, rel=1e-12)
    assert TWO.with_(bmm_flops=None).compute_time(1.4e9, 0, 1, (), 4e8) == pytest.approx(0.14 + 2e-6, rel=1e-12)


def _samples(hw):
    """(flops, bytes, kernels, seconds, working set, batched flops) of products, batched products and adds from
    12 B to 48 MiB, timed by `hw`."""
    out = [(f, 0, 1, hw.compute_time(f, 0, 1), 0, 0.0) for f in (1e6, 1e8, 1e9)]
    out += [(f, 0, 1, hw.compute_time(f, 0, 1, (), f), 0, f) for f in (1e6, 1e8)]
    for ws in (12 * 4 ** k for k in range(0, 12)):
        out.append((0.0, ws, 1, hw.compute_time(0.0, ws, 1, ((size_class(ws), ws),)), ws, 0.0))
    return out


def test_calibration_fit_recovers_a_two_level_memory_from_exact_samples():
    got = fit_compute(_samples(TWO))
    # exact data: least squares recovers every rate up to rounding, and the cache size as a power of two
    assert got["cache_bytes"] == 2.0 ** 20
    for k, v in (("peak_flops", 1e10), ("bmm_flops", 4e9), ("mem_bw", 5e9), ("cache_bw", 2e10),
                 ("kernel_overhead", 2e-6)):
        assert got[k] == pytest.approx(v, rel=1e-6), k
    one = fit_compute(_samples(TWO.with_(cache_bw=None)))      # one bandwidth: no cache level is invented
    assert one["cache_bw"] is None and one["mem_bw"] == pytest.approx(5e9, rel=1e-6)


def test_the_meter_records_bytes_by_working_set():
    x, y = torch.ones(1 << 14), torch.ones(1 << 14)
    q, k = torch.ones(4, 8, 2), torch.ones(4, 2, 8)                  # (b, m, k) @ (b, k, n)
    with recording() as rec:
        with count_costs():
            with region("add"):
                x + y
            with region("given", nbytes=5):
                x + y
            with region("products"):
                q @ k
                q[0] @ k[0]
    add, given, products = rec.events
    assert (products.flops, products.batched_flops) == (2 * 4 * 8 * 8 * 2 + 2 * 8 * 8 * 2, 2 * 4 * 8 * 8 * 2)
    ws = 3 * (1 << 14) * 4                                      # two inputs and the output, float32
    assert (add.nbytes, add.kernels, add.mem_hist) == (ws, 1, ((size_class(ws), ws),))
    assert given.nbytes == 5 and given.mem_hist == ()           # bytes given by hand: no histogram to trust
    assert add.meter_at[:3] == (0.0, ws, 1) and given.meter_at[:3] == (0.0, 2 * ws, 2)
    assert products.meter_at[4] == products.batched_flops


# ---------------------------------------------------------------------- splitting a span by metered work
def _span_around_collective(n_before, n_after):
    """On every rank: one region that multiplies (n_before)^3, all-reduces, multiplies (n_after)^3."""
    a, b = torch.ones(n_before, n_before), torch.ones(n_after, n_after)
    with count_costs():
        with region("step"):
            a @ a
            comm.all_reduce(torch.ones(4))
            b @ b
    return None


def test_a_span_cut_at_its_collective_is_split_by_metered_flops():
    tr = parlab.run(_span_around_collective, 2, 16, 8, trace=True, echo=False).trace
    out = replay(tr, FLOPS_ONLY)
    for r in range(2):
        pieces = [e for e in out.events if e.rank == r and e.op == "step"]
        # one FLOP per second: each piece lasts exactly the FLOPs of its product, however long it took here
        assert [p.duration for p in pieces] == [2 * 16 ** 3, 2 * 8 ** 3]


def test_the_split_does_not_depend_on_measured_durations():
    # a span of 10 FLOPs whose collective came after 2 of them (meter totals), measured at 10% or 90% of it
    def trace(cut_at):
        span = Event(0, "compute", "step", 0.0, 1.0, flops=10.0, kernels=2, meter_at=(10.0, 0, 2, (), 0.0))
        call = Event(0, "collective", "all_reduce", cut_at, cut_at, group=(0,), meter_at=(2.0, 0, 1, (), 0.0))
        return Trace([span, call])
    durations = [[e.duration for e in replay(trace(t), FLOPS_ONLY).events if e.op == "step"] for t in (0.1, 0.9)]
    assert durations[0] == durations[1] == [2.0, 8.0]
    # without the meter's totals the measured durations decide (the old rule, still used for unmetered traces)
    bare = Trace([dataclasses.replace(e, meter_at=()) for e in trace(0.1).events])
    assert [e.duration for e in replay(bare, FLOPS_ONLY).events if e.op == "step"] == pytest.approx([1.0, 9.0])


def test_scale_work_keeps_the_split_consistent_and_drops_the_size_classes():
    from parlab.cluster.scaleup import scale_work
    span = Event(0, "compute", "step", 0.0, 1.0, flops=10.0, nbytes=100, kernels=2, mem_hist=((6, 100),),
                 batched_flops=1.0, meter_at=(10.0, 100, 2, ((6, 100),), 1.0))
    call = Event(0, "collective", "all_reduce", 0.5, 0.5, group=(0,), meter_at=(4.0, 40, 1, ((6, 40),), 0.0))
    big = scale_work(Trace([span, call]), flops=3.0, mem_bytes=2.0)
    s, c = sorted(big.events, key=lambda e: e.kind)[::-1]       # compute first
    assert (s.flops, s.nbytes, s.mem_hist, s.batched_flops, s.meter_at) == (30.0, 200, (), 3.0, (30.0, 200.0, 2, (), 3.0))
    assert c.meter_at == (12.0, 80.0, 1, (), 0.0)
    hw = FLOPS_ONLY.with_(mem_bw=1.0)                            # a FLOP and a byte cost a second each
    assert [e.duration for e in replay(big, hw).events if e.op == "step"] == pytest.approx([12 + 80, 18 + 120])


def test_scale_work_scales_the_optimizers_bytes_by_the_parameters_not_the_tokens():
    # lesson 02's 1.3B replay: activation traffic grows with tokens x layers x h, the optimizer's with parameters
    from parlab.cluster.scaleup import scale_work
    fwd = Event(0, "compute", "forward", 0.0, 1.0, flops=10.0, nbytes=100)
    opt = Event(0, "compute", "optimizer", 1.0, 2.0, flops=1.0, nbytes=50)
    big = {e.op: e for e in scale_work(Trace([fwd, opt]), flops=3.0, mem_bytes=2.0, optimizer_bytes=7.0).events}
    assert (big["forward"].nbytes, big["optimizer"].nbytes) == (200, 350)
    assert big["optimizer"].flops == 3.0
    same = {e.op: e for e in scale_work(Trace([fwd, opt]), flops=3.0, mem_bytes=2.0).events}
    assert same["optimizer"].nbytes == 100                    # without it, the one factor as before
    with pytest.raises(ValueError, match="optimizer_bytes must be a positive factor"):
        scale_work(Trace([fwd, opt]), optimizer_bytes=0)


# ---------------------------------------------------------------------- work outside every region
def _work_between_regions(n_in, n_out):
    """On every rank: a product in a region, another outside any region, then an all-reduce and a wait."""
    a, b = torch.ones(n_in, n_in), torch.ones(n_out, n_out)
    with count_costs():
        with region("inside"):
            a @ a
        b @ b                                                   # no region: only the meter sees it
        work = comm.all_reduce(torch.ones(4), async_op=True)
        b @ b @ b                                               # two more products before the wait
        work.wait()


def test_metered_work_outside_every_region_is_replayed_where_it_ran():
    tr = parlab.run(_work_between_regions, 2, 16, 8, trace=True, echo=False).trace
    out = replay(tr, FLOPS_ONLY)
    for r in range(2):
        evs = [e for e in out.events if e.rank == r and e.kind == "compute"]
        # one FLOP per second: the region's product, the product before the call, the two before the wait
        assert [(e.op, e.duration) for e in evs] == [("inside", 2 * 16 ** 3), ("untraced", 2 * 8 ** 3),
                                                     ("untraced", 2 * 2 * 8 ** 3)]
        assert evs[1].end <= next(e for e in out.events if e.rank == r and e.op == "all_reduce").start
    kept = replay(tr, FLOPS_ONLY, untraced=False)                 # the old rule: only the regions' work
    assert [e.op for e in kept.events if e.kind == "compute"] == ["inside", "inside"]


def _two_metered_fsdp_steps():
    """On every rank: a warm-up step, then two metered ZeRO-3 steps, each in its own recorder."""
    from parlab.parallel.zero import FullyShardedDataParallel
    from parlab.models import GPT, GPTConfig
    model = FullyShardedDataParallel(GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, n_embd=16), seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(comm.get_rank()))   # (B, S)
    out = []
    for i in range(3):
        with recording() as rec:
            with count_costs():
                with region("forward"):                       # its all-gathers cut it into pieces
                    _, loss = model(x, x)
                with region("backward"):
                    loss.backward()
                with region("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        out.append([dataclasses.asdict(e) for e in rec.events])
    return out[1:]


def test_two_runs_of_the_same_program_replay_to_the_same_time():
    res = parlab.run(_two_metered_fsdp_steps, 2, echo=False)
    steps = [Trace([Event(**{**d, "group": tuple(d["group"])}) for rank in res.results for d in rank[i]])
             for i in range(2)]
    assert sum(1 for e in steps[0].events if e.kind == "collective") > 4      # spans are cut by communication
    a, b = (replay(t, hardware_preset("dgx-h100")) for t in steps)
    # the same work in the same order: the same replayed times (float rounding of the running sums only),
    # although the two steps took different times here
    assert [(e.rank, e.op) for e in a.events] == [(e.rank, e.op) for e in b.events]
    for ea, eb in zip(a.events, b.events):
        assert ea.start == pytest.approx(eb.start, rel=1e-9, abs=1e-15)
        assert ea.end == pytest.approx(eb.end, rel=1e-9, abs=1e-15)


def test_the_link_fit_keeps_the_latency_of_small_messages_when_a_large_one_is_noisy():
    from parlab.cluster.calibrate import fit_alpha_beta
    alpha, bw, n = 3e-5, 2e9, 2
    sizes = [4 * 4 ** k for k in range(12)]                              # 4 B .. 16 MiB, as calibrate measures
    rows = [(x, (alpha + x / bw) * (1.2 if x == sizes[-1] else 1.0)) for x in sizes]   # the largest 20% slow
    a, b = fit_alpha_beta(rows, n, factor=1.0)
    # on relative error one slow point moves the fit little: the latency within 5%, the bandwidth within 10%
    # (on absolute error the 1.7 ms excess of the 16 MiB message sets the intercept: it comes out negative)
    assert a == pytest.approx(alpha, rel=0.05) and b == pytest.approx(bw, rel=0.1)


# ---------------------------------------------------------------------- records round trip
def test_a_metered_trace_rebuilt_from_json_records_keeps_what_a_replay_needs():
    from parlab import viz
    tr = parlab.run(_work_between_regions, 2, 16, 8, trace=True, echo=False).trace
    spans = [e for e in tr.events if e.kind == "compute"]
    assert spans and all(e.mem_hist is not None for e in spans)
    assert all(len(e.meter_at) == 7 for e in tr.events)                  # every event carries the running totals
    assert any(e.meter_waited for e in tr.events if e.asynchronous)       # the async all-reduce was waited for
    back = viz.from_records(json.loads(json.dumps(tr.records(relative=False))))
    # every field, the new ones included (mem_hist, batched_flops, special, plain_kernels, meter_at, meter_waited),
    # comes back as Event keeps it (JSON turns the tuples into lists)
    assert back.events == tr.events
    assert replay(back, TWO).events == replay(tr, TWO).events


def test_a_bmm_span_keeps_its_batched_flops_and_size_classes_through_records():
    from parlab import viz
    e = Event(0, "compute", "attn", 0.0, 1.0, flops=8.0, nbytes=96, kernels=3, mem_hist=((5, 32), (6, 64)),
              batched_flops=6.0, meter_at=(8.0, 96, 3, ((5, 32), (6, 64)), 6.0))
    (back,) = viz.from_records(json.loads(json.dumps(Trace([e]).records(relative=False)))).events
    assert back == e
    assert TWO.compute_time(back.flops, back.nbytes, back.kernels, back.mem_hist, back.batched_flops) \
        == TWO.compute_time(e.flops, e.nbytes, e.kernels, e.mem_hist, e.batched_flops)


# ---------------------------------------------------------------------- scale-up: memory-bound ops, optimizer
def test_memory_bound_bytes_per_layer_follow_the_op_list():
    from parlab.cluster.costs import ModelSpec
    from parlab.cluster.scaleup import attention_core_bytes, layer_forward_bytes
    m = ModelSpec("t", layers=2, hidden=8, heads=2, vocab=16, seq=4)            # f = 4h = 32
    b, s, h, a, f = 1, 4, 8, 2, 32
    E, A, F = b * s * h, a * b * s * s, b * s * f
    # norms 8E, residual adds 12E, dropouts 10E (16-bit elements, 1-byte masks), softmax 4A, its dropout 5A, GeLU 4F
    assert layer_forward_bytes(m, b) == 8 * E + 12 * E + 10 * E + 4 * A + 5 * A + 4 * F
    assert attention_core_bytes(m, b) == 9 * A
    assert layer_forward_bytes(m, b, dropout=False) == 20 * E + 4 * A + 4 * F
    # tp 2: A and F split; E split only with sequence parallelism
    assert layer_forward_bytes(m, b, tp=2) == 30 * E + (9 * A + 4 * F) / 2
    assert layer_forward_bytes(m, b, tp=2, sequence_parallel=True) == (30 * E + 9 * A + 4 * F) / 2
    sw = ModelSpec("s", layers=2, hidden=8, heads=2, vocab=16, seq=4, ffn=32, swiglu=True, bias=False)
    assert layer_forward_bytes(sw, b) - layer_forward_bytes(m, b) == 6 * F      # SiLU 4F + product 6F vs GeLU 4F


def test_the_scaleup_adds_an_adam_step_over_each_ranks_parameters():
    from parlab.cluster.costs import model_preset
    from parlab.cluster.scaleup import OPTIMIZER_BYTES_PER_PARAM, Layout, scaleup
    tr = parlab.run(_pipeline_pattern, 2, 2, 4, trace=True, echo=False).trace
    model, a100 = model_preset("llama-7b"), hardware_preset("dgx-a100")
    out = scaleup(tr, model, a100, Layout(tp=8, pp=2), dropout=False)
    opt = sorted((e for e in out.events if e.op == "optimizer"), key=lambda e: e.rank)
    psi0 = 16 * model.layer_params(8) + model.embedding_params(8)               # stage 0: 16 layers + embedding
    assert opt[0].duration == pytest.approx(OPTIMIZER_BYTES_PER_PARAM * psi0 / (a100.mem_bw * a100.mem_efficiency),
                                            rel=1e-12)
    base = scaleup(tr, model, a100, Layout(tp=8, pp=2), memory_ops=False, optimizer=False)
    # each extra cost only adds time
    no_opt = scaleup(tr, model, a100, Layout(tp=8, pp=2), optimizer=False, dropout=False)
    assert step_of(out) > step_of(no_opt) > step_of(base)
    assert step_of(scaleup(tr, model, a100, Layout(tp=8, pp=2))) == step_of(out)   # LLaMA trains without dropout
    assert step_of(scaleup(tr, model, a100, Layout(tp=8, pp=2), dropout=True)) > step_of(out)   # its bytes add time


def step_of(tr):
    from parlab.cluster.replay import step_time
    return step_time(tr)


# ---------------------------------------------------------------------- calibration from training steps
_STEPS = [(5e7, 1e7, 517, ((12, 4e6), (22, 8e6)), 4e6), (4e8, 5e7, 517, ((14, 1e7), (24, 4e7)), 3e7),
          (2e8, 3.6e7, 746, ((13, 6e6), (25, 3e7)), 4e7), (6.5e8, 5.4e7, 288, ((10, 4e6), (21, 5e7)), 2e7),
          (3e8, 3.5e7, 517, ((11, 5e6), (23, 3e7)), 1e7)]
# five steps of different mixes of products, batched products, bytes (in two size classes) and ops


def _step_rows(c, beta, gamma, noise=(1.0,) * 5):
    """Step samples whose times follow the step model: products at TWO's times x gamma, memory at TWO's times x
    beta, c per op (times a noise factor per step)."""
    return [(f, b, k, z * (gamma * TWO.compute_time(f, 0, 0, (), fb) + beta * TWO.compute_time(0, b, 0, h) + k * c),
             h, fb) for (f, b, k, h, fb), z in zip(_STEPS, noise)]


def test_the_step_fit_recovers_the_per_op_cost_and_the_factors_from_exact_samples():
    from parlab.cluster.calibrate.step import apply_step_fit, fit_step
    c, beta, gamma = 7e-6, 2.5, 1.4
    got = fit_step(TWO, _step_rows(c, beta, gamma))
    # exact samples: only the full model predicts the left-out steps, and its fit is exact up to rounding
    assert got["model"] == ("c", "beta", "gamma") and got["cv"] < 1e-9
    assert min(e for m, e in got["cv_all"].items() if m != got["model"]) > 1e-3
    assert (got["c"], got["beta"], got["gamma"]) == pytest.approx((c, beta, gamma), rel=1e-6)
    hw = apply_step_fit(TWO, got["c"], got["beta"], got["gamma"])
    assert (hw.mem_bw, hw.cache_bw) == pytest.approx((TWO.mem_bw / beta, TWO.cache_bw / beta), rel=1e-6)
    assert (hw.peak_flops, hw.bmm_flops) == pytest.approx((TWO.peak_flops / gamma, TWO.bmm_flops / gamma), rel=1e-6)
    for f, b, k, t, h, fb in _step_rows(c, beta, gamma):                # the fitted description times each step
        assert hw.compute_time(f, b, k, h, fb) == pytest.approx(t, rel=1e-6)
    with pytest.raises(ValueError, match="at least 4"):
        fit_step(TWO, _step_rows(c, beta, gamma)[:3])


def test_the_step_fit_weights_the_per_op_model_most_when_the_larger_ones_fit_noise():
    from parlab.cluster.calibrate.step import fit_step
    # steps that follow the per-op model (single-op rates right, 20 us per op), each timed up to 7% off: here the
    # larger models bend to the noise and predict the left-out steps worse (leave-one-out errors 8.3% against
    # 12-13%), so the per-op model gets the largest weight (with other noise a larger model can win)
    c = 2e-5
    rows = _step_rows(c, 1.0, 1.0, noise=(1.06, 0.95, 0.93, 1.05, 1.02))
    got = fit_step(TWO, rows)
    assert got["model"] == ("c",) and got["cv"] == min(got["cv_all"].values())
    w, cv = got["weights"], got["cv_all"]
    assert max(w, key=w.get) == ("c",) and sum(w.values()) == pytest.approx(1.0)
    for m in cv:                                           # weights inverse to the squared leave-one-out errors
        assert w[m] * cv[m] ** 2 == pytest.approx(w[("c",)] * cv[("c",)] ** 2, rel=1e-9)
    assert got["c"] == pytest.approx(c, rel=0.25)          # 7% noise on steps of which the ops are 7-60%
    # the average lies between the models' own fits, beta and gamma near 1 (the per-op model holds them at 1)
    assert 0.85 < got["beta"] < 1.15 and 0.85 < got["gamma"] < 1.15


def test_step_samples_time_the_shapes_round_by_round(monkeypatch):
    """A load change during calibration must shift every shape alike: the timed repetitions go round the shapes
    (one step of each, then the next round), each part's time (forward + backward, optimizer) is the median of
    its own repetitions, two rows per shape."""
    import parlab.cluster.calibrate.step as cs
    calls, clock = [], [0.0]

    def fake_step(n_embd, *_, parts=False):
        assert parts                                              # timed in two parts
        def part(j):
            def run():
                calls.append((n_embd, j))
                clock[0] += n_embd * 1e-3 * (1 + j) * (1 + len(calls) % 3)   # repetitions differ: the median picks
            return run
        return part(0), part(1)
    monkeypatch.setattr(cs, "_gpt_step", fake_step)
    monkeypatch.setattr(cs.time, "perf_counter", lambda: clock[0])
    rounds, after = [], []
    got = cs.step_samples(shapes=((10,), (20,), (30,)), reps=3, barrier=lambda: rounds.append(len(calls)),
                          between=lambda: after.append(len(calls)))
    # per shape: two warm-up steps and one metered step (each part in turn), then 3 rounds of every shape's
    # two parts, a barrier before each round
    one = lambda n: [(n, 0), (n, 1)]
    assert calls == sum((one(n) * 3 for n in (10, 20, 30)), []) + sum((one(n) for n in (10, 20, 30)), []) * 3
    assert rounds == [18, 24, 30]
    assert after == [24, 30, 36]                                  # `between` after each round, outside the timing
    times = {(n, j): [] for n in (10, 20, 30) for j in (0, 1)}
    for i, (n, j) in enumerate(calls[18:], start=19):
        times[(n, j)].append(n * 1e-3 * (1 + j) * (1 + i % 3))
    assert [row[3] for row in got] == pytest.approx([sorted(times[(n, j)])[1] for n in (10, 20, 30) for j in (0, 1)])
    assert [row[8] for row in got] == list(cs.PARTS) * 3


# ---------------------------------------------------------------------- communication that takes the rank's core
def _ring_step(msg_bytes, flops):
    """Two ranks: each issues a send to the other and a receive from it, computes, then waits for both."""
    evs = []
    for r in (0, 1):
        o = 1 - r
        evs += [Event(r, "p2p", "send", 0.0, 0.0, group=(0, 1), peer=o, nbytes=msg_bytes, asynchronous=True,
                      waited=2.0),
                Event(r, "p2p", "recv", 0.0, 0.0, group=(0, 1), peer=o, nbytes=msg_bytes, asynchronous=True,
                      waited=2.0),
                Event(r, "compute", "attn", 0.5, 1.5, flops=flops)]
    return Trace(evs)


def test_without_overlap_an_async_message_holds_its_rank_and_a_send_receive_pair_counts_once():
    # 1 byte/s links without latency, 1 FLOP/s: messages of 3 s, a compute span of 5 s
    hw = FLOPS_ONLY.with_(intra_bw=1.0, inter_bw=1.0)
    overlapped = replay(_ring_step(3, 5.0), hw)
    assert overlapped.events and max(e.end for e in overlapped.events) == 5.0            # the messages hide
    serial = replay(_ring_step(3, 5.0), hw.with_(comm_overlap=False))
    for r in (0, 1):
        (span,) = [e for e in serial.events if e.rank == r and e.kind == "compute"]
        assert (span.start, span.end) == (3.0, 8.0)          # after the pair's 3 s, not 6 s: issued together
    with pytest.raises(ValueError, match="comm_overlap must be true or false"):
        hw.with_(comm_overlap="no")
    assert hardware_preset("dgx-h100").comm_overlap is True
    old = {k: v for k, v in hardware_preset("dgx-a100").to_dict().items() if k != "comm_overlap"}
    assert Hardware.from_dict(old).comm_overlap is True     # a description written before the field: overlap


def _per_rank(exposed_fraction):
    """One rank's calibration measurements, synthetic and exact: links of 30 us + X / 1 GB/s (p2p) and
    100 us + X / 2 GB/s (all-reduce, 2 ranks), single ops and training steps at TWO's rates (steps: 20 us per op),
    and compute slowed by `exposed_fraction` x the message time while a ring step's messages are in flight."""
    from parlab.cluster.calibrate import SIZES
    lat, bw = 3e-5, 1e9
    allreduce = [(x, 1e-4 + x / 2e9) for x in SIZES]
    p2p = [(x, lat + x / bw) for x in SIZES]
    samples = [(2.0 * n ** 3, 0, 1, TWO.compute_time(2.0 * n ** 3, 0, 1), 0, 0.0) for n in (32, 64, 128, 256)]
    samples += [(2.0 * 4 * 64 ** 3, 0, 1, TWO.compute_time(2.0 * 4 * 64 ** 3, 0, 1, (), 2.0 * 4 * 64 ** 3), 0,
                 2.0 * 4 * 64 ** 3)]
    for numel in (1 << 10, 1 << 14, 1 << 16, 1 << 20, 1 << 22, 1 << 23):
        nbytes = 12 * numel
        samples.append((0.0, nbytes, 1, TWO.compute_time(0, nbytes, 1, ((size_class(nbytes), nbytes),)), nbytes, 0.0))
    steps = [(f, b, k, TWO.compute_time(f, b, 0, h, fb) + k * 2e-5, h, fb) for f, b, k, h, fb in _STEPS]
    overlap = [(x, 3e-3, 3e-3 + exposed_fraction * (lat + x / bw)) for x in (1 << 12, 1 << 16, 1 << 18, 1 << 20)]
    return {"allreduce": allreduce, "p2p": p2p, "samples": samples, "steps": steps, "overlap": overlap}


def test_a_calibration_says_how_many_torch_threads_its_ranks_ran():
    """A CPU's rates depend on the threads per rank (parlab.run forks ranks of one; torchrun leaves torch's default),
    so the description's source says it; measurements without the count (written before) say nothing."""
    from parlab.cluster.calibrate import describe
    one = {**_per_rank(1.0), "threads": 1}
    assert "on 2 ranks (1 torch thread each)" in describe([one] * 2, 2, "synthetic")[0].source
    two = {**_per_rank(1.0), "threads": 2}
    assert "on 2 ranks (2 torch threads each)" in describe([two] * 2, 2, "synthetic")[0].source
    assert "(1/2 torch threads each)" in describe([one, two], 2, "synthetic")[0].source
    assert "thread" not in describe([_per_rank(1.0)] * 2, 2, "synthetic")[0].source


def test_calibration_describes_overlap_and_the_step_fit_from_its_measurements():
    from parlab.cluster.calibrate import describe
    serial, text = describe([_per_rank(1.0)] * 2, 2, "synthetic")
    assert serial.comm_overlap is False and "comm_overlap False" in text
    assert serial.kernel_overhead == pytest.approx(2e-5, rel=1e-3)      # the steps' per-op cost, not the single ops'
    assert serial.p2p_latency == pytest.approx(3e-5, rel=1e-3) and serial.p2p_bw == pytest.approx(1e9, rel=1e-3)
    overlapped, _ = describe([_per_rank(0.05)] * 2, 2, "synthetic")
    assert overlapped.comm_overlap is True
    assert overlapped.p2p_latency == pytest.approx(3e-5, rel=1e-3)      # overlapping: the isolated fit stays
    # messages that slow the compute by twice their isolated time: inside a step they cost 60 us + X / 0.5 GB/s
    slow, text = describe([_per_rank(2.0)] * 2, 2, "synthetic")
    assert slow.comm_overlap is False and "p2p inside a step" in text
    assert slow.p2p_latency == pytest.approx(6e-5, rel=1e-3) and slow.p2p_bw == pytest.approx(5e8, rel=1e-3)
    # a slow-down of 5 ms whatever the size (a busy machine's scheduling): a latency at the isolated bandwidth
    flat = _per_rank(1.0)
    flat["overlap"] = [(x, 3e-3, 8e-3) for x, _, _ in flat["overlap"]]
    busy, _ = describe([flat] * 2, 2, "synthetic")
    sizes = [x for x, _, _ in flat["overlap"]]
    assert busy.comm_overlap is False and busy.p2p_bw == pytest.approx(1e9, rel=1e-3)
    assert busy.p2p_latency == pytest.approx(5e-3 - statistics.median(x / 1e9 for x in sizes), rel=1e-3)


@pytest.mark.parametrize("built", [False, True], ids=["traced", "built"])
def test_compare_replays_an_overlapped_gradient_sync(built):
    """dp_overlap=True replays (it once raised TypeError: a dict of per-rank end times took the name of the last
    backward op), on a traced and on a built program, and hides part of the gradient sync: never slower."""
    from parlab.cluster.costs import model_preset
    from parlab.cluster.scaleup import Layout, compare
    from parlab.parallel import pipeline as sch
    tr = sch.one_f_one_b(2, 4) if built else parlab.run(_pipeline_pattern, 2, 2, 4, trace=True, echo=False).trace
    model, h100 = model_preset("llama-7b"), hardware_preset("dgx-h100")
    plain = compare(tr, model, h100, Layout(tp=8, pp=2, dp=4), 16)
    hidden = compare(tr, model, h100, Layout(tp=8, pp=2, dp=4, dp_overlap=True), 16)
    assert hidden["replay_s"] < plain["replay_s"] and hidden["planner_s"] < plain["planner_s"]


def test_the_planner_reads_the_precision_the_replay_reads():
    """fp8 products on an H100 (its 1979 TFLOP/s): the replay and the planner both speed up, and still agree
    (to float rounding: the planner runs the schedule as the replay does); without hardware, precision is refused."""
    from parlab.cluster.costs import model_preset
    from parlab.cluster.planner import cluster_for, estimate
    from parlab.cluster.scaleup import Layout, compare
    from parlab.parallel import pipeline as sch
    model, h100 = model_preset("llama-7b"), hardware_preset("dgx-h100")
    got = {p: compare(sch.one_f_one_b(2, 8), model, h100, Layout(tp=4, pp=2, dp=2, precision=p), 16)
           for p in ("bf16", "fp8")}
    assert got["fp8"]["replay_s"] < 0.9 * got["bf16"]["replay_s"]
    for r in got.values():
        assert r["planner_s"] == pytest.approx(r["replay_s"], rel=1e-9)
    with pytest.raises(ValueError, match="give hardware"):
        estimate(model, cluster_for(h100, 16), 16, tp=4, pp=2, precision="fp8")
    with pytest.raises(ValueError, match="no 'fp8' rate"):
        estimate(model, cluster_for(hardware_preset("dgx-a100"), 16), 16, tp=4, pp=2, precision="fp8",
                 hardware=hardware_preset("dgx-a100"))
