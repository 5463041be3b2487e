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

from parlab.i18n import _
from parlab.parallel import pipeline as sch
from parlab.models import GPT, GPTConfig
from parlab.course.grading.runner import call_student, run_student
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



def _hint_1f1b() -> str:
    return _("rank r runs min(p - r - 1, m) warm-up forwards F0, F1, ...; then, while forwards are left, one "
             "forward and one backward (F(warm + i), then B(i)); then the remaining backwards in order.")


# ---------------------------------------------------------------------- reading the student's schedule
def _actions(fn, p: int, m: int, r: int) -> list[sch.Action]:
    got = call_student(fn, p, m, r, what="one_f_one_b_rank")
    if isinstance(got, str):
        got = got.split()
    if not isinstance(got, (list, tuple)):
        raise AssertionError(_("one_f_one_b_rank({p}, {m}, {r}) returned {kind}; return a list of actions such as "
                               "['{r}F0', '{r}F1', '{r}B0', ...].").format(p=p, m=m, r=r, kind=type(got).__name__))
    out = []
    for k, a in enumerate(got):
        if isinstance(a, sch.Action):
            out.append(a)
            continue
        try:
            out.append(sch.Action.parse(str(a)))
        except sch.ScheduleError as e:
            raise AssertionError(_("one_f_one_b_rank({p}, {m}, {r}), position {k}: {error}").format(
                p=p, m=m, r=r, k=k, error=e)) from None
    return out


def _schedule(fn, p: int, m: int) -> sch.Schedule:
    return sch.Schedule([_actions(fn, p, m, r) for r in range(p)], p, m, name="yours")


def _simulate(fn, p: int, m: int) -> sch.Simulation:
    s = _schedule(fn, p, m)
    try:
        return sch.simulate(s)
    except sch.ScheduleError as e:
        raise AssertionError(_("your 1F1B schedule for p={p} stages, m={m} micro-batches is not valid: {error}\n"
                               "your schedule:\n{schedule}\nHint: {hint}").format(
            p=p, m=m, error=e, schedule=s.text(), hint=_hint_1f1b())) from None


def _phase(p: int, m: int, r: int, k: int) -> str:
    warm = min(p - r - 1, m)
    if k < warm:
        return _("warm-up (the first {warm} actions)").format(warm=warm)
    if k < warm + 2 * (m - warm):
        return _("steady state (actions {first}..{last}: F then B, alternating)").format(
            first=warm, last=warm + 2 * (m - warm) - 1)
    return _("cool-down (the last {warm} actions: the remaining backwards)").format(warm=warm)


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
    res = run_student(_rank_step, p, schedule, what=_("the pipeline executor running your schedule"))
    model = GPT(CFG, seed=0, dtype=torch.float64)
    ref_loss = model(*_batch())[1]
    ref_loss.backward()
    loss = next(l for l, _grads in res.results if l is not None)
    # float64; the pipeline sums m micro-batch gradients where the reference does one batch: rounding only
    if not torch.allclose(loss, ref_loss.detach(), rtol=1e-10, atol=1e-12):
        raise AssertionError(_("running your schedule on {p} ranks gave loss {loss:.12f}, the unsplit model "
                               "{want:.12f}").format(p=p, loss=loss.item(), want=ref_loss.item()))
    for r, (_loss, grads) in enumerate(res.results):
        for name, g in grads.items():
            want = dict(model.named_parameters())[name].grad
            if not torch.allclose(g, want, rtol=1e-10, atol=1e-12):
                raise AssertionError(_("running your schedule on {p} ranks: rank {r}'s gradient of {name} differs "
                                       "from the unsplit model's (max difference {err:.3g})").format(
                    p=p, r=r, name=name, err=(g - want).abs().max()))


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
    ran = _("; it runs on {p} ranks with {m} micro-batches and matches the unsplit model").format(
        p=run_case[0], m=run_case[1]) if run_case else ""
    print(_("your schedule is valid for (p, m) in {cases} and {drawn}, drawn at random{ran}").format(
        cases=list(cases), drawn=drawn, ran=ran))


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
            where = _("1F1B for p={p}, m={m}, rank {r}").format(p=p, m=m, r=r)
            show = lambda acts: " ".join(map(str, acts))        # noqa: E731
            k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            if got == list(sch.gpipe(p, m).actions[r]):
                why = _("that is GPipe's order (all forwards, then all backwards), not 1F1B's.")
            elif k < len(want):
                why = _("position {k}, in the {phase}: expected {want}, got {got}.").format(
                    k=k, phase=_phase(p, m, r, k), want=want[k],
                    got=got[k] if k < len(got) else _("nothing (your list is too short)"))
            else:
                why = _("your list has {n} actions, 1F1B has {want}: {extra} are extra.").format(
                    n=len(got), want=len(want), extra=show(got[len(want):]))
            warm_got = next((i for i, a in enumerate(got) if a.kind == "B"), len(got))
            more = "" if warm_got == p - r or m < p - r else _(
                " You run {n} forwards before the first backward; 1F1B runs p - r = {want} (p - r - 1 warm-up "
                "forwards, then the steady state's first F).").format(n=warm_got, want=p - r)
            raise AssertionError(_("{where}: {why}{more}\n  expected {want}\n  got      {got}\nHint: {hint}").format(
                where=where, why=why, more=more, want=show(want), got=show(got), hint=_hint_1f1b()))
    print(_("one_f_one_b_rank equals parlab's 1F1B for (p, m) in {cases} and one drawn at random, every rank").format(
        cases=list(cases)))


@graded("parlab.parallel.pipeline:one_f_one_b", "parlab.parallel.pipeline:interleaved_1f1b")
def check_1f1b_bubble(fn, cases=CASES) -> None:
    """The simulated bubble of your schedule is 1F1B's, (p-1)/(m+p-1) of the step, and rank r keeps at most
    min(p - r, m) micro-batches of activations alive (the public cases and one drawn at grading time)."""
    for p, m in list(cases) + [_random_case()]:
        sim = _simulate(fn, p, m)
        want = (p - 1) / (m + p - 1)
        if not math.isclose(sim.bubble_fraction, want, abs_tol=1e-9):
            raise AssertionError(_(
                "p={p}, m={m}: your schedule idles {got:.4f} of the step (simulated, F = 1, B = 2), 1F1B idles "
                "(p-1)/(m+p-1) = {want:.4f}; step time {makespan:g} instead of {ideal} units.\nHint: a rank that "
                "waits for a backward while it could still run a forward wastes time: {hint}").format(
                p=p, m=m, got=sim.bubble_fraction, want=want, makespan=sim.makespan, ideal=3 * (m + p - 1),
                hint=_hint_1f1b()))
        for r, peak in enumerate(sim.peak_in_flight):
            if peak > min(p - r, m):
                raise AssertionError(_(
                    "p={p}, m={m}: the bubble is right, but rank {r} keeps {peak} micro-batches of activations alive "
                    "at once; 1F1B keeps at most min(p - r, m) = {most}. Run each backward as soon as possible "
                    "instead of more forwards (GPipe keeps all m).\nHint: {hint}").format(
                    p=p, m=m, r=r, peak=peak, most=min(p - r, m), hint=_hint_1f1b()))
    print(_("your schedule has 1F1B's bubble (p-1)/(m+p-1) and at most p - r micro-batches alive on rank r, for "
            "(p, m) in {cases} and one drawn at random").format(cases=list(cases)))


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
            raise AssertionError(_("{name}({p}, {m}, {v}) returned {got!r}; return a number (a fraction, e.g. 0.25 "
                                   "for 25%).").format(name=name, p=p, m=m, v=v, got=got)) from None
        if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
            continue
        kind = "1F1B" if v == 1 else _("interleaved 1F1B with v={v} chunks").format(v=v)
        extra = ""
        if math.isclose(got, getattr(sim, other[0]), rel_tol=1e-9):
            extra = _(" That is the other convention, {other}.").format(other=other[1])
        elif v > 1 and math.isclose(got, getattr(_reference_sim(p, m, 1), attr), rel_tol=1e-9):
            extra = _(" That is the bubble without interleaving: with v chunks the fill and drain shrink by v.")
        elif math.isclose(got, 100 * want, rel_tol=1e-9):
            extra = _(" That is a percentage; return a fraction.")
        raise AssertionError(_("{name}(p={p}, m={m}, v={v}) returned {got:.6f}; the simulation of {kind} (step "
                               "{makespan:g} units, one rank busy {busy:g}) gives {want:.6f}.{extra}\n"
                               "Hint: {hint}").format(name=name, p=p, m=m, v=v, got=got, kind=kind,
                                                      makespan=sim.makespan, busy=max(sim.busy), want=want,
                                                      extra=extra, hint=hint))
    print(_("{name} matches the simulation for (p, m, v) in {cases} and 2 cases drawn at random").format(
        name=name, cases=list(cases)))


@graded("parlab.parallel.pipeline:simulate", "parlab.parallel.pipeline:bubble_formula")
def check_bubble_of_step(fn, cases=BUBBLE_CASES) -> None:
    """``fn(p, m, v)`` = idle time / (p x step time) of (interleaved) 1F1B, from `simulate` with unit costs."""
    _check_formula(fn, "bubble_of_step", "bubble_fraction", cases,
                   _("each rank idles (p-1)(t_f + t_b)/v; the step is m(t_f + t_b) of work plus that idle time."),
                   ("bubble_over_ideal", _("idle time over the ideal time, (p-1)/(vm); this one divides by the "
                                           "whole step")))


@graded("parlab.parallel.pipeline:simulate", "parlab.parallel.pipeline:bubble_formula")
def check_bubble_over_ideal(fn, cases=BUBBLE_CASES) -> None:
    """``fn(p, m, v)`` = (step time - ideal time) / ideal time of (interleaved) 1F1B, from `simulate`."""
    _check_formula(fn, "bubble_over_ideal", "bubble_over_ideal", cases,
                   _("the ideal step is m(t_f + t_b) (no idle time); the bubble adds (p-1)(t_f + t_b)/v to it."),
                   ("bubble_fraction", _("the fraction of the whole step, (p-1)/(vm+p-1); this one divides by the "
                                         "ideal time")))


protect(__name__)
