"""The pipeline's posting order under NCCL's rules: one serialised rendezvous p2p queue per rank.

Pure tests run the model in parlab.parallel.pipeline.plan; the rank tests run the real executor over gloo with the shim in
tests/serialised_p2p.py, which enforces the same rules, and compare with the unsplit model."""
import pytest
import torch
import torch.distributed as dist

import parlab
from parlab.parallel import pipeline as sch
from parlab.parallel.pipeline.plan import Post, check_serialised, merged_plan, pair_plans, serialised_run
from parlab.models import GPT
from parlab.parallel.pipeline import PipelineParallel
from serialised_p2p import serialised_p2p
from test_pipeline_parallel import CFG, _batch, _check


def _grid():
    """GPipe, 1F1B, ZB-H1 and interleaved (v = 2, 3) for p in {2, 3, 4, 8} and m in {p, 2p, 4p}: 60 schedules."""
    out = []
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            out += [sch.gpipe(p, m), sch.one_f_one_b(p, m), sch.zero_bubble_h1(p, m)]
            out += [sch.interleaved_1f1b(p, m, v) for v in (2, 3)]
    return out


EXTRA = [sch.naive(3, 2), sch.interleaved_1f1b(4, 8, 2, memory_optimised=True),
         sch.interleaved_1f1b(3, 6, 3, memory_optimised=True), sch.one_f_one_b(1, 3), sch.interleaved_1f1b(1, 4, 2)]


@pytest.mark.parametrize("s", _grid() + EXTRA, ids=lambda s: f"{s.name}-p{s.ranks}-m{s.microbatches}")
def test_merged_order_never_deadlocks_with_one_serialised_queue_per_rank(s):
    assert serialised_run(s, "merged", "rank") is None
    assert serialised_run(s, "merged", "pair") is None
    check_serialised(s)


def test_per_pair_order_deadlocks_interleaved_schedules_on_one_queue_per_rank():
    # the executor's first order: fine with one FIFO per pair, a cycle with one serialised queue per rank
    grid = _grid()
    assert all(serialised_run(s, "per-pair", "pair") is None for s in grid)
    stuck = [s for s in grid if serialised_run(s, "per-pair", "rank") is not None]
    assert stuck and all(s.name.startswith("interleaved") and s.ranks >= 3 for s in stuck)
    # the cycle of the issue, at p = 3: every rank's first queued send faces the next rank's own send
    why = serialised_run(sch.interleaved_1f1b(3, 3, 2), "per-pair", "rank")
    for head in ("rank 0: host waits for recv act(stage 3, mb 0) from rank 2; queue head send act(stage 1, mb 2)",
                 "rank 1: host waits for recv act(stage 1, mb 2) from rank 0; queue head send act(stage 2, mb 1)",
                 "rank 2: host waits for recv act(stage 2, mb 1) from rank 1; queue head send act(stage 3, mb 0)"):
        assert head in why
    with pytest.raises(sch.ScheduleError, match="would post"):   # a plan that does not fit is refused
        check_serialised_with_plan_reversed()


def check_serialised_with_plan_reversed():
    """A plan whose sends come out of program order cannot be posted: the model says so."""
    import parlab.parallel.pipeline.plan as pp
    s = sch.one_f_one_b(2, 3)
    orig = pp.merged_plan
    pp.merged_plan = lambda sc, r: list(reversed(orig(sc, r)))
    try:
        pp.serialised_run(s, "merged", "rank")
    finally:
        pp.merged_plan = orig


def test_merged_plan_is_the_global_order_and_agrees_with_each_pairs_order():
    s = sch.interleaved_1f1b(4, 8, 2)
    seq = sch.message_sequence(s)
    for r in range(s.ranks):
        plan = merged_plan(s, r)
        assert len(plan) == sum(r in (src, dst) for src, dst, *_ in seq)
        for peer, pair in pair_plans(s, r).items():   # restricted to one peer: the pair's mirrored order
            assert [p for p in plan if p.peer == peer] == pair
    assert merged_plan(sch.one_f_one_b(2, 2), 0) == [
        Post("send", 1, ("act", 1, 0)), Post("send", 1, ("act", 1, 1)), Post("recv", 1, ("grad", 0, 0)),
        Post("recv", 1, ("grad", 0, 1))]


def test_bad_model_arguments_are_refused():
    with pytest.raises(ValueError, match="posting must be one of"):
        serialised_run(sch.gpipe(2, 2), "random")
    with pytest.raises(ValueError, match="queues must be one of"):
        serialised_run(sch.gpipe(2, 2), "merged", "none")


# ---------------------------------------------------------------------- the shim itself
def _ring(first_recv_on_rank0):
    """Every rank sends to the next and receives from the previous; rank 0 may post its receive first."""
    r, n = dist.get_rank(), dist.get_world_size()
    out, got = torch.full((4,), float(r)), torch.empty(4)
    with serialised_p2p():
        if r == 0 and first_recv_on_rank0:
            rw = parlab.comm.irecv(got, (r - 1) % n)
            sw = parlab.comm.isend(out, (r + 1) % n)
        else:
            sw = parlab.comm.isend(out, (r + 1) % n)
            rw = parlab.comm.irecv(got, (r - 1) % n)
        rw.wait()
        sw.wait()
    return got


def test_shim_runs_an_order_that_is_safe_on_nccl():
    res = parlab.run(_ring, 3, True, echo=False)
    assert [float(g[0]) for g in res.results] == [2.0, 0.0, 1.0]


def test_shim_deadlocks_where_nccl_would():
    # all three ranks post "send to the next" first: fine on plain gloo (sends are buffered), a cycle on NCCL
    assert [float(g[0]) for g in parlab.run(_ring_plain, 3, echo=False).results] == [2.0, 0.0, 1.0]
    with pytest.raises(parlab.RankTimeout):   # a true deadlock: no timeout is long enough
        parlab.run(_ring, 3, False, timeout=8, echo=False)


def _ring_plain():
    r, n = dist.get_rank(), dist.get_world_size()
    out, got = torch.full((4,), float(r)), torch.empty(4)
    sw = parlab.comm.isend(out, (r + 1) % n)
    parlab.comm.recv(got, (r - 1) % n)
    sw.wait()
    return got


# ---------------------------------------------------------------------- the executor under the shim
def _shim_cases(cases):
    out = []
    with serialised_p2p():
        for s in cases:
            pp = PipelineParallel(GPT(CFG, seed=0, dtype=torch.float64), s)
            loss = pp.step(*_batch())
            out.append((loss, {k: g.clone() for k, g in pp.grads().items()}))
    return out


@pytest.mark.parametrize("p", [3, 4])
def test_every_schedule_runs_under_nccl_p2p_rules_and_matches_the_unsplit_model(p):
    # the interleaved cases are those the per-pair order deadlocked on (see the test above)
    cases = [sch.gpipe(p, p), sch.one_f_one_b(p, 2 * p), sch.zero_bubble_h1(p, p), sch.interleaved_1f1b(p, p, 2)]
    if p == 3:
        cases.append(sch.interleaved_1f1b(3, 6, 2, memory_optimised=True))
    res = parlab.run(_shim_cases, p, cases, timeout=120)
    x, y = _batch()
    for k, s in enumerate(cases):
        _check([r[k] for r in res.results], CFG, x, y, f"{s.name} p={p} m={s.microbatches} (serialised p2p)")
