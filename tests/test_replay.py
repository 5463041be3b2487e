"""The virtual cluster: hardware descriptions, the replay's dependency rules and closed forms, bad input."""
import dataclasses
import json

import pytest
import torch

import parlab
from parlab.parallel import pipeline as sch
from parlab.cluster.hardware import Hardware, load, hardware_preset
from parlab.models import GPT, GPTConfig
from parlab.parallel.pipeline import PipelineParallel
from parlab.cluster.replay import ReplayError, bubble, measured_step, replay, step_time
from parlab.parallel.topology import ParallelGrid
from parlab.trace import Event, Trace, count_costs, recording, region

# Unit hardware: one FLOP per second, free communication (bandwidth 1e300, no latency): replayed times are the
# FLOPs given to the spans, so closed forms hold exactly (up to float rounding of sums of small integers).
UNIT = Hardware("unit", peak_flops=1.0, mem_bw=1.0, intra_bw=1e300, inter_bw=1e300, efficiency=1.0,
                mem_efficiency=1.0, base_latency=0.0, intra_latency=0.0, inter_latency=0.0)
# A link model with round numbers: 1 GB/s inside a node, 0.1 GB/s across, 1 us per step, 10 us per call.
AB = Hardware("ab", peak_flops=1.0, mem_bw=1.0, intra_bw=1e9, inter_bw=1e8, gpus_per_node=4, efficiency=1.0,
              mem_efficiency=1.0, base_latency=1e-5, intra_latency=1e-6, inter_latency=2e-6)


def comp(rank, start, flops, op="compute", label=""):
    return Event(rank, "compute", op, start, start + 1.0, flops=flops, label=label)


def coll(rank, start, group, nbytes=0, op="all_reduce", asynchronous=False, waited=None, end=None):
    return Event(rank, "collective", op, start, start if end is None else end, group=tuple(group), nbytes=nbytes,
                 asynchronous=asynchronous, waited=waited)


def p2p(rank, start, op, peer, nbytes=0, asynchronous=False, waited=None):
    return Event(rank, "p2p", op, start, start, group=(0, 1), peer=peer, nbytes=nbytes, asynchronous=asynchronous,
                 waited=waited)


def by_rank(trace, rank, op=None):
    return [e for e in trace.events if e.rank == rank and (op is None or e.op == op)]


# ---------------------------------------------------------------------- hardware
def test_presets_carry_the_datasheet_numbers_and_round_trip_through_json(tmp_path):
    a, h = hardware_preset("dgx-a100"), hardware_preset("dgx-h100")
    assert (a.peak_flops, a.mem_bw, a.intra_bw, a.inter_bw) == (312e12, 2.039e12, 300e9, 25e9)
    assert (h.peak_flops, h.mem_bw, h.intra_bw, h.inter_bw) == (989e12, 3.35e12, 450e9, 50e9)
    path = tmp_path / "h.json"
    h.with_(efficiency=0.6).save(str(path))
    back = load(str(path))
    assert back == h.with_(efficiency=0.6) and back != h
    assert load("dgx-a100") is a


@pytest.mark.parametrize("change, words", [
    (dict(peak_flops=0), "peak_flops must be a positive rate"),
    (dict(efficiency=1.5), "efficiency is a fraction"),
    (dict(gpus_per_node=0), "gpus_per_node must be a positive integer"),
    (dict(inter_latency=-1.0), "inter_latency must be a time"),
    (dict(name=""), "name must be a non-empty string"),
])
def test_bad_hardware_is_refused_with_the_field_named(change, words):
    with pytest.raises(ValueError, match=words):
        hardware_preset("dgx-h100").with_(**change)


def test_bad_hardware_files_and_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware preset"):
        hardware_preset("tpu")
    with pytest.raises(ValueError, match="no hardware preset or file"):
        load(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**hardware_preset("dgx-a100").to_dict(), "nvlink": 1}))
    with pytest.raises(ValueError, match=r"unknown hardware field\(s\) \['nvlink'\]"):
        load(str(bad))
    bad.write_text(json.dumps({"name": "x", "peak_flops": 1.0}))
    with pytest.raises(ValueError, match="lacks mem_bw, intra_bw, inter_bw"):
        load(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load(str(bad))
    with pytest.raises(ValueError, match="no cost model for op 'allreduce'"):
        AB.collective_time("allreduce", 1, 4)


# ---------------------------------------------------------------------- collectives: the alpha-beta formula
@pytest.mark.parametrize("n, group_nodes", [(4, 1), (8, 2)])
def test_replayed_ring_all_reduce_is_the_alpha_beta_formula(n, group_nodes):
    X = 12_000_000
    tr = Trace([coll(r, 0.0, range(n), X) for r in range(n)])
    out = replay(tr, AB, compute_time=lambda e: 0.0)
    bw, hop = (AB.inter_bw, AB.inter_latency) if group_nodes > 1 else (AB.intra_bw, AB.intra_latency)
    if group_nodes > 1:   # 4 ranks on each node: one ring per network card, 4 cards in parallel (< NVLink's 1 GB/s)
        bw = 4 * AB.inter_bw
    ring = AB.base_latency + 2 * (n - 1) * hop + 2 * (n - 1) / n * X / bw   # alpha-beta, ring
    if group_nodes == 1:
        expected = ring
    else:   # across nodes NCCL may take a tree: 2 (log2(nodes) inter + (n/nodes - 1) intra) steps, 2 X / bw
        tree = AB.base_latency + 2 * (1 * AB.inter_latency + 3 * AB.intra_latency) + 2 * X / bw
        expected = min(ring, tree)
        assert AB.collective_time("all_reduce", X, n, True, 2, algorithm="ring") == pytest.approx(ring, rel=1e-12)
    for e in out.events:   # every member starts at 0 and ends together; rel 1e-12: float rounding only
        assert e.start == 0.0 and e.end == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("hw, per_node", [("dgx-a100", 8), ("dgx-h100", 8), ("dgx-a100", 2), ("dgx-h100", 1)])
@pytest.mark.parametrize("nics", [None, 4])
def test_a_group_with_several_ranks_per_node_crosses_nodes_on_all_their_network_cards(hw, per_node, nics):
    # NCCL gives every channel its own NIC, so a ring over whole nodes (FSDP, DP over nodes) moves its bytes across
    # the cards of its per_node GPUs at once, up to NVLink's rate inside the node (A100: 8 x 25 = 200 of NVLink's
    # 240 GB/s; H100: 8 x 50 = 400 over NVLink's 371, which bounds it); one rank per node gets its GPU's share
    h = hardware_preset(hw).with_(base_latency=0.0, inter_latency=0.0, intra_latency=0.0, nics_per_node=nics)
    X, nodes = 1e9, 4
    n, share = per_node * nodes, (nics or 8) / 8
    rs = min(per_node * share * h.inter_bw, h.intra_bw * h.intra_efficiency) if per_node > 1 else share * h.inter_bw
    factor = (n - 1) / n
    # rel 1e-9: float rounding only
    assert h.collective_time("reduce_scatter", X, n, True, nodes) == pytest.approx(factor * X / rs, rel=1e-9)
    # an all-to-all sends each rank's own bytes through its own share of the cards: no sum over rails; the bytes
    # for the per_node - 1 peers on its own node go over NVLink at the same time (the slower part sets the time)
    intra = h.intra_bw * h.intra_efficiency
    a2a = max(factor * X * (n - per_node) / (n - 1) / (share * h.inter_bw), factor * X * (per_node - 1) / (n - 1) / intra)
    assert h.collective_time("all_to_all", X, n, True, nodes) == pytest.approx(a2a, rel=1e-9)
    assert a2a < factor * X / (share * h.inter_bw) or per_node == 1     # it was all at the cards' rate
    if per_node == 8 and nics is None:
        assert rs / h.inter_bw == pytest.approx(8.0 if hw == "dgx-a100" else 18 * 20.6 / 50)
    with pytest.raises(ValueError, match="nics_per_node must be a positive integer"):
        h.with_(nics_per_node=0)


def test_other_collectives_use_their_ring_factors():
    n, X = 4, 8_000_000
    for op, steps, factor in (("all_gather", 3, 0.75), ("reduce_scatter", 3, 0.75), ("broadcast", 3, 1.0),
                              ("all_to_all", 3, 0.75)):
        assert AB.collective_time(op, X, n) == pytest.approx(AB.base_latency + steps * AB.intra_latency
                                                             + factor * X / AB.intra_bw, rel=1e-12)
    assert AB.collective_time("send", X, 2, True) == pytest.approx(AB.inter_latency + X / AB.inter_bw, rel=1e-12)


# ---------------------------------------------------------------------- dependency rules
def test_a_recv_waits_for_its_send():
    tr = Trace([comp(0, 0.0, 5.0), p2p(0, 1.0, "send", 1), p2p(1, 0.0, "recv", 0), comp(1, 0.5, 2.0)])
    out = replay(tr, UNIT)
    recv, after = by_rank(out, 1, "recv")[0], by_rank(out, 1, "compute")[0]
    assert (recv.start, recv.end) == (0.0, 5.0)        # posted at 0, the message leaves at 5
    assert (after.start, after.end) == (5.0, 7.0)


def test_a_collective_waits_for_all_its_members():
    tr = Trace([comp(0, 0.0, 3.0), coll(0, 1.0, (0, 1, 2)), comp(1, 0.0, 1.0), coll(1, 1.0, (0, 1, 2)),
                coll(2, 0.0, (0, 1, 2)), comp(2, 0.1, 1.0)])
    out = replay(tr, UNIT)
    for r in range(3):
        assert by_rank(out, r, "all_reduce")[0].end == 3.0
    assert by_rank(out, 2, "compute")[0].start == 3.0


def test_async_communication_overlaps_compute_and_the_wait_holds_what_follows():
    X = 4_000_000                                   # 2 (N-1)/N X / 1 GB/s = 4 ms on 2 ranks, plus latencies
    evs = []
    for r in range(2):
        evs += [coll(r, 0.0, (0, 1), X, asynchronous=True, waited=2.5, end=0.1),
                comp(r, 0.5, 0.001, op="backward"), comp(r, 3.0, 0.001, op="optimizer")]
    out = replay(Trace(evs), AB)
    t_ar = AB.collective_time("all_reduce", X, 2)
    for r in range(2):
        ar, bwd, opt = by_rank(out, r, "all_reduce")[0], by_rank(out, r, "backward")[0], by_rank(out, r, "optimizer")[0]
        assert ar.asynchronous and ar.start == 0.0 and ar.end == pytest.approx(t_ar)
        assert bwd.start == 0.0 and bwd.end == pytest.approx(0.001)       # overlaps the all-reduce
        assert opt.start == pytest.approx(t_ar) and ar.waited == pytest.approx(t_ar)   # after the wait


def test_a_compute_span_is_cut_at_the_blocking_call_inside_it():
    evs = [Event(0, "compute", "step", 0.0, 4.0, flops=8.0), coll(0, 1.0, (0, 1), end=3.0),
           Event(1, "compute", "late", 0.0, 1.0, flops=10.0), coll(1, 1.0, (0, 1), end=1.1)]
    out = replay(Trace(evs), UNIT)
    pieces = by_rank(out, 0, "step")        # measured 1 s before and 1 s after: the 8 FLOPs split 4 + 4
    assert [(p.start, p.end) for p in pieces] == [(0.0, 4.0), (10.0, 14.0)]


def test_collectives_on_one_group_run_in_order_on_its_stream():
    X = 1_000_000
    evs = []
    for r in range(2):
        evs += [coll(r, 0.0, (0, 1), X, asynchronous=True, waited=1.0, end=0.0),
                coll(r, 0.1, (0, 1), X, asynchronous=True, waited=1.0, end=0.1)]
    out = replay(Trace(evs), AB)
    first, second = by_rank(out, 0, "all_reduce")
    assert second.end == pytest.approx(2 * first.end)      # the second starts when the first is done
    # gloo's pool of two threads (comm_streams 2): the second runs beside the first, a third waits for a stream
    third = [coll(r, 0.2, (0, 1), X, asynchronous=True, waited=1.0, end=0.2) for r in range(2)]
    a, b, c = by_rank(replay(Trace(evs + third), AB.with_(comm_streams=2)), 0, "all_reduce")
    assert a.start == b.start == c.start == 0.0                # all issued at once (no compute between them)
    assert b.end == pytest.approx(a.end) and c.end == pytest.approx(2 * a.end)
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="comm_streams must be a positive integer"):
            AB.with_(comm_streams=bad)


# ---------------------------------------------------------------------- bad input
def test_bad_traces_are_refused_saying_what_is_wrong():
    with pytest.raises(ReplayError, match="needs a parlab.Trace"):
        replay([comp(0, 0, 1)], UNIT)
    with pytest.raises(ReplayError, match="needs a parlab.cluster.hardware.Hardware"):
        replay(Trace([comp(0, 0, 1)]), "dgx-h100")
    with pytest.raises(ReplayError, match="the trace is empty"):
        replay(Trace([]), UNIT)
    with pytest.raises(ReplayError, match="carries no work"):
        replay(Trace([Event(0, "compute", "forward", 0.0, 1.0)]), UNIT)
    with pytest.raises(ReplayError, match="message #0 from rank 0 to rank 1 was never received"):
        replay(Trace([p2p(0, 0.0, "send", 1), comp(1, 0.0, 1.0)]), UNIT)
    with pytest.raises(ReplayError, match=r"called by ranks \[0, 1\] only"):
        replay(Trace([coll(r, 0.0, (0, 1, 2)) for r in range(2)] + [comp(2, 0.0, 1.0)]), UNIT)
    with pytest.raises(ReplayError, match="waits forever"):     # both receive first: a deadlock
        replay(Trace([p2p(0, 0.0, "recv", 1), p2p(0, 1.0, "send", 1),
                      p2p(1, 0.0, "recv", 0), p2p(1, 1.0, "send", 0)]), UNIT)
    with pytest.raises(ReplayError, match="the grid has 2 ranks"):
        replay(Trace([coll(r, 0.0, (0, 1, 2)) for r in range(3)]), UNIT, grid=ParallelGrid(2))


def test_a_measured_step_starts_when_its_last_rank_began():
    """Rank 1 left the barrier 2 s after rank 0 (its first event starts at 2): the measured step runs from 2 to the
    last end (7), 5 s; `step_time` counts the skew (7 s). A replayed trace starts every rank at 0, where both agree."""
    tr = Trace([comp(0, 0.0, 1.0), coll(0, 1.0, (0, 1), end=7.0), comp(1, 2.0, 1.0), coll(1, 3.0, (0, 1), end=7.0)])
    assert step_time(tr) == 7.0 and measured_step(tr) == 5.0
    out = replay(tr, UNIT)
    assert measured_step(out) == step_time(out) == 1.0      # both ranks compute 1 FLOP from 0, then a free call
    with pytest.raises(ValueError, match="no events"):
        measured_step(Trace([]))


def test_measured_durations_can_be_scaled_instead_of_metered():
    out = replay(Trace([Event(0, "compute", "forward", 0.0, 2.0)]), UNIT, compute_scale=0.25)
    assert out.events[0].duration == 0.5


# ---------------------------------------------------------------------- 16 ranks, placement, output
def test_sixteen_ranks_replay_keeps_every_event_and_places_groups_on_nodes():
    grid = ParallelGrid(16, tp=4, pp=2, gpus_per_node=4)       # tp inside a node; dp and pp cross nodes
    X, evs = 1_000_000, []
    for r in range(16):
        t = 0.0
        for g in ("tp", "dp"):
            evs += [comp(r, t, 1e-3 * (1 + r % 3)), coll(r, t + 1.1, grid.group_of(r, g), X, end=t + 1.5)]
            t += 2.0
        pp = grid.group_of(r, "pp")
        other = pp[1 - pp.index(r)]
        evs.append(Event(r, "p2p", "send" if r < other else "recv", t, t, group=tuple(pp), peer=other, nbytes=X))
    out = replay(Trace(evs), AB, grid=grid)
    assert len(out) == len(evs) and out.hardware == "ab" and sorted(out.ranks) == list(range(16))
    for g in ("tp", "dp"):          # the members of each group finish their call together
        for group in grid.groups(g):
            ends = {e.end for e in out.events if e.rank in group and e.op == "all_reduce" and tuple(e.group) == tuple(group)}
            assert len(ends) == 1
    tp_call = next(e for e in out.events if e.op == "all_reduce" and len(e.group) == 4 and e.rank == 0)
    dp_call = next(e for e in out.events if e.op == "all_reduce" and len(e.group) == 2 and e.rank == 0)
    assert tp_call.duration >= AB.collective_time("all_reduce", X, 4, False)        # NVLink-like link
    assert dp_call.duration >= AB.collective_time("all_reduce", X, 2, True, 2)      # crosses nodes: the slow link
    for e in out.events:            # every message ends after its sender posted it
        if e.op == "recv":
            send = next(s for s in out.events if s.op == "send" and s.rank == e.peer)
            assert e.end >= send.start
    assert out.to_chrome()["traceEvents"][0]["args"]["name"] == "replayed on ab"
    assert step_time(out) > 0


def test_an_explicit_placement_decides_which_groups_cross_nodes():
    # tp groups (0, 1), (2, 3) and dp groups (0, 2), (1, 3): two nodes of two GPUs, placed tp-fastest or dp-fastest
    X, tp, dp = 1_000_000, [(0, 1), (2, 3)], [(0, 2), (1, 3)]
    tr = Trace([coll(r, 0.0, g, X) for g in tp for r in g] + [coll(r, 1.0, g, X) for g in dp for r in g])
    slow, fast = AB.collective_time("all_reduce", X, 2, True, 2), AB.collective_time("all_reduce", X, 2, False)
    assert slow > 5 * fast                                        # the two links differ, so the test can fail

    def durations(out):
        return {e.group: e.duration for e in out.events if e.rank == 0}     # rank 0's tp call and dp call

    inside = durations(replay(tr, AB, nodes=[0, 0, 1, 1]))          # as Megatron's tp-cp-dp-pp order places them
    across = durations(replay(tr, AB, nodes=[0, 1, 0, 1]))          # as the dp-tp-cp-pp order would
    # exact to float rounding: each call is one alpha-beta term, both members arrive together
    assert inside[(0, 1)] == pytest.approx(fast, rel=1e-12) and inside[(0, 2)] == pytest.approx(slow, rel=1e-12)
    assert across[(0, 1)] == pytest.approx(slow, rel=1e-12) and across[(0, 2)] == pytest.approx(fast, rel=1e-12)
    assert durations(replay(tr, AB, nodes=(0, 0, 1, 1))) == durations(replay(tr, AB, gpus_per_node=2))
    with pytest.raises(ValueError, match="not both"):
        replay(tr, AB, nodes=[0, 0, 1, 1], gpus_per_node=2)
    for bad in ([], [0, -1, 1, 1], [0, 0.5, 1, 1], "0011", 3):
        with pytest.raises(ValueError, match="nodes must list a node number"):
            replay(tr, AB, nodes=bad)
    with pytest.raises(ReplayError, match="places only 2 ranks"):
        replay(tr, AB, nodes=[0, 1])


# ---------------------------------------------------------------------- real runs
CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=8, n_head=2, n_embd=16)
CASES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb-h1", 4, 8, 1),
         ("dualpipe-v", 4, 8, 2)]


def _pipelines():
    """On every rank: one traced step of each schedule, each in its own recorder (events as dicts)."""
    out = []
    for name, p, m, v in CASES:
        s = sch.interleaved_1f1b(p, m, v) if name == "interleaved" else sch.SCHEDULES[name](p, m)
        x = torch.randint(CFG.vocab_size, (m, CFG.seq_len), generator=torch.Generator().manual_seed(0))  # (m, S)
        with recording() as rec:
            PipelineParallel(GPT(CFG, seed=0), s).step(x, x)
        out.append([dataclasses.asdict(e) for e in rec.events])
    return out


def test_replayed_pipeline_bubbles_equal_the_closed_forms_in_unit_time():
    res = parlab.run(_pipelines, 4, echo=False)
    kinds = {v: k for k, v in sch.KINDS.items()}
    for i, (name, p, m, v) in enumerate(CASES):
        tr = Trace([Event(**{**d, "group": tuple(d["group"])}) for rank in res.results for d in rank[i]])

        def unit(e, v=v):       # F = 1, B = 2, I = W = 1, divided by the chunks per rank (simulation.unit_cost)
            return sch.unit_cost(sch.Action(0, kinds[e.op], 0), v) if e.op in kinds else 0.0

        out = replay(tr, UNIT, compute_time=unit)
        expected = sch.bubble_formula(name, p, m, v)
        if name == "dualpipe-v":    # one CPU stream runs each F&B pair as F, then B: the schedule without pairs
            s = sch.SCHEDULES[name](p, m)
            expected = sch.simulate(sch.Schedule(s.actions, s.stages, m, s.placement)).bubble_fraction
            assert expected < sch.bubble_formula(name, p, m)     # F need not wait for its partner's gradient
        # exact up to float rounding of sums of halves and ones
        assert bubble(out) == pytest.approx(expected, abs=1e-12), name


def _metered_step():
    m = GPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, n_embd=16), seed=0)
    x = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(0))    # (B, S)
    with count_costs():
        with region("forward"):
            _, loss = m(x, x)
        with region("backward"):
            loss.backward()
        with region("given", flops=123.0, nbytes=7):
            pass
    return m


def test_metered_spans_carry_flops_bytes_and_kernels_and_replay_by_the_roofline():
    with recording() as rec:
        _metered_step()
    fwd, bwd, given = rec.events
    assert fwd.flops > 0 and fwd.nbytes > 0 and fwd.kernels > 0
    assert bwd.flops == 2 * fwd.flops                     # backward of a product: two products of the same size
    assert (given.flops, given.nbytes, given.special) == (123.0, 7, 0)
    # special functions, one per element: forward softmax (B nh S^2) and GeLU (B S 4E) per layer, and the loss's
    # log-softmax (B S V); backward GeLU's and log-softmax's (softmax's backward evaluates none)
    B, S, E, nh, layers, V = 2, 8, 16, 2, 2, 32
    assert fwd.special == layers * (B * nh * S * S + B * S * 4 * E) + B * S * V
    assert bwd.special == layers * B * S * 4 * E + B * S * V
    out = replay(Trace(rec.events), hardware_preset("dgx-h100"))
    h = hardware_preset("dgx-h100")
    assert out.events[0].duration == pytest.approx(h.compute_time(fwd.flops, fwd.nbytes, fwd.kernels,
                                                                  special=fwd.special), rel=1e-12)
    assert h.compute_time(special=3.9e12) == pytest.approx(1.0)   # the H100's 3.9 T special results / s


# ---------------------------------------------------------------------- calibration fits (pure)
def test_alpha_beta_and_roofline_fits_recover_the_parameters_of_exact_data():
    from parlab.cluster.calibrate import fit_alpha_beta, fit_roofline
    alpha, bw, n = 3e-5, 2e9, 4
    rows = [(x, alpha + 2 * (n - 1) / n * x / bw) for x in (4, 4096, 1 << 20, 1 << 24)]
    a, b = fit_alpha_beta(rows, n)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(bw, rel=1e-9)   # exact data: rounding only
    F, B, c = 1e10, 5e9, 2e-6
    samples = [(f, by, 1, f / F + by / B + c) for f, by in ((1e6, 0), (1e8, 0), (0, 1e3), (0, 1e7), (0, 12))]
    got = fit_roofline(samples)
    assert got == pytest.approx((F, B, c), rel=1e-6)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        fit_alpha_beta(rows, 1)
    with pytest.raises(ValueError, match="does not grow with message size"):
        fit_alpha_beta([(4, 2.0), (1 << 20, 1.0)], 2)
    # constant times with a per-byte term of rounding size (1e-18 s/byte; one CI machine's solver returned 2e-24
    # for constant rows, a bandwidth of 4e23 B/s): no bandwidth in these, refused the same way
    flat = [(x, 5e-3 + x * 1e-18) for x in (1 << 12, 1 << 16, 1 << 18, 1 << 20)]
    with pytest.raises(ValueError, match="does not grow with message size"):
        fit_alpha_beta(flat, 2, factor=1.0)


def test_calibrate_refuses_a_single_rank():
    from parlab.cluster.calibrate import calibrate
    with pytest.raises(ValueError, match="world must be an integer >= 2"):
        calibrate(1)


# ---------------------------------------------------------------------- scale-up
def _pipeline_pattern(p, m):
    x = torch.randint(CFG.vocab_size, (m, CFG.seq_len), generator=torch.Generator().manual_seed(0))   # (m, S)
    PipelineParallel(GPT(CFG, seed=0), sch.one_f_one_b(p, m)).step(x, x)


def test_scaleup_recosts_every_action_with_the_big_model_and_keeps_the_schedule():
    from parlab.cluster.costs import model_preset
    from parlab.cluster.scaleup import Layout, layer_forward_bytes, layer_forward_flops, scaleup
    p, m = 2, 4
    tr = parlab.run(_pipeline_pattern, p, p, m, trace=True, echo=False).trace
    model = model_preset("llama-7b")
    hw = hardware_preset("dgx-h100").with_(efficiency=1.0, sms=None)       # products by their FLOPs (waves: test_step_costs)
    out = scaleup(tr, model, hw, Layout(tp=8, pp=p, dp=4, micro_batch=1))
    assert "as llama-7b (64 GPUs)" in out.hardware
    fwd = [e for e in out.events if e.op == "forward" and "stage 0 " in e.label]
    assert len(fwd) == m
    t_tp = hw.collective_time("all_reduce", 2 * model.seq * model.hidden, 8)      # (b, s, h) 16-bit, in a node
    # 16 of 32 layers: their products' FLOPs at peak, their memory-bound ops' bytes at 0.8 of HBM, 2 TP all-reduces
    expected = (16 * layer_forward_flops(model, 1, 8) / hw.peak_flops
                + 16 * layer_forward_bytes(model, 1, 8, dropout=False, fused=True) / (hw.mem_bw * hw.mem_efficiency)
                + 2 * 16 * t_tp)                      # LLaMA trains without dropout; Layout's default kernel is fused
    assert fwd[0].duration == pytest.approx(expected, rel=1e-12)
    # without the memory-bound ops and the optimizer: the FLOPs-only model
    bare = scaleup(tr, model, hw, Layout(tp=8, pp=p, dp=4, micro_batch=1), memory_ops=False, optimizer=False)
    fwd0 = [e for e in bare.events if e.op == "forward" and "stage 0 " in e.label][0]
    assert fwd0.duration == pytest.approx(16 * layer_forward_flops(model, 1, 8) / hw.peak_flops + 2 * 16 * t_tp,
                                          rel=1e-12)
    assert not [e for e in bare.events if e.op == "optimizer"]
    opt = [e for e in out.events if e.op == "optimizer"]
    assert len(opt) == p and all(e.start >= max(x.end for x in out.events if x.rank == e.rank and x is not e)
                                 for e in opt)                              # each rank's step comes last
    dp = [e for e in out.events if e.label == "dp grads (virtual)"]
    assert len(dp) == p and all(e.duration > 0 for e in dp)                      # dp=4 crosses nodes: 64 GPUs
    assert bubble(replay(tr, UNIT, compute_time=lambda e: 1.0 if e.op == "forward" else 2.0)) == pytest.approx(
        sch.bubble_formula("1f1b", p, m), abs=1e-12)
    with pytest.raises(ValueError, match="has 2 ranks but the layout has pp=4"):
        scaleup(tr, model, hw, Layout(tp=8, pp=4))
    with pytest.raises(ValueError, match="2 virtual stages but the layout says pp=2 x virtual=2"):
        scaleup(tr, model, hw, Layout(tp=8, pp=2, virtual=2))
    with pytest.raises(ValueError, match="recompute must be"):
        Layout(recompute="some")


def test_a_wait_for_a_send_not_yet_received_does_not_hold_the_sender():
    # rank 0 polls its isend at once (as the pipeline's _reap does) and computes; rank 1 receives only at 5 s
    tr = Trace([p2p(0, 0.0, "send", 1, asynchronous=True, waited=0.1), comp(0, 0.2, 3.0),
                comp(1, 0.0, 5.0), p2p(1, 1.5, "recv", 0)])
    out = replay(tr, UNIT)
    assert by_rank(out, 0, "compute")[0].start == 0.0          # not held: the send is buffered
    send, recv = by_rank(out, 0, "send")[0], by_rank(out, 1, "recv")[0]
    assert send.end == recv.end == 5.0                           # the message moves when the receiver posts
    assert send.waited is None


def test_scale_work_multiplies_work_and_bytes_and_refuses_unmetered_traces():
    from parlab.cluster.scaleup import scale_work
    tr = Trace([Event(0, "compute", "f", 0.0, 1.0, flops=10.0, nbytes=4, kernels=3), coll(0, 1.0, (0,), 100)])
    big = scale_work(tr, flops=3.0, comm_bytes=2.0)
    assert (big.events[0].flops, big.events[0].nbytes, big.events[0].kernels, big.events[1].nbytes) == (30.0, 12, 3, 200)
    with pytest.raises(ValueError, match="carry no metered work"):
        scale_work(Trace([Event(0, "compute", "f", 0.0, 1.0)]), flops=2.0)
    with pytest.raises(ValueError, match="flops must be a positive factor"):
        scale_work(tr, flops=0)


def test_toggle_figure_switches_between_the_measured_and_the_replayed_timeline():
    from parlab.viz.replay import replay_toggle
    tr = Trace([comp(0, 0.0, 2e12), comp(1, 0.0, 1e12)])
    fig = replay_toggle(tr, hardware_preset("dgx-h100"), title="t")
    buttons = fig.layout.updatemenus[0].buttons
    assert [b.label for b in buttons] == ["this machine", "replayed on DGX H100"]
    assert [t.visible for t in fig.data] == [False, True]               # the replayed view first
    assert buttons[0].args[0]["visible"] == [True, False] and "replayed on DGX H100" in fig.layout.title.text


def test_toggle_figures_switches_between_views_drawn_with_the_same_panels():
    """Lesson 05's schedules, measured and replayed: one button per view, each showing only its own cells and
    restoring its own title and time-axis title; views of other panels, or a single view, are refused."""
    from parlab.parallel import pipeline as sch
    from parlab.viz.pipeline import schedules_figure
    from parlab.viz.replay import toggle_figures
    sims = {k: sch.simulate(s).spans for k, s in (("1F1B", sch.one_f_one_b(2, 4)), ("GPipe", sch.gpipe(2, 4)))}
    here = schedules_figure(sims, title="here", time_unit="units")
    there = schedules_figure(sims, title="there", time_unit="seconds", scale=0.5)
    before = (here.to_json(), there.to_json())
    fig = toggle_figures({"a": here, "b": there})
    assert (here.to_json(), there.to_json()) == before                 # the views themselves are left as they were
    n = len(here.data)
    assert len(fig.data) == n + len(there.data) and [t.visible for t in fig.data] == [True] * n + [False] * n
    a, b = fig.layout.updatemenus[0].buttons
    assert (a.label, b.label) == ("a", "b") and fig.layout.title.text == "here"
    assert b.args[0]["visible"] == [False] * n + [True] * n and b.args[1]["title.text"] == "there"
    assert b.args[1]["xaxis2.title.text"] == "seconds" and a.args[1]["xaxis2.title.text"] == "units"
    assert fig.layout.xaxis2.title.text == "units" and fig.layout.height > here.layout.height   # room for buttons
    assert toggle_figures({"a": here, "b": there}, start=1).layout.title.text == "there"
    one = schedules_figure({"1F1B": sims["1F1B"]})
    with pytest.raises(ValueError, match="different subplot layouts"):
        toggle_figures({"a": here, "b": one})
    with pytest.raises(ValueError, match="at least two views"):
        toggle_figures({"a": here})
    with pytest.raises(ValueError, match="start must be the index of a view"):
        toggle_figures({"a": here, "b": there}, start=2)


def test_cost_metering_is_a_no_op_without_a_recorder_and_the_cli_refuses_one_rank(capsys):
    with count_costs():                              # nothing records: nothing to meter, nothing raised
        torch.ones(3) + 1
    from parlab.cli import main
    assert main(["calibrate", "--world", "1", "--out", "/dev/null"]) == 2
    assert "world must be an integer >= 2" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["--reps", "0", "--out", "{tmp}/hw.json"], "--reps must be at least 1"),
    (["--max-size", "4", "--out", "{tmp}/hw.json"], "--max-size 4 leaves 1 message size(s) to measure"),
    (["--out", "{tmp}/no/such/folder/hw.json"], "does not exist; create it first"),
    (["--out", "{tmp}"], "is a folder; give a file name"),
    (["--min-time", "0", "--out", "{tmp}/hw.json"], "--min-time must be a positive number of seconds"),
    (["--min-time", "nan", "--out", "{tmp}/hw.json"], "--min-time must be a positive number of seconds"),
])
def test_calibrate_refuses_bad_arguments_before_it_measures(args, says, tmp_path, capsys):
    """Each is refused at once (exit 2, what to do instead), not after a minute of measuring or with a traceback
    from deep inside the fit (--reps 0: the median of nothing; one message size: no line to fit)."""
    from parlab.cli import main
    assert main(["calibrate", *[a.format(tmp=tmp_path) for a in args]]) == 2
    assert says in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []                  # nothing written


def test_calibrate_refuses_an_out_it_could_not_write(tmp_path, capsys, monkeypatch):
    """A folder it may not write to, or an existing file it may not replace: refused before measuring (tests run as
    root here, where every path is writable, so os.access is made to say no); an existing writable file (e.g.
    /dev/null) is fine."""
    import os

    import parlab.cluster.calibrate.measure as cal
    from parlab.cli import main
    existing = tmp_path / "old.json"
    existing.write_text("{}")
    monkeypatch.setattr(cal.os, "access", lambda path, mode: False)
    assert main(["calibrate", "--out", str(tmp_path / "hw.json")]) == 2
    assert f"the folder {tmp_path} is not writable; choose another place" in capsys.readouterr().out
    assert main(["calibrate", "--out", str(existing)]) == 2
    assert "exists and is not writable; choose another name" in capsys.readouterr().out
    monkeypatch.setattr(cal.os, "access", lambda path, mode: path == os.path.abspath(str(existing)))
    assert cal._bad_args(type("A", (), {"reps": 5, "min_time": None, "max_size": 1 << 24, "out": str(existing)})(), cal.SIZES) is None


def test_hardware_computes_in_each_number_format_it_has():
    """Per-precision tensor-core rates (dense, NVIDIA datasheets): FP8 doubles the H100's BF16 peak; the A100 has no
    FP8, and says which formats it has; the rates survive the JSON round trip."""
    from parlab.cluster.hardware import Hardware, hardware_preset
    h100, a100 = hardware_preset("dgx-h100"), hardware_preset("dgx-a100")
    assert h100.at("fp8").peak_flops == pytest.approx(2 * h100.at("bf16").peak_flops, rel=1e-3)   # 1,979 vs 2 x 989
    assert h100.at("bf16").peak_flops == h100.peak_flops
    assert a100.at("tf32").peak_flops == a100.peak_flops / 2 and "(tf32)" in a100.at("tf32").name
    with pytest.raises(ValueError, match="DGX A100 has no 'fp8' rate; its number formats: fp64, tf32, bf16, fp16"):
        a100.at("fp8")
    assert Hardware.from_dict(h100.to_dict()) == h100
    with pytest.raises(ValueError, match="precision_flops maps a number format to a positive FLOP/s"):
        h100.with_(precision_flops={"fp8": -1})
    # each format's measured fraction of its peak (MAMF table: BF16 794.5 of 989, FP8 1,402.6 of 1,979 TFLOP/s):
    # an H100's fp8 products run 1.77 times as fast as its bf16 ones, not twice; bf16 and tf32 keep `efficiency`
    fp8, bf16 = h100.at("fp8"), h100.at("bf16")
    assert fp8.peak_flops * fp8.efficiency == pytest.approx(1402.6e12) and bf16.efficiency == h100.efficiency
    assert bf16.gemm_time(8192, 8192, 8192) / fp8.gemm_time(8192, 8192, 8192) == pytest.approx(1.773, rel=1e-3)
    assert h100.at("tf32").efficiency == h100.efficiency and a100.at("tf32").efficiency == a100.efficiency
    with pytest.raises(ValueError, match=r"precision_efficiency maps a number format to a fraction in \(0, 1\]"):
        h100.with_(precision_efficiency={"fp8": 1.2})
