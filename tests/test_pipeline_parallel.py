"""The pipeline executor: every schedule gives the loss and gradients of the unsplit model; traced messages."""
import pytest
import torch

import parlab
from parlab.parallel import pipeline as sch
from parlab.parallel.groups import build_groups
from parlab.models import GPT, GPTConfig
from parlab.parallel.pipeline import PipelineParallel, measured_bubble, measured_costs, measured_spans, split_layers
from parlab.parallel.topology import ParallelGrid
from p2p_order import assert_mirrored_p2p

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=8, n_head=2, n_embd=16)
BATCH = 24                     # divisible by every micro-batch count used below


def _batch(rows=BATCH):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g)   # (B, S)
    y = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g)   # (B, S)
    return x, y


def _cases(p):
    """(schedule, model config) pairs run on p ranks: every generator, m below, equal to and above p.
    (Kept small: the wall time here is message latency between processes on a busy 2-core machine.)"""
    ms = (1, 3, 4) if p == 2 else (2, 4, 6)
    out = [g(p, m) for m in ms for g in (sch.gpipe, sch.one_f_one_b, sch.zero_bubble_h1)]
    out += [sch.naive(p, 2), sch.interleaved_1f1b(p, 4, 2, memory_optimised=True)]
    out += [sch.interleaved_1f1b(p, m, 2) for m in sorted({4, 2 * p})]
    if p == 2:
        out += [sch.interleaved_1f1b(p, 2, 3)]
    out += [sch.dualpipe_v(p, {2: 6, 4: 8}[p])]     # a V: stage p - 1 hands to stage p on its own rank
    cases = [(s, CFG) for s in out]
    untied = GPTConfig(**{**CFG.__dict__, "tie_embeddings": False, "n_layer": 5})   # uneven split, no tie
    cases += [(sch.one_f_one_b(p, 4), untied)] + ([(sch.zero_bubble_h1(p, 4), untied)] if p == 2 else [])
    return cases


def _run_cases(cases):
    """On every rank: each case's loss (None off the last stage) and this rank's parameter gradients."""
    out = []
    for s, cfg in cases:
        pp = PipelineParallel(GPT(cfg, seed=0, dtype=torch.float64), s)
        loss = pp.step(*_batch())
        out.append((loss, {k: g.clone() for k, g in pp.grads().items()}))
    return out


def _reference(cfg, x, y):
    """The unsplit model's mean loss and gradients on the whole batch (one thread: the model is tiny, and two
    OpenMP threads on a busy 2-core machine are many times slower than one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = GPT(cfg, seed=0, dtype=torch.float64)
        _, loss = model(x, y)
        loss.backward()
        return loss.detach(), {n: q.grad for n, q in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _check(results, cfg, x, y, label, check_loss=True):
    """`results`: (loss or None, grads) of every rank of one pipeline; compared with the unsplit model."""
    ref_loss, ref_grads = _reference(cfg, x, y)
    losses = [r[0] for r in results if r[0] is not None]
    assert len(losses) == 1, f"{label}: exactly one rank holds the last stage"
    # float64 throughout; the pipeline sums m micro-batch gradients where the reference does one batch, so the
    # results differ only by rounding (~1e-16 relative); 1e-10 leaves room and still catches any real mistake
    if check_loss:
        torch.testing.assert_close(losses[0], ref_loss, rtol=1e-10, atol=1e-12, msg=label)
    got = {}
    for _, grads in results:
        for name, g in grads.items():
            if name in got:        # a tied embedding held on two ranks: both copies end with the same gradient
                torch.testing.assert_close(g, got[name], rtol=0, atol=0, msg=f"{label} {name}")
            got[name] = g
    assert set(got) == set(ref_grads), f"{label}: parameters missing or extra"
    for name, g in ref_grads.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-12, msg=f"{label} {name}")


@pytest.mark.parametrize("p", [1, 2, 4])
def test_every_schedule_matches_the_unsplit_model(p):
    cases = _cases(p) if p > 1 else [(s, CFG) for s in (sch.one_f_one_b(1, 4), sch.zero_bubble_h1(1, 3),
                                                        sch.interleaved_1f1b(1, 4, 2), sch.dualpipe_v(1, 2))]
    # (p = 1: every hand-off is local)
    res = parlab.run(_run_cases, p, cases)
    x, y = _batch()
    for k, (s, cfg) in enumerate(cases):
        _check([r[k] for r in res.results], cfg, x, y, f"{s.name} p={p} m={s.microbatches}")


def _traced_step(name):
    s = {"1f1b": sch.one_f_one_b(2, 4), "interleaved": sch.interleaved_1f1b(2, 4, 2),
         "zb-h1": sch.zero_bubble_h1(2, 4)}[name]
    PipelineParallel(GPT(CFG, seed=0, dtype=torch.float64), s).step(*_batch())
    return s


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-h1"])
def test_every_action_and_message_is_traced_and_labelled(name):
    res = parlab.run(_traced_step, 2, name, trace=True)
    s, tr = res.results[0], res.trace
    spans = measured_spans(tr)
    for r in range(2):      # the measured timeline runs exactly the scheduled actions, in order
        assert [a for _, _, a in spans[r]] == list(s.actions[r])
    end = {(a.stage, a.kind, a.mb): t1 for sp in spans.values() for _, t1, a in sp}
    for sp in spans.values():   # the real run kept every dependency (one clock: all ranks share the machine)
        for t0, _, a in sp:
            if a.kind == "F" and a.stage > 0:
                assert t0 >= end[(a.stage - 1, "F", a.mb)]
            if a.kind in "BI" and a.stage < s.stages - 1:
                assert t0 >= end.get((a.stage + 1, "B", a.mb), end.get((a.stage + 1, "I", a.mb)))
    costs = measured_costs(tr)   # feeds simulate(): one mean duration per (stage, kind) the schedule uses
    assert set(costs) == {(a.stage, a.kind) for acts in s.actions for a in acts} and min(costs.values()) > 0
    sim = sch.simulate(s, costs=lambda a: costs[(a.stage, a.kind)])
    assert 0 < sim.bubble_fraction < 1 and 0 < measured_bubble(tr) < 1   # compared in benchmarks/pipeline.py only
    m, S = s.microbatches, s.stages
    # one activation and one gradient per stage boundary and micro-batch, plus the tied-embedding exchange
    assert tr.count("send") == tr.count("recv") == 2 * (S - 1) * m + 2
    for st in range(S - 1):
        for i in range(m):
            assert tr.count("send", label=f"stage {st} -> {st + 1} act mb {i}") == 1
            assert tr.count("recv", label=f"stage {st + 1} -> {st} grad mb {i}") == 1
    assert tr.count("send", label="tied embedding grad") == 2
    msg = tr.filter(op="send").events[0]
    assert msg.nbytes == (BATCH // m) * CFG.seq_len * CFG.n_embd * 8      # (b, S, H) float64


def _pp_dp():
    pg = build_groups(ParallelGrid(4, pp=2, dp=2), dims=("dp", "pp"))
    x, y = _batch()
    rows, d = BATCH // 2, pg.coords["dp"]
    out = []
    for s in (sch.one_f_one_b(2, 3), sch.zero_bubble_h1(2, 3)):
        pp = PipelineParallel(GPT(CFG, seed=0, dtype=torch.float64), s, group=pg.pp, dp_group=pg.dp)
        loss = pp.step(x[d * rows:(d + 1) * rows], y[d * rows:(d + 1) * rows])   # each replica: its half batch
        out.append((loss, {k: g.clone() for k, g in pp.grads().items()}))
    return out


def test_pipeline_with_data_parallel_averages_gradients_once_per_step():
    res = parlab.run(_pp_dp, 4, trace=True)
    x, y = _batch()
    ref_loss, _ = _reference(CFG, x, y)
    for k, name in enumerate(["1f1b", "zb-h1"]):
        got = [r[k] for r in res.results]
        # pp groups are [0, 2] and [1, 3] (global ranks, not 0..p-1): the last stage is on ranks 2 and 3
        assert got[0][0] is None and got[1][0] is None
        torch.testing.assert_close((got[2][0] + got[3][0]) / 2, ref_loss, rtol=1e-10, atol=1e-12)
        for replica in ([0, 2], [1, 3]):   # each replica's two stages together hold the full-batch gradients
            _check([got[r] for r in replica], CFG, x, y, f"{name} pp x dp, ranks {replica}", check_loss=False)
    for r in range(4):                     # one flat gradient all-reduce per step, over the dp group only
        assert res.trace.count("all_reduce", rank=r, label="pipeline dp grads") == 2
        # and on the last stage the global count of non-ignored targets (one integer) for the loss's mean
        assert res.trace.count("all_reduce", rank=r) == 2 + (2 if r >= 2 else 0)
        assert all(e.group == ((0, 1) if r < 2 else (2, 3)) for e in res.trace.filter(op="all_reduce", rank=r))


def _emulated(device_time):
    s = sch.one_f_one_b(2, 2)
    pp = PipelineParallel(GPT(CFG, seed=0), s, device_time=device_time)
    return s, pp.step(*_batch(8))


def test_device_time_stretches_every_action_by_its_unit_cost():
    dt = 0.01
    res = parlab.run(_emulated, 2, dt, trace=True)
    s, spans = res.results[0][0], measured_spans(res.trace)
    assert res.results[1][1] is not None                  # the loss, on the last stage
    for r in range(2):
        assert [a for _, _, a in spans[r]] == list(s.actions[r])
        for t0, t1, a in spans[r]:                        # each span holds at least its emulated device work
            assert t1 - t0 >= dt * sch.unit_cost(a) * 0.99
    assert measured_bubble(res.trace) > 0
    with pytest.raises(parlab.RankError, match="device_time is seconds"):
        parlab.run(_emulated, 2, -1.0, echo=False)


def _wrong_size():
    PipelineParallel(GPT(CFG, seed=0), sch.one_f_one_b(4, 4))


def test_schedule_for_another_pipeline_size_is_refused():
    with pytest.raises(parlab.RankError, match="is for 4 ranks but the pipeline group has 2"):
        parlab.run(_wrong_size, 2, echo=False)


def test_stage_split_is_balanced_and_refuses_too_many_stages():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert [len(r) for r in split_layers(6, 4)] == [1, 2, 2, 1]     # extra layers to the middle stages
    with pytest.raises(ValueError, match="the model has 4 layers but the pipeline has 8"):
        split_layers(4, 8)


def _traced_steps(schedules):
    for s in schedules:
        PipelineParallel(GPT(CFG, seed=0, dtype=torch.float64), s).step(*_batch())


@pytest.mark.parametrize("p", [2, 4])
def test_every_rank_pair_posts_its_messages_in_one_mirrored_order(p):
    # NCCL runs the sends and receives between two GPUs one after another on one stream, and a send may not
    # finish before its receive is posted. So if rank a posts "send X, recv Y" while rank b posts "send Y,
    # recv X", both streams wait for each other forever (gloo buffers sends, so it hides this). The executor
    # must therefore post, for every pair of ranks, the same sequence of messages on both sides: a send on
    # one side where the other has the receive. Checked from the trace, which records calls in post order.
    schedules = [sch.gpipe(p, 4), sch.one_f_one_b(p, 4), sch.one_f_one_b(p, {2: 6, 4: 8}[p]),
                 sch.interleaved_1f1b(p, 4, 2), sch.zero_bubble_h1(p, 4), sch.dualpipe_v(p, 2 * p)]
    assert_mirrored_p2p(parlab.run(_traced_steps, p, schedules, trace=True).trace)
