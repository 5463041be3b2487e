"""Pipeline schedules as data: text form, validation (deadlock included), and the closed forms of the simulation."""
import ast
import pathlib

import pytest

import parlab.parallel.pipeline.simulation as sch_module
from parlab.parallel.pipeline import (Action, Schedule, ScheduleError, bubble_formula, dualpipe_v, gpipe,
                                     interleaved_1f1b, naive, one_f_one_b, simulate, validate, zero_bubble_h1)

GENERATORS = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1,
              "interleaved": lambda p, m: interleaved_1f1b(p, m, 2),
              "interleaved-memory": lambda p, m: interleaved_1f1b(p, m, 2, memory_optimised=True),
              "dualpipe-v": dualpipe_v}
SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]
EPS = 1e-12   # the simulation adds unit costs: exact up to float rounding


CASES = [(n, p, m) for n in GENERATORS for p, m in SIZES
         if not (n.startswith("interleaved") and m % p) and not (n == "dualpipe-v" and m < 2 * p)]


# ---------------------------------------------------------------------- the data
def test_text_form_round_trips():
    s = one_f_one_b(2, 3)
    assert s.text() == "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2\nrank 1: 1F0 1B0 1F1 1B1 1F2 1B2"
    back = Schedule.from_text(s.text())
    assert back.actions == s.actions and (back.stages, back.microbatches, back.placement) == (2, 3, (0, 1))
    z = zero_bubble_h1(3, 4)
    assert Schedule.from_text(z.text()).actions == z.actions
    assert Action.parse("12W3") == Action(12, "W", 3) and str(Action(1, "I", 0)) == "1I0"


def test_actions_may_be_given_in_text_form_and_unit_costs_are_divided_by_v():
    s = Schedule([["0F0", "0B0"], [Action(1, "F", 0), " 1B0 "]], 2, 1)
    assert s.actions == one_f_one_b(2, 1).actions
    with pytest.raises(ScheduleError, match="cannot read action '0Q0'"):
        Schedule([["0Q0"]], 1, 1)
    assert [sch_module.unit_cost(Action(0, k, 0)) for k in "FBIW"] == [1, 2, 1, 1]
    assert sch_module.unit_cost(Action(0, "B", 0), v=2) == 1
    assert simulate(interleaved_1f1b(2, 2, 2)).busy == [sum(sch_module.unit_cost(a, 2) for a in acts)
                                                        for acts in interleaved_1f1b(2, 2, 2).actions]


@pytest.mark.parametrize("bad", ["1X3", "F3", "", "1F"])
def test_unreadable_action_names_the_format(bad):
    with pytest.raises(ScheduleError, match="e.g. '1F3'"):
        Action.parse(bad)


def test_interleaved_places_chunks_round_robin():
    s = interleaved_1f1b(2, 4, 2)
    assert s.stages == 4 and s.chunks == 2 and s.placement == (0, 1, 0, 1)
    assert s.stages_of(0) == [0, 2]
    # Megatron's depth-first order on rank 0: chunk 0 of micro-batches 0, 1, then chunk 1 of them, ...
    assert [str(a) for a in s.actions[0][:4]] == ["0F0", "0F1", "2F0", "2F1"]


# ---------------------------------------------------------------------- validation
@pytest.mark.parametrize("name,p,m", CASES)
def test_every_generated_schedule_is_valid(name, p, m):
    s = GENERATORS[name](p, m)
    assert validate(s) is s
    per_stage = sum(len(a) for a in s.actions) / (s.stages * m)
    if name == "dualpipe-v":                              # some backwards whole, some split (validate checks each)
        assert 2 < per_stage < 3
    else:
        assert per_stage == (3 if name == "zb-h1" else 2)     # F + B, or F + I + W, for every (stage, micro-batch)


@pytest.mark.parametrize("text,message", [
    ("0F0 0B0\n1F0", "stage 1 micro-batch 0 has 1F0: after its F it needs either one B \\(1B0\\)"),
    ("0F0 0B0 0F0\n1F0 1B0", "appears twice"),
    ("1F0 1B0\n0F0 0B0", "lives on rank 1"),
    ("0F0 0I0 0B0 0W0\n1F0 1B0", "has 0F0, 0B0, 0I0, 0W0: .* not a mix"),
])
def test_invalid_schedules_say_what_is_wrong(text, message):
    with pytest.raises(ScheduleError, match=message):
        validate(Schedule.from_text(text, stages=2, microbatches=1))


def test_out_of_range_action():
    with pytest.raises(ScheduleError, match="out of range"):
        validate(Schedule.from_text("0F0 0B0 0F5 0B5\n1F0 1B0 1F5 1B5", stages=2, microbatches=2))


def test_backward_before_its_own_forward_deadlocks():
    with pytest.raises(ScheduleError, match="deadlock: rank 0 waits at 0B0 for 0F0, which rank 0 itself runs only "
                                            "later in its list"):
        validate(Schedule.from_text("0B0 0F0\n1F0 1B0"))


def test_a_deadlock_reads_as_one_sentence_in_chinese_too():
    from parlab.i18n import use_language
    with use_language("zh_CN"), pytest.raises(ScheduleError) as err:
        validate(Schedule.from_text("rank 0: 0F0 0B0\nrank 1: 1B0 1F0"))
    assert "；rank 1" in str(err.value) and "; " not in str(err.value)      # a full-width semicolon between ranks


def test_cross_rank_cycle_is_reported_with_both_ranks():
    # rank 0 wants 1B0 before it sends 0F1; rank 1 wants 0F1 before it runs 1B0
    s = Schedule.from_text("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0")
    with pytest.raises(ScheduleError) as err:
        validate(s)
    assert "rank 0 waits at 0B0 for 1B0/1I0 (on rank 1)" in str(err.value)
    assert "rank 1 waits at 1F1 for 0F1 (on rank 0)" in str(err.value)


def test_impossible_configurations_raise_value_errors():
    with pytest.raises(ValueError, match="multiple of 4"):
        interleaved_1f1b(4, 6, 2)
    for bad in [(0, 4), (2, 0), (2, -1), (2.5, 4)]:
        with pytest.raises(ValueError, match="positive integer"):
            one_f_one_b(*bad)
    with pytest.raises(ValueError, match="chunks must be a positive integer"):
        interleaved_1f1b(2, 4, 0)
    with pytest.raises(ValueError, match="unknown kinds"):
        simulate(gpipe(2, 2), costs={"X": 1})


# ---------------------------------------------------------------------- simulation and closed forms
@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    for s in (gpipe(p, m), one_f_one_b(p, m)):
        sim = simulate(s)
        assert abs(sim.bubble_fraction - (p - 1) / (m + p - 1)) < EPS
        assert all(abs(b - (p - 1) / (m + p - 1)) < EPS for b in sim.bubble)   # balanced: every rank alike
        assert abs(sim.bubble_over_ideal - (p - 1) / m) < EPS                     # the other convention


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m % p == 0])
def test_interleaving_divides_the_bubble_time_by_v(p, m, v):
    base, inter = simulate(one_f_one_b(p, m)), simulate(interleaved_1f1b(p, m, v))
    assert abs(inter.bubble_fraction - bubble_formula("interleaved", p, m, v)) < EPS
    work = 3 * m          # per rank, F + B = 3 units per micro-batch whatever v (chunks cost 1/v each)
    assert abs((inter.makespan - work) * v - (base.makespan - work)) < EPS


def _torch_dualpipe_v(p: int, m: int) -> str:
    """torch.distributed.pipelining.ScheduleDualPipeV's actions in our text form (an OVERLAP_F_B as 'F&B').
    Its per-rank list needs no stages or process group: only the pipeline size and the micro-batch count."""
    from torch.distributed.pipelining import schedules as ts
    kind = {ts.FORWARD: "F", ts.FULL_BACKWARD: "B", ts.BACKWARD_INPUT: "I", ts.BACKWARD_WEIGHT: "W"}
    word = lambda a: f"{a.stage_index}{kind[a.computation_type]}{a.microbatch_index}"
    torch_schedule = object.__new__(ts.ScheduleDualPipeV)
    torch_schedule.pp_group_size, torch_schedule._n_microbatches = p, m
    return "\n".join(f"rank {r}: " + " ".join("&".join(map(word, a.sub_actions)) if a.sub_actions else word(a)
                                              for a in torch_schedule._calculate_single_rank_operations(r))
                     for r in range(p))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_dualpipe_v_lists_torch_schedule_dualpipe_v_actions(p):
    for m in (2 * p, 2 * p + 1, 2 * p + 5):
        s = dualpipe_v(p, m)
        assert s.text() == _torch_dualpipe_v(p, m), (p, m)
        assert s.placement == tuple(list(range(p)) + list(range(p - 1, -1, -1)))     # the V: r and 2p - 1 - r


@pytest.mark.parametrize("p,m", [(2, 4), (2, 9), (4, 8), (4, 20), (8, 16)])
def test_dualpipe_v_bubble_is_the_dualpipe_readme_formula(p, m):
    # DeepSeek's table: bubble (PP/2 - 1)(F&B + B - 3W), activations PP + 1 per device, PP = 2p stages, costs
    # per chunk. With F&B = F + B (the simulation's default: no gain from overlapping) every rank idles exactly
    # that long; with a real overlap gain the ranks differ and the formula is the worst one's (the last ranks).
    for costs in (None, {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}, {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0,
                                                                    "F&B": 2.5}):
        sim, c = simulate(dualpipe_v(p, m), costs), costs or {"F": 0.5, "B": 1.0, "W": 0.5}
        formula = (2 * p / 2 - 1) * (c.get("F&B", c["F"] + c["B"]) + c["B"] - 3 * c["W"])
        idle = [sim.makespan - b for b in sim.busy]
        assert abs(max(idle) - formula) < EPS, costs
        if costs is None or "F&B" not in costs:
            assert max(idle) - min(idle) < EPS
        assert sim.peak_in_flight == [2 * p + 1] * p                       # PP + 1
    assert abs(simulate(dualpipe_v(p, m)).bubble_fraction - bubble_formula("dualpipe-v", p, m)) < EPS


def test_overlapped_pairs_read_write_and_refuse_what_is_not_a_pair():
    s = dualpipe_v(2, 4)
    i = s.actions[0].index(Action(3, "B", 1))
    assert "0F3&3B1" in s.text() and s.pair_of(0, i) == i - 1 and s.pair_of(0, i - 1) == i
    assert s.pair_of(0, 0) is None
    back = Schedule.from_text(s.text(), placement=s.placement)
    assert (back.actions, back.overlapped) == (s.actions, s.overlapped)
    with pytest.raises(ScheduleError, match="one forward and one backward"):
        Schedule.from_text("0F0&0F1&1B0")
    with pytest.raises(ScheduleError, match="must be a forward followed by a backward"):
        Schedule([["0F0", "0B0"]], 1, 1, overlapped=((1,),))
    with pytest.raises(ScheduleError, match="the actions there are 0F0 0F1"):      # (so no two pairs share one)
        Schedule([["0F0", "0F1", "0B0", "0B1"]], 1, 2, overlapped=((0, 1),))
    with pytest.raises(ScheduleError, match="microbatches >= 8"):
        dualpipe_v(4, 7)


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m >= p])
def test_zb_h1_has_a_third_of_1f1b_bubble_at_the_same_peak_memory(p, m):
    zb, f = simulate(zero_bubble_h1(p, m)), simulate(one_f_one_b(p, m))
    work = 3 * m          # F = I = W = 1 and B = 2 units
    assert abs(zb.bubble_fraction - (p - 1) / (3 * m + p - 1)) < EPS
    if p > 1:
        assert abs((zb.makespan - work) / (f.makespan - work) - 1 / 3) < EPS
    assert max(zb.peak_in_flight) == max(f.peak_in_flight) == p


@pytest.mark.parametrize("p,m", SIZES)
def test_1f1b_keeps_at_most_p_micro_batches_where_gpipe_keeps_m(p, m):
    f, g = simulate(one_f_one_b(p, m)), simulate(gpipe(p, m))
    assert f.peak_in_flight == [min(p - r, m) for r in range(p)]
    assert g.peak_in_flight == [m] * p
    assert f.peak_in_flight_stage == {r: min(p - r, m) for r in range(p)}


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
def test_memory_optimised_interleaving_trades_peak_memory_for_latency_slack(p, m):
    meg, mem = interleaved_1f1b(p, m, 2), interleaved_1f1b(p, m, 2, memory_optimised=True)
    a, b = simulate(meg), simulate(mem)
    assert abs(a.bubble_fraction - b.bubble_fraction) < EPS          # free communication: same bubble
    assert all(x <= y for x, y in zip(b.peak_in_flight, a.peak_in_flight))   # never more alive on any rank,
    assert sum(b.peak_in_flight) < sum(a.peak_in_flight)                     # and fewer on some
    assert simulate(mem, comm=0.2).makespan > simulate(meg, comm=0.2).makespan   # less slack for messages


@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (4, 4), (4, 6)])
def test_naive_pipeline_keeps_exactly_one_rank_busy(p, m):
    sim = simulate(naive(p, m))
    assert abs(sim.bubble_fraction - (1 - 1 / p)) < EPS
    spans = sorted((t0, t1) for sp in sim.spans for t0, t1, _ in sp)
    assert all(a[1] <= b[0] + EPS for a, b in zip(spans, spans[1:]))   # no two actions overlap in time


@pytest.mark.parametrize("name", list(GENERATORS))
def test_timeline_respects_every_dependency_with_latency(name):
    p, m, comm = 4, 8, 0.25
    s = GENERATORS[name](p, m)
    costs = {"F": 1.0, "B": 2.5, "I": 1.5, "W": 1.0}
    sim = simulate(s, costs=costs, comm=comm)
    end = {(a.stage, a.kind, a.mb): t1 for sp in sim.spans for _, t1, a in sp}
    rows = sim.timeline()
    assert len(rows) == sum(len(a) for a in s.actions)
    for r, sp in enumerate(sim.spans):
        assert [a for _, _, a in sp] == list(s.actions[r])                  # run in the schedule's order
        assert all(x[1] <= y[0] + EPS for x, y in zip(sp, sp[1:]))          # one action at a time per rank
        for t0, t1, a in sp:
            assert abs(t1 - t0 - costs[a.kind]) < EPS
            if a.kind == "F" and a.stage > 0:
                hop = comm if s.placement[a.stage - 1] != r else 0
                assert t0 >= end[(a.stage - 1, "F", a.mb)] + hop - EPS
            if a.kind in "BI" and a.stage < s.stages - 1:
                got = end.get((a.stage + 1, "B", a.mb), end.get((a.stage + 1, "I", a.mb)))
                assert t0 >= got + (comm if s.placement[a.stage + 1] != r else 0) - EPS
            if a.kind == "W":
                assert t0 >= end[(a.stage, "I", a.mb)] - EPS
    assert sim.makespan == max(x["end"] for x in rows)


def test_costs_may_be_a_function_of_the_action():
    # a slow last stage (the head) stretches 1F1B's step: F and B of stage 3 cost twice as much
    s = one_f_one_b(4, 8)
    slow = simulate(s, costs=lambda a: (1.0 if a.kind == "F" else 2.0) * (2 if a.stage == 3 else 1))
    assert slow.makespan == 3 * 2 * 8 + 3 * 3          # the bottleneck stage's work + the pipeline fill/drain
    assert slow.bubble[3] < slow.bubble[0]


@pytest.mark.parametrize("module", ["actions", "schedules", "simulation", "plan"])
def test_schedules_module_is_pure_python(module):
    path = pathlib.Path(sch_module.__file__).with_name(f"{module}.py")
    tree = ast.parse(path.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in imported, f"parlab.parallel.pipeline.{module} must not import torch (pure planning)"


def test_message_order_of_1f1b_on_two_ranks():
    # rank 0: 0F0 0F1 0B0 0F2 0B1 0B2; unit costs put act 0, act 1 at t = 1, 2, grad 0 at 4, then act 2 and
    # grad 1 both at 7 (ties go to the lower sender), grad 2 at 10
    assert sch_module.message_order(one_f_one_b(2, 3)) == {(0, 1): [
        (0, "act", 1, 0), (0, "act", 1, 1), (1, "grad", 0, 0), (0, "act", 1, 2), (1, "grad", 0, 1),
        (1, "grad", 0, 2)]}


@pytest.mark.parametrize("s", [gpipe(4, 6), one_f_one_b(4, 8), interleaved_1f1b(2, 4, 2), interleaved_1f1b(4, 8, 2),
                               zero_bubble_h1(4, 8), naive(3, 2)], ids=lambda s: f"{s.name}")
def test_message_order_lists_every_message_once_in_each_senders_own_order(s):
    order = sch_module.message_order(s)
    pl, S = s.placement, s.stages
    sent = {}                                        # sender -> its messages in its program order
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.kind == "F" and a.stage < S - 1 and pl[a.stage + 1] != r:
                sent.setdefault(r, []).append((r, "act", a.stage + 1, a.mb))
            elif a.kind in "BI" and a.stage > 0 and pl[a.stage - 1] != r:
                sent.setdefault(r, []).append((r, "grad", a.stage - 1, a.mb))
    listed = [msg for msgs in order.values() for msg in msgs]
    assert sorted(listed) == sorted(m for ms in sent.values() for m in ms)      # each message exactly once
    for (a, b), msgs in order.items():
        assert a < b
        for sender in (a, b):                          # a sender's messages keep its program order
            mine = [m for m in msgs if m[0] == sender]
            assert mine == [m for m in sent.get(sender, []) if pl[m[2]] == (b if sender == a else a)]
