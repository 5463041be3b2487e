"""Checks for exercise 05 (pipeline schedules): the 1F1B order of one rank, and the bubble in both conventions.

The student writes ``one_f_one_b_rank(p, m, r)``, the list of actions rank r runs in one training step of 1F1B
("0F3": stage 0's forward of micro-batch 3; "0B3" its backward), and two closed forms of the bubble. Each check
compares with parlab's reference (`parlab.parallel.pipeline.one_f_one_b`, `parlab.parallel.pipeline.simulation`) on several
pipeline sizes and says which case, which rank and which position went wrong, expected vs got, and a hint:

    check_1f1b_valid        every rank's list forms a valid schedule (each F and B once, no deadlock, checked by
                            simulation), and it runs on 4 simulated ranks with the real executor, giving the loss
                            and gradients of the unsplit model
    check_1f1b_reference    equal to parlab's 1F1B, action by action, naming the phase (warm-up, steady, cool-down)
    check_1f1b_bubble       the simulated bubble is 1F1B's (p-1)/(m+p-1) and rank r keeps at most min(p-r, m)
                            micro-batches of activations alive (GPipe's order has the bubble but not the memory)
    check_bubble_of_step    bubble_of_step(p, m, v) == idle time / (p x step time) of the simulation
    check_bubble_over_ideal bubble_over_ideal(p, m, v) == (step time - ideal) / ideal of the simulation

References: PipeDream-Flush / 1F1B, arXiv:2006.09503; Megatron-LM interleaving, arXiv:2104.04473 section 2.2.
"""
from __future__ import annotations

import math
import random

import torch

from parlab.parallel import pipeline as sch
from parlab.models import GPT, GPTConfig
from parlab.course.grading import call_student, run_student
from parlab.course.grading.guard import fresh_seed, graded, protect

__all__ = ["check_1f1b_valid", "check_1f1b_reference", "check_1f1b_bubble", "check_bubble_of_step",
           "check_bubble_over_ideal", "CASES", "BUBBLE_CASES"]

CASES = ((2, 1), (2, 4), (3, 5), (4, 2), (4, 4), (4, 8))          # (p, m): m below, equal to and above p
BUBBLE_CASES = ((2, 4, 1), (4, 4, 1), (4, 8, 1), (8, 16, 1), (4, 8, 2), (4, 16, 4), (3, 6, 3))   # (p, m, v)
RUN_CASE = (4, 6)                                                  # run on the executor: 4 ranks, 6 micro-batches
CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=4, n_head=2, n_embd=16)
BATCH = 12

def _random_case() -> tuple[int, int]:
    """A (p, m) drawn at grading time, so that schedules copied from a run of the public CASES do not pass."""
    rng = random.Random(fresh_seed())
    return rng.choice([(p, m) for p in range(2, 7) for m in range(2, 13) if (p, m) not in CASES])   # m = 1: GPipe too


def _random_bubble_cases() -> list[tuple[int, int, int]]:
    """One 1F1B and one interleaved (p, m, v) drawn at grading time (interleaving needs m a multiple of p)."""
    rng = random.Random(fresh_seed())
    plain = [(p, m, 1) for p in range(2, 9) for m in range(1, 17)]
    interleaved = [(p, p * k, v) for p in range(2, 5) for k in range(1, 5) for v in (2, 3)]
    return [rng.choice([c for c in cases if c not in BUBBLE_CASES]) for cases in (plain, interleaved)]


HINT_1F1B = ("rank r runs min(p - r - 1, m) warm-up forwards F0, F1, ...; then, while forwards are left, one "
             "forward and one backward (F(warm + i), then B(i)); then the remaining backwards in order.")


# ---------------------------------------------------------------------- reading the student's schedule
def _actions(fn, p: int, m: int, r: int) -> list[sch.Action]:
    got = call_student(fn, p, m, r, what="one_f_one_b_rank")
    if isinstance(got, str):
        got = got.split()
    if not isinstance(got, (list, tuple)):
        raise AssertionError(f"one_f_one_b_rank({p}, {m}, {r}) returned {type(got).__name__}; return a list of "
                             f"actions such as ['{r}F0', '{r}F1', '{r}B0', ...].")
    out = []
    for k, a in enumerate(got):
        if isinstance(a, sch.Action):
            out.append(a)
            continue
        try:
            out.append(sch.Action.parse(str(a)))
        except sch.ScheduleError as e:
            raise AssertionError(f"one_f_one_b_rank({p}, {m}, {r}), position {k}: {e}") from None
    return out


def _schedule(fn, p: int, m: int) -> sch.Schedule:
    return sch.Schedule([_actions(fn, p, m, r) for r in range(p)], p, m, name="yours")


def _simulate(fn, p: int, m: int) -> sch.Simulation:
    s = _schedule(fn, p, m)
    try:
        return sch.simulate(s)
    except sch.ScheduleError as e:
        raise AssertionError(f"your 1F1B schedule for p={p} stages, m={m} micro-batches is not valid: {e}\n"
                             f"your schedule:\n{s.text()}\nHint: {HINT_1F1B}") from None


def _phase(p: int, m: int, r: int, k: int) -> str:
    warm = min(p - r - 1, m)
    if k < warm:
        return f"warm-up (the first {warm} actions)"
    if k < warm + 2 * (m - warm):
        return f"steady state (actions {warm}..{warm + 2 * (m - warm) - 1}: F then B, alternating)"
    return f"cool-down (the last {warm} actions: the remaining backwards)"


# ---------------------------------------------------------------------- running it for real
def _batch():
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)    # (B, S)
    y = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=g)    # (B, S)
    return x, y


def _rank_step(schedule):
    from parlab.parallel.pipeline import PipelineParallel
    pp = PipelineParallel(GPT(CFG, seed=0, dtype=torch.float64), schedule)
    loss = pp.step(*_batch())
    return loss, {k: g.clone() for k, g in pp.grads().items()}


def _check_run(schedule: sch.Schedule) -> None:
    p = schedule.ranks
    res = run_student(_rank_step, p, schedule, what="the pipeline executor running your schedule")
    model = GPT(CFG, seed=0, dtype=torch.float64)
    _, ref_loss = model(*_batch())
    ref_loss.backward()
    loss = next(l for l, _ in res.results if l is not None)
    # float64; the pipeline sums m micro-batch gradients where the reference does one batch: rounding only
    if not torch.allclose(loss, ref_loss.detach(), rtol=1e-10, atol=1e-12):
        raise AssertionError(f"running your schedule on {p} ranks gave loss {loss.item():.12f}, the unsplit model "
                             f"{ref_loss.item():.12f}")
    for r, (_, grads) in enumerate(res.results):
        for name, g in grads.items():
            want = dict(model.named_parameters())[name].grad
            if not torch.allclose(g, want, rtol=1e-10, atol=1e-12):
                raise AssertionError(f"running your schedule on {p} ranks: rank {r}'s gradient of {name} differs "
                                     f"from the unsplit model's (max difference {(g - want).abs().max():.3g})")


# ---------------------------------------------------------------------- checks: the 1F1B order
@graded("parlab.parallel.pipeline:one_f_one_b", "parlab.parallel.pipeline:interleaved_1f1b")
def check_1f1b_valid(fn, cases=CASES, run_case=RUN_CASE) -> None:
    """Every rank's list forms a valid schedule on every case and on one drawn at grading time; the real executor
    runs one case on 4 ranks and gets the unsplit model's loss and gradients."""
    drawn = _random_case()
    for p, m in list(cases) + [drawn]:
        _simulate(fn, p, m)
    if run_case:
        _check_run(_schedule(fn, *run_case))
    ran = f"; it runs on {run_case[0]} ranks with {run_case[1]} micro-batches and matches the unsplit model" \
        if run_case else ""
    print(f"your schedule is valid for (p, m) in {list(cases)} and {drawn}, drawn at random{ran}")


@graded("parlab.parallel.pipeline:one_f_one_b", "parlab.parallel.pipeline:interleaved_1f1b")
def check_1f1b_reference(fn, cases=CASES) -> None:
    """one_f_one_b_rank(p, m, r) equals parlab.parallel.pipeline.one_f_one_b(p, m).actions[r], action by action, on the
    public cases and one drawn at grading time."""
    for p, m in list(cases) + [_random_case()]:
        ref = sch.one_f_one_b(p, m)
        for r in range(p):
            got, want = _actions(fn, p, m, r), list(ref.actions[r])
            if got == want:
                continue
            where = f"1F1B for p={p}, m={m}, rank {r}"
            show = lambda acts: " ".join(map(str, acts))        # noqa: E731
            k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            if got == list(sch.gpipe(p, m).actions[r]):
                why = "that is GPipe's order (all forwards, then all backwards), not 1F1B's."
            elif k < len(want):
                why = (f"position {k}, in the {_phase(p, m, r, k)}: expected {want[k]}, got "
                       f"{got[k] if k < len(got) else 'nothing (your list is too short)'}.")
            else:
                why = f"your list has {len(got)} actions, 1F1B has {len(want)}: {show(got[len(want):])} are extra."
            warm_got = next((i for i, a in enumerate(got) if a.kind == "B"), len(got))
            more = "" if warm_got == p - r or m < p - r else (
                f" You run {warm_got} forwards before the first backward; 1F1B runs p - r = {p - r} "
                f"(p - r - 1 warm-up forwards, then the steady state's first F).")
            raise AssertionError(f"{where}: {why}{more}\n  expected {show(want)}\n  got      {show(got)}\n"
                                 f"Hint: {HINT_1F1B}")
    print(f"one_f_one_b_rank equals parlab's 1F1B for (p, m) in {list(cases)} and one drawn at random, every rank")


@graded("parlab.parallel.pipeline:one_f_one_b", "parlab.parallel.pipeline:interleaved_1f1b")
def check_1f1b_bubble(fn, cases=CASES) -> None:
    """The simulated bubble of your schedule is 1F1B's, (p-1)/(m+p-1) of the step, and rank r keeps at most
    min(p - r, m) micro-batches of activations alive (the public cases and one drawn at grading time)."""
    for p, m in list(cases) + [_random_case()]:
        sim = _simulate(fn, p, m)
        want = (p - 1) / (m + p - 1)
        if not math.isclose(sim.bubble_fraction, want, abs_tol=1e-9):
            raise AssertionError(
                f"p={p}, m={m}: your schedule idles {sim.bubble_fraction:.4f} of the step (simulated, F = 1, "
                f"B = 2), 1F1B idles (p-1)/(m+p-1) = {want:.4f}; step time {sim.makespan:g} instead of "
                f"{3 * (m + p - 1)} units.\nHint: a rank that waits for a backward while it could still run a "
                f"forward wastes time: {HINT_1F1B}")
        for r, peak in enumerate(sim.peak_in_flight):
            if peak > min(p - r, m):
                raise AssertionError(
                    f"p={p}, m={m}: the bubble is right, but rank {r} keeps {peak} micro-batches of activations "
                    f"alive at once; 1F1B keeps at most min(p - r, m) = {min(p - r, m)}. Run each backward as "
                    f"soon as possible instead of more forwards (GPipe keeps all m).\nHint: {HINT_1F1B}")
    print(f"your schedule has 1F1B's bubble (p-1)/(m+p-1) and at most p - r micro-batches alive on rank r, for "
          f"(p, m) in {list(cases)} and one drawn at random")


# ---------------------------------------------------------------------- checks: the bubble formulas
def _reference_sim(p: int, m: int, v: int) -> sch.Simulation:
    return sch.simulate(sch.interleaved_1f1b(p, m, v) if v > 1 else sch.one_f_one_b(p, m))


def _check_formula(fn, name: str, attr: str, cases, hint: str, other: tuple[str, str]) -> None:
    for p, m, v in list(cases) + _random_bubble_cases():
        sim = _reference_sim(p, m, v)
        want = getattr(sim, attr)
        got = call_student(fn, p, m, v, what=name)
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise AssertionError(f"{name}({p}, {m}, {v}) returned {got!r}; return a number (a fraction, "
                                 f"e.g. 0.25 for 25%).") from None
        if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
            continue
        kind = "1F1B" if v == 1 else f"interleaved 1F1B with v={v} chunks"
        extra = ""
        if math.isclose(got, getattr(sim, other[0]), rel_tol=1e-9):
            extra = f" That is the other convention, {other[1]}."
        elif v > 1 and math.isclose(got, getattr(_reference_sim(p, m, 1), attr), rel_tol=1e-9):
            extra = " That is the bubble without interleaving: with v chunks the fill and drain shrink by v."
        elif math.isclose(got, 100 * want, rel_tol=1e-9):
            extra = " That is a percentage; return a fraction."
        raise AssertionError(f"{name}(p={p}, m={m}, v={v}) returned {got:.6f}; the simulation of {kind} (step "
                             f"{sim.makespan:g} units, one rank busy {max(sim.busy):g}) gives {want:.6f}.{extra}\n"
                             f"Hint: {hint}")
    print(f"{name} matches the simulation for (p, m, v) in {list(cases)} and 2 cases drawn at random")


@graded("parlab.parallel.pipeline:simulate", "parlab.parallel.pipeline:bubble_formula")
def check_bubble_of_step(fn, cases=BUBBLE_CASES) -> None:
    """``fn(p, m, v)`` = idle time / (p x step time) of (interleaved) 1F1B, from `simulate` with unit costs."""
    _check_formula(fn, "bubble_of_step", "bubble_fraction", cases,
                   "each rank idles (p-1)(t_f + t_b)/v; the step is m(t_f + t_b) of work plus that idle time.",
                   ("bubble_over_ideal", "idle time over the ideal time, (p-1)/(vm); this one divides by the "
                                         "whole step"))


@graded("parlab.parallel.pipeline:simulate", "parlab.parallel.pipeline:bubble_formula")
def check_bubble_over_ideal(fn, cases=BUBBLE_CASES) -> None:
    """``fn(p, m, v)`` = (step time - ideal time) / ideal time of (interleaved) 1F1B, from `simulate`."""
    _check_formula(fn, "bubble_over_ideal", "bubble_over_ideal", cases,
                   "the ideal step is m(t_f + t_b) (no idle time); the bubble adds (p-1)(t_f + t_b)/v to it.",
                   ("bubble_fraction", "the fraction of the whole step, (p-1)/(vm+p-1); this one divides by the "
                                       "ideal time"))


protect(__name__)
