"""What a step costs beyond products and bytes: special functions (exp, erf) counted by the meter and charged at
their own rate, and the delay of a transfer inside a training step (`Hardware.comm_delay`) and the rank's share of
an asynchronous call (`Hardware.comm_cpu`), with the calibration fits that measure them (`parlab.cluster.calibrate.special`,
`parlab.cluster.calibrate.programs`)."""
import dataclasses
import json

import pytest
import torch

from parlab.cluster.hardware import Hardware, hardware_preset
from parlab.cluster.replay import replay, step_time
from parlab.trace.meter import CostMeter
from parlab.trace import Event, Trace

# 1 FLOP/s, free memory and kernels, links of 1 byte/s without latency: times are easy to add up by hand
UNIT = Hardware("unit", peak_flops=1.0, mem_bw=1e300, intra_bw=1.0, inter_bw=1.0, efficiency=1.0,
                mem_efficiency=1.0, base_latency=0.0, intra_latency=0.0, inter_latency=0.0)


# ---------------------------------------------------------------------- special functions
def test_the_meter_counts_one_special_result_per_element_of_the_largest_operand():
    x = torch.randn(12, 10)
    cases = [(lambda: x.exp(), 120), (lambda: torch.nn.functional.gelu(x), 120),
             (lambda: x.logsumexp(-1), 120),                   # an exponential per input element, 12 outputs
             (lambda: x.softmax(-1), 120), (lambda: x + x, 0), (lambda: x @ x.T, 0)]
    for fn, want in cases:
        meter = CostMeter()
        with meter:
            fn()
        assert meter.special == want and meter.state()[5] == want


def test_special_results_cost_their_rate_on_top_of_their_bytes_and_nothing_without_one():
    h = UNIT.with_(mem_bw=100.0)
    assert h.compute_time(0.0, 400, 0, (), 0.0, 50) == pytest.approx(4.0)          # no rate: bytes only
    assert h.with_(special_rate=10.0).compute_time(0.0, 400, 0, (), 0.0, 50) == pytest.approx(4.0 + 5.0)
    # the presets: 16 per clock per SM (A100: 108 SMs at 1.41 GHz), the H100's 3.9 T / s (FlashAttention-3)
    assert hardware_preset("dgx-a100").special_rate == pytest.approx(108 * 16 * 1.41e9)
    assert hardware_preset("dgx-h100").special_rate == 3.9e12
    for bad in (0.0, -1.0, True, "fast"):
        with pytest.raises(ValueError, match="special_rate must be a positive rate"):
            UNIT.with_(special_rate=bad)


def test_a_trace_recorded_before_special_results_were_counted_replays_as_before():
    """Running totals of five (no special count) and of six (no plain-kernel count) split a span exactly as seven
    with those counts 0."""
    def trace(extra):
        evs = []
        for r in (0, 1):
            evs += [Event(r, "compute", "step", 0.0, 3.0, flops=6.0, kernels=2, meter_at=(6.0, 0, 2, (), 0.0, *extra)),
                    Event(r, "collective", "all_reduce", 1.0, 2.0, group=(0, 1), nbytes=4,
                          meter_at=(2.0, 0, 1, (), 0.0, *extra))]
        return Trace(evs)
    old, six, new = replay(trace(()), UNIT), replay(trace((0,)), UNIT), replay(trace((0, 0)), UNIT)
    assert [(e.op, e.start, e.end) for e in old.events] == [(e.op, e.start, e.end) for e in new.events]
    assert [(e.op, e.start, e.end) for e in six.events] == [(e.op, e.start, e.end) for e in new.events]
    pieces = sorted((e.start, e.end) for e in old.events if e.rank == 0 and e.kind == "compute")
    # cut at the all-reduce (4 s) by the metered flops, 2 before it and 4 after (not by the measured 1 s and 1 s)
    assert pieces == [(0.0, 2.0), (6.0, 10.0)]


def test_the_special_rate_fit_recovers_the_rate_of_exact_samples():
    from parlab.cluster.calibrate.special import fit_special_rate
    h = UNIT.with_(mem_bw=1e9, kernel_overhead=1e-6)
    rate = 2e8
    samples = [(8 * n, 1, ((20, 8 * n),), n, h.compute_time(0.0, 8 * n, 1, ((20, 8 * n),)) + n / rate)
               for n in (1 << 14, 1 << 16, 1 << 18)]
    assert fit_special_rate(h, samples) == pytest.approx(rate)
    no_slower = [(b, k, hist, n, h.compute_time(0.0, b, k, hist)) for b, k, hist, n, _ in samples]
    assert fit_special_rate(h, no_slower) is None            # free beyond their bytes: no rate at all


# ---------------------------------------------------------------------- a transfer's delay inside a step
def _two_ranks(asynchronous: bool, compute_after: float):
    """Each rank: compute 1 s, an all-reduce of 2 bytes (2 s on UNIT's ring: 2(N-1)/N x 2 B / 1 B/s), then
    `compute_after` s of compute; asynchronous: issued before that compute and waited for after it."""
    evs = []
    for r in (0, 1):
        evs += [Event(r, "compute", "a", 0.0, 1.0, flops=1.0),
                Event(r, "collective", "all_reduce", 1.0, 1.0, group=(0, 1), nbytes=2, asynchronous=asynchronous,
                      waited=9.0 if asynchronous else None),
                Event(r, "compute", "b", 2.0, 3.0, flops=compute_after)]
    return Trace(evs)


def test_a_delay_lengthens_a_blocking_call_and_hides_behind_compute_issued_after_an_async_one():
    assert step_time(replay(_two_ranks(False, 1.0), UNIT)) == 4.0                     # 1 + 2 + 1
    assert step_time(replay(_two_ranks(False, 1.0), UNIT.with_(comm_delay=0.5))) == 4.5
    # asynchronous, 3 s of compute after the issue: the transfer (2 s, + 0.5 s delay) ends under it
    assert step_time(replay(_two_ranks(True, 3.0), UNIT)) == 4.0
    assert step_time(replay(_two_ranks(True, 3.0), UNIT.with_(comm_delay=0.5))) == 4.0
    # ... unless the delay outlasts the compute: the wait then holds the rank until the transfer ends
    assert step_time(replay(_two_ranks(True, 3.0), UNIT.with_(comm_delay=1.5))) == pytest.approx(4.5)
    # the delay does not keep the rank busy: on a CPU description (no overlap) the issue costs the transfer's 2 s,
    # and the delay only shows where the rank waits
    serial = UNIT.with_(comm_overlap=False)
    assert step_time(replay(_two_ranks(True, 1.0), serial)) == 4.0                    # 1 + 2 (at issue) + 1
    assert step_time(replay(_two_ranks(True, 1.0), serial.with_(comm_delay=0.5))) == 4.0   # ends at 3.5 < 4
    assert step_time(replay(_two_ranks(True, 1.0), serial.with_(comm_delay=1.5))) == 4.5
    assert hardware_preset("dgx-h100").comm_delay == 0.0 and hardware_preset("dgx-a100").comm_delay == 0.0
    for bad in (-1e-3, "1 ms", None):
        with pytest.raises(ValueError, match="comm_delay must be a time >= 0"):
            UNIT.with_(comm_delay=bad)


def test_an_asynchronous_call_takes_its_share_of_the_rank_only_where_communication_does_not_overlap():
    serial = UNIT.with_(comm_overlap=False)
    # issue at 1: the 2 s transfer is charged to the rank (serial), + 0.5 s share, then 1 s of compute
    assert step_time(replay(_two_ranks(True, 1.0), serial.with_(comm_cpu=0.5))) == 4.5
    assert step_time(replay(_two_ranks(True, 1.0), UNIT.with_(comm_cpu=0.5))) == 3.0     # overlapping: no share
    assert step_time(replay(_two_ranks(False, 1.0), serial.with_(comm_cpu=0.5))) == 4.0  # blocking: the delay's job
    msgs = Trace([Event(0, "compute", "a", 0.0, 1.0, flops=1.0),
                  Event(0, "p2p", "send", 1.0, 1.0, group=(0, 1), peer=1, nbytes=1, asynchronous=True, waited=5.0),
                  Event(0, "compute", "b", 1.0, 2.0, flops=1.0),
                  Event(1, "p2p", "recv", 0.0, 0.0, group=(0, 1), peer=0, nbytes=1)])
    out = replay(msgs, serial.with_(comm_cpu=0.25))                     # a message's share: 1 s + 0.25 s at issue
    assert [e.start for e in out.events if e.rank == 0 and e.op == "b"] == [2.25]
    for bad in (-1e-3, "1 ms", None):
        with pytest.raises(ValueError, match="comm_cpu must be a time >= 0"):
            UNIT.with_(comm_cpu=bad)
    assert hardware_preset("dgx-h100").comm_cpu == 0.0 and hardware_preset("dgx-h100").comm_streams == 1


def _measured(metered: Trace, hw: Hardware, delay: float, cpu: float = 0.0) -> float:
    return step_time(replay(metered, hw.with_(comm_delay=delay, comm_cpu=cpu)))


def test_the_step_fit_tells_the_delay_from_the_ranks_share_by_blocking_and_asynchronous_programs():
    """Programs measured as replays with delay 2 ms and share 0.5 ms on a serial description: a blocking call
    pays only the delay, an asynchronous one issued before 1 s of compute only the share (its transfer ends under
    the compute), so the two are told apart and recovered to the grid's resolution."""
    from parlab.cluster.calibrate.programs import fit_step_comm
    serial = UNIT.with_(comm_overlap=False, intra_bw=1e6, inter_bw=1e6)   # 2 us transfers: the fit sees ms
    traces = [_two_ranks(False, 1.0), _two_ranks(True, 1.0), _two_ranks(False, 0.2)]
    programs = [(_measured(tr, serial, 2e-3, 5e-4), tr) for tr in traces]
    fit = fit_step_comm(serial, programs)
    # the grids' steps: 0.5 ms of delay and 0.3 ms of share, halved in each of 4 refinements: 31 and 19 us
    assert fit["delay"] == pytest.approx(2e-3, abs=3.2e-5) and fit["cpu"] == pytest.approx(5e-4, abs=1.9e-5)
    assert fit["after"] == pytest.approx([1.0] * 3, abs=1e-4)
    assert fit_step_comm(UNIT, programs[:1])["cpu"] == 0.0      # overlapping communication: no share to fit


def test_the_step_fit_recovers_a_known_delay_from_programs_replayed_with_it():
    from parlab.cluster.calibrate.programs import fit_step_comm
    programs = [(_measured(tr, UNIT, 2.5e-3), tr) for tr in (_two_ranks(False, 1.0), _two_ranks(False, 0.2))]
    fit = fit_step_comm(UNIT, programs)
    assert fit["delay"] == pytest.approx(2.5e-3, abs=1e-6)     # grid of 0.25 ms refined twice: to 0.16 us
    assert fit["after"] == pytest.approx([1.0, 1.0], abs=1e-3)
    assert all(b < 1 for b in fit["before"])
    tr = programs[0][1]
    none = fit_step_comm(UNIT, [(step_time(replay(tr, UNIT)), tr)])
    assert none["delay"] == 0.0                                  # replayed = measured already: no delay


def test_calibration_puts_the_fitted_delay_in_the_description_and_its_report():
    """describe() with training-step programs among a rank's measurements: the programs' steps (as each rank
    returns them: events per step, the metered step last) fit comm_delay, which replaces the message probe's
    in-step p2p cost."""
    from test_replay_model import _per_rank
    from parlab.cluster.calibrate import describe
    base, _ = describe([_per_rank(2.0)] * 2, 2, "synthetic")
    assert base.comm_delay == 0.0 and base.p2p_latency == pytest.approx(6e-5, rel=1e-3)   # the probe's in-step cost
    metered = Trace([dataclasses.replace(e, flops=e.flops * 1e-3) for e in _two_ranks(False, 1.0).events])
    hw_programs = base.with_(comm_delay=0.0)
    measured = replay(metered, hw_programs.with_(comm_delay=3e-3))
    per_rank = []
    for r in (0, 1):
        steps = [[e for e in measured.events if e.rank == r]] * 3
        per_rank.append(dict(_per_rank(2.0), comm_streams=2, program_labels=[f"prog{i}" for i in range(4)],
                             programs=[steps + [[e for e in metered.events if e.rank == r]]] * 4))
    hw, text = describe(per_rank, 2, "synthetic")
    assert all(f"prog{i}: " in text for i in range(4))          # each program named by what the ranks ran
    assert hw.comm_streams == 2 and "(2 collective(s) of a group in flight at once)" in text
    assert hw.p2p_latency == pytest.approx(3e-5, rel=1e-3)      # the isolated fit: the programs measure in-step
    assert "not used: the training-step programs below measure it" in text
    assert "communication inside training steps: each collective ends" in text
    assert hw.comm_delay > 0 and "parlab.cluster.calibrate.programs" in hw.source
    assert step_time(replay(metered, hw)) == pytest.approx(step_time(measured), rel=2e-3)


def test_calibration_reads_how_many_collectives_gloo_runs_at_once(monkeypatch):
    import torch.distributed as dist

    from parlab.cluster.calibrate import measure as calibrate
    assert calibrate._gloo_threads() == dist.ProcessGroupGloo._Options()._threads == 2    # torch's default pool
    monkeypatch.setattr(dist, "ProcessGroupGloo", object())                              # no such options here
    assert calibrate._gloo_threads() == 2


# ---------------------------------------------------------------------- rank processes keep freed memory
def test_keeping_freed_memory_is_harmless_where_there_is_no_glibc(monkeypatch):
    import ctypes

    import parlab.launch.child as rp
    rp._keep_freed_memory()                                     # on this Linux: glibc's mallopt, no error

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", missing)
    rp._keep_freed_memory()                                     # elsewhere: nothing happens


def test_calibration_programs_run_on_every_rank_and_merge_into_measured_steps_and_one_metered():
    """The calibration's DDP, FSDP, 1F1B and ring-attention steps on 2 gloo ranks: timed steps go round the
    programs, the metered one is last and carries the work a replay needs and the program's communication
    (all-reduces, all-gathers, messages)."""
    import parlab
    from parlab.cluster.calibrate.programs import merge, step_traces
    programs = (("ddp", (32, 1, 2, 16, 2), 0.01), ("fsdp", (32, 2, 2, 16, 2), None), ("1f1b", (32, 1, 2, 16, 1), 2),
                ("ring", (2, 8, 16), None))
    res = parlab.run(step_traces, 2, 2, programs, backend="gloo", echo=False)
    assert [len(p) for p in res.results[0]] == [3, 3, 3, 3]    # 2 timed steps + the metered one, per program
    merged = merge(res.results)
    ops = [{e.op for e in tr.events if e.kind in ("collective", "p2p")} for _, tr in merged]
    assert "all_reduce" in ops[0] and {"all_gather", "reduce_scatter"} <= ops[1]
    assert {"send", "recv"} <= ops[2] and {"send", "recv"} <= ops[3]
    for measured, metered in merged:
        assert measured > 0 and sorted({e.rank for e in metered.events}) == [0, 1]
        assert all(len(e.meter_at) == 7 for e in metered.events)             # metered: every event has totals
        # the work of the wrappers' regions, and of what runs between them (found from those totals)
        out = replay(metered, hardware_preset("dgx-h100"))
        assert sum(e.flops for e in out.events if e.kind == "compute") > 0 and step_time(out) > 0


def _traces_with_between(steps, programs):
    """step_traces with a `between` that runs a collective of its own (as the benchmark's workloads do)."""
    import torch

    from parlab import comm
    from parlab.cluster.calibrate.programs import step_traces
    seen = []

    def between():
        t = torch.ones(1)
        comm.all_reduce(t)
        seen.append(float(t))
    return step_traces(steps, programs, between=between), seen


def test_calibration_calls_between_after_each_round_of_programs():
    """`between` (benchmarks/replay.py times its workloads there) runs once per round of the timed programs, on
    every rank, and its collectives do not disturb the programs' steps."""
    import parlab
    programs = (("ddp", (32, 1, 2, 16, 2), 0.01), ("ring", (2, 8, 16), None))
    res = parlab.run(_traces_with_between, 2, 3, programs, backend="gloo", echo=False)
    for traces, seen in res.results:
        assert seen == [2.0, 2.0, 2.0]                          # 3 rounds, both ranks in each all-reduce
        assert [len(p) for p in traces] == [4, 4]               # 3 timed steps + the metered one, per program


def test_calibration_programs_are_named_by_wrapper_shape_and_bucket():
    from parlab.cluster.calibrate.programs import PROGRAMS, program_label
    assert program_label("ddp", (96, 3, 4, 64, 8), 0.25) == "ddp 96x3x4x64x8 (0.25 MiB buckets)"
    assert program_label("fsdp", (112, 3, 4, 64, 6), None) == "fsdp 112x3x4x64x6"
    assert program_label("1f1b", (96, 1, 4, 96, 2), 3) == "1f1b 96x1x4x96x2 (3 micro-batches per stage)"
    assert program_label("ring", (2, 48, 384), None) == "ring 2x48x384"
    assert len({program_label(*p) for p in PROGRAMS}) == len(PROGRAMS)   # the report can tell them apart


# ---------------------------------------------------------------------- ops under autograd and outside it
def test_the_meter_counts_the_ops_run_outside_autograd_apart():
    """Forward ops autograd records and the backward nodes' ops are not plain; the optimizer's, no_grad ops and
    the add that accumulates a gradient into .grad (the AccumulateGrad node's) are."""
    from parlab.trace import count_costs, recording, region
    w = torch.ones(8, 8, requires_grad=True)
    x = torch.ones(4, 8)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    with recording() as rec:
        with count_costs():
            with region("forward"):
                loss = (x @ w).relu().sum()
            with region("backward"):
                loss.backward()
            loss = (x @ w).relu().sum()
            with region("accumulating backward"):
                loss.backward()                                               # adds into w.grad
            with region("optimizer"):
                opt.step()
            with region("bookkeeping"):
                with torch.no_grad():
                    w.mul_(2)
    fwd, bwd, acc, step, book = [e for e in rec.events if e.kind == "compute"]
    assert fwd.kernels >= 3 and bwd.kernels >= 2 and fwd.plain_kernels == bwd.plain_kernels == 0
    assert acc.kernels == bwd.kernels + 1 and acc.plain_kernels == 1         # the add into .grad: plain work
    assert step.kernels >= 2 and step.plain_kernels == step.kernels            # SGD with momentum: every op plain
    assert (book.kernels, book.plain_kernels) == (1, 1)
    assert book.meter_at[6] == acc.plain_kernels + step.plain_kernels + 1     # the running total, 7th of the state


def test_ops_outside_autograd_cost_their_own_overhead_when_the_description_has_one():
    from test_replay_model import TWO
    base = TWO.with_(kernel_overhead=5e-6)
    assert base.plain_kernel_overhead is None
    assert base.compute_time(kernels=10, plain_kernels=4) == pytest.approx(10 * 5e-6)     # None: one cost per op
    two = base.with_(plain_kernel_overhead=1e-6)
    assert two.compute_time(kernels=10, plain_kernels=4) == pytest.approx(6 * 5e-6 + 4 * 1e-6)
    assert two.compute_time(kernels=3, plain_kernels=9) == pytest.approx(3 * 1e-6)        # never more than all
    assert Hardware.from_dict(json.loads(json.dumps(two.to_dict()))) == two
    new_fields = ("plain_kernel_overhead", "p2p_delay", "p2p_cpu")
    old = {k: v for k, v in two.to_dict().items() if k not in new_fields}                  # written before them
    assert all(getattr(Hardware.from_dict(old), k) is None for k in new_fields)
    with pytest.raises(ValueError, match="plain_kernel_overhead must be a time >= 0"):
        base.with_(plain_kernel_overhead=-1e-6)


def test_the_step_fit_recovers_both_per_op_costs_from_steps_timed_in_two_parts():
    """Rows as step_samples gives them: per shape a forward + backward part (no plain ops) and an optimizer part
    (memory-bound, every op plain). Exact times from known costs: the fit recovers c, c_plain, beta, gamma."""
    from test_replay_model import _STEPS, TWO

    from parlab.cluster.calibrate.step import PARTS, apply_step_fit, fit_step
    c, c_plain, beta, gamma = 9e-6, 3e-6, 2.0, 1.3
    rows = []
    for i, (f, b, k, h, fb) in enumerate(_STEPS):
        t = gamma * TWO.compute_time(f, 0, 0, (), fb) + beta * TWO.compute_time(0, b, 0, h) + k * c
        rows.append((f, b, k, t, h, fb, 0, 0, PARTS[0]))
        k_opt, b_opt = 60 * (i + 2), int(2e6 * (5 - i) ** 2)                  # optimizers of different mixes
        h_opt = ((20, b_opt),)
        t_opt = beta * TWO.compute_time(0, b_opt, 0, h_opt) + k_opt * c_plain
        rows.append((0.0, b_opt, k_opt, t_opt, h_opt, 0.0, 0, k_opt, PARTS[1]))
    got = fit_step(TWO, rows)
    assert got["cv"] < 1e-9
    assert (got["c"], got["c_plain"], got["beta"], got["gamma"]) == pytest.approx((c, c_plain, beta, gamma), rel=1e-6)
    hw = apply_step_fit(TWO, got["c"], got["beta"], got["gamma"], got["c_plain"])
    assert (hw.kernel_overhead, hw.plain_kernel_overhead) == pytest.approx((c, c_plain), rel=1e-6)
    for f, b, k, t, h, fb, sp, kp, _ in rows:                               # the description times each part
        assert hw.compute_time(f, b, k, h, fb, sp, kp) == pytest.approx(t, rel=1e-6)
    # one cost per op for both kinds (what the fit did before): each optimizer op overcharged by c - c_plain
    one = apply_step_fit(TWO, c, beta, gamma)
    f, b, k, t, h, fb, sp, kp, _ = rows[1]
    assert one.compute_time(f, b, k, h, fb, sp, kp) - t == pytest.approx(k * (c - c_plain), rel=1e-6)


# ---------------------------------------------------------------------- messages: a delay and share of their own
def _ring_pair(compute_after: float):
    """Each rank: compute 1 s, a send to the other and a receive from it (1 byte each: 1 s on UNIT's link,
    asynchronous, waited for after `compute_after` s of compute), then an all-reduce of 2 bytes (2 s), blocking."""
    evs = []
    for r in (0, 1):
        o = 1 - r
        evs += [Event(r, "compute", "a", 0.0, 1.0, flops=1.0),
                Event(r, "p2p", "send", 1.0, 1.0, group=(0, 1), peer=o, nbytes=1, asynchronous=True, waited=9.0),
                Event(r, "p2p", "recv", 1.0, 1.0, group=(0, 1), peer=o, nbytes=1, asynchronous=True, waited=9.0),
                Event(r, "compute", "b", 1.0, 2.0, flops=compute_after),
                Event(r, "collective", "all_reduce", 9.5, 9.5, group=(0, 1), nbytes=2)]
    return Trace(evs)


def test_messages_take_their_own_delay_and_share_when_the_description_has_them():
    serial = UNIT.with_(comm_overlap=False)
    hw = serial.with_(comm_delay=0.5, comm_cpu=0.25)
    # the pair is issued together at 1 (1 s, + the share), compute 1 s, wait for the pair, the all-reduce 2 s
    # + 0.5 s delay: p2p_delay / p2p_cpu None take the collectives' own
    assert step_time(replay(_ring_pair(1.0), hw)) == pytest.approx(1 + 1 + 0.25 + 1 + 2 + 0.5)
    assert step_time(replay(_ring_pair(1.0), hw.with_(p2p_cpu=0.75))) == pytest.approx(1 + 1 + 0.75 + 1 + 2 + 0.5)
    # the messages end at 1 + 1 + 3 (their delay) = 5, after the compute (3.25): the wait holds the rank to 5
    assert step_time(replay(_ring_pair(1.0), hw.with_(p2p_delay=3.0))) == pytest.approx(5 + 2 + 0.5)
    for k in ("p2p_delay", "p2p_cpu"):
        assert getattr(hardware_preset("dgx-h100"), k) is None
        with pytest.raises(ValueError, match=f"{k} must be a time >= 0 in seconds or None"):
            UNIT.with_(**{k: -1.0})


def test_the_step_fit_fits_messages_apart_from_collectives():
    """Collective programs measured with delay 2 ms and share 0.5 ms, message programs with 3 ms and 1 ms (one
    where compute hides the messages' delay, one that waits for them at once): the fit recovers all four to the
    grids' resolution (the collectives' from the collective programs alone)."""
    from parlab.cluster.calibrate.programs import fit_step_comm
    serial = UNIT.with_(comm_overlap=False, intra_bw=1e6, inter_bw=1e6)   # us transfers: the fit sees ms
    truth = serial.with_(comm_delay=2e-3, comm_cpu=5e-4, p2p_delay=3e-3, p2p_cpu=1e-3)
    traces = [_two_ranks(False, 1.0), _two_ranks(True, 1.0), _two_ranks(False, 0.2), _ring_pair(1.0),
              _ring_pair(0.0)]
    programs = [(step_time(replay(tr, truth)), tr) for tr in traces]
    fit = fit_step_comm(serial, programs)
    assert fit["delay"] == pytest.approx(2e-3, abs=3.2e-5) and fit["cpu"] == pytest.approx(5e-4, abs=1.9e-5)
    assert fit["p2p_delay"] == pytest.approx(3e-3, abs=3.2e-5) and fit["p2p_cpu"] == pytest.approx(1e-3, abs=1.9e-5)
    assert fit["after"] == pytest.approx([1.0] * 5, abs=1e-4)
    alone = fit_step_comm(serial, programs[:3])                  # no message programs: no message costs of their own
    assert alone["p2p_delay"] is None and alone["p2p_cpu"] is None


def test_without_torchs_current_node_the_meter_counts_no_op_as_plain(monkeypatch):
    import parlab.trace.meter as rm
    monkeypatch.setattr(rm, "_current_node", None)              # a torch that lacks _current_autograd_node
    w = torch.ones(4, 4, requires_grad=True)
    with CostMeter() as meter:
        (w * 2).sum().backward()
        with torch.no_grad():
            w.add_(1)
    assert meter.kernels >= 3 and meter.plain == 0              # one cost for every op, as before the split


def test_a_real_calibration_step_is_timed_in_two_parts_that_the_meter_tells_apart():
    """step_samples on a tiny GPT: a forward + backward row whose ops all run under autograd, and an optimizer
    row (AdamW) whose ops all run outside it, both timed."""
    from parlab.cluster.calibrate.step import PARTS, step_samples
    fb, opt = step_samples(shapes=((16, 1, 2, 8, 2),), reps=1)
    assert (fb[8], opt[8]) == PARTS
    f, b, k, t, hist, fbat, sp, kp, _ = fb
    assert f > 0 and k > 0 and kp == 0 and t > 0                  # products, no op outside autograd
    f, b, k, t, hist, fbat, sp, kp, _ = opt
    assert f == 0 and b > 0 and k == kp > 0 and t > 0             # memory-bound, every op plain


def test_the_benchmark_refuses_together_with_a_given_description_or_another_part(capsys):
    """`--together` calibrates while it times the workloads: with --hardware or without --only consistency it says
    so instead of ignoring one of them."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "replay.py")
    spec = importlib.util.spec_from_file_location("bench_replay", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for argv in (["--only", "consistency", "--together", "--hardware", "x.json"], ["--together"],
                 ["--only", "published", "--together"]):
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        assert e.value.code == 2
        assert "--together goes with --only consistency and without --hardware" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--only", "consistency", "--together", "--steps", "5"])
    assert "--steps and --seconds are for the default mode" in capsys.readouterr().err
