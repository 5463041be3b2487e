"""Validating and simulating pipeline schedules (`parlab.parallel.pipeline` holds the schedules themselves).

`validate(schedule)` checks that every (stage, micro-batch) runs F once and B once (or I and W once each), on the
rank that holds its stage, in an order the executor can run without deadlock. `simulate(schedule, costs)` times
every action as the executor runs it (each rank in order; a forward waits for its input activation, a backward
for its output gradient; sends never block) and gives per-rank spans, makespan, bubble fractions and peak
activations in flight; a cycle of waits is reported as a deadlock naming who waits for what.
`message_order` / `message_sequence` give the one order in which both ends post each pair's messages (the
executor's posting order, `parlab.parallel.pipeline.plan`). The closed forms it reproduces and the references are in
`parlab.parallel.pipeline`' docstring.

Both import only the schedule data types: the module is pure (no torch).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Mapping

from parlab.i18n import _
from parlab.parallel.pipeline.schedules import KINDS, Action, Schedule, ScheduleError

__all__ = ["Simulation", "validate", "simulate", "unit_cost", "UNIT_COSTS", "message_order", "message_sequence"]


# ---------------------------------------------------------------------- validation
def _needs(a: Action, stages: int) -> list[tuple[int, str, int]]:
    """What `a` waits for, as (stage, kinds, mb): the message it receives and its own earlier work."""
    if a.kind == "F":
        return [(a.stage - 1, "F", a.mb)] if a.stage > 0 else []
    if a.kind == "W":
        return [(a.stage, "I", a.mb)]
    needs = [(a.stage, "F", a.mb)]                   # B or I: own forward, and the gradient from the next stage
    if a.stage < stages - 1:
        needs.append((a.stage + 1, "BI", a.mb))
    return needs


def validate(schedule: Schedule) -> Schedule:
    """Check that every (stage, micro-batch) runs F once and B once (or I and W once each), each on the rank
    holding its stage, in an order the executor can run without deadlock. Returns the schedule; raises
    `ScheduleError` saying what is wrong."""
    simulate(schedule)   # does every check, deadlock included
    return schedule


def _check_structure(s: Schedule) -> None:
    p, S, m = s.ranks, s.stages, s.microbatches
    if p < 1 or S < 1 or m < 1:
        raise ScheduleError(f"a schedule needs at least one rank, stage and micro-batch (got {p}, {S}, {m})")
    if len(s.placement) != S or any(not 0 <= r < p for r in s.placement):
        raise ScheduleError(f"placement must give a rank in 0..{p - 1} for each of the {S} stages, "
                            f"got {list(s.placement)}")
    seen: dict[tuple[int, str, int], int] = {}
    for r, acts in enumerate(s.actions):
        for a in acts:
            if not (0 <= a.stage < S and 0 <= a.mb < m):
                raise ScheduleError(f"rank {r}: action {a} is out of range: stages are 0..{S - 1} and "
                                    f"micro-batches 0..{m - 1}")
            if s.placement[a.stage] != r:
                raise ScheduleError(f"rank {r} runs {a} but stage {a.stage} lives on rank "
                                    f"{s.placement[a.stage]}; move the action to that rank")
            key = (a.stage, a.kind, a.mb)
            if key in seen:
                raise ScheduleError(f"{a} appears twice (ranks {seen[key]} and {r}); each action runs once")
            seen[key] = r
    for st in range(S):
        for i in range(m):
            has = {k for k in KINDS if (st, k, i) in seen}
            if "F" not in has:
                raise ScheduleError(f"forward {st}F{i} is missing; every stage must run every micro-batch")
            if has not in ({"F", "B"}, {"F", "I", "W"}):
                found = ", ".join(f"{st}{k}{i}" for k in KINDS if k in has)
                raise ScheduleError(f"stage {st} micro-batch {i} has {found}: after its F it needs either one B "
                                    f"({st}B{i}) or an I and a W ({st}I{i}, {st}W{i}), not a mix")


# ---------------------------------------------------------------------- simulation
@dataclass
class Simulation:
    """Timing of a schedule under given action costs. Times are in cost units."""
    schedule: Schedule
    spans: list[list[tuple[float, float, Action]]]   # per rank: (start, end, action) in run order
    makespan: float
    busy: list[float]                                  # per rank: time spent computing
    peak_in_flight: list[int]                          # per rank: most micro-batch activations alive at once
    peak_in_flight_stage: dict[int, int] = field(default_factory=dict)   # the same per virtual stage

    @property
    def bubble(self) -> list[float]:
        """Idle fraction of the step on each rank: 1 - busy / makespan."""
        return [1 - b / self.makespan for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        """Idle fraction over all ranks: idle time / (p * makespan)."""
        return 1 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def bubble_over_ideal(self) -> float:
        """Idle time relative to the ideal (bubble-free) step, the other convention: (makespan - ideal) / ideal."""
        ideal = max(self.busy)
        return (self.makespan - ideal) / ideal

    def summary(self, peaks: bool = True) -> str:
        """The bubble in both conventions (and, with `peaks`, the activations each rank holds at most), as a
        sentence in the language in force: what a notebook prints after simulating a schedule."""
        text = _("simulated: bubble {of_step:.3f} of the step, {over_ideal:.3f} over the ideal").format(
            of_step=self.bubble_fraction, over_ideal=self.bubble_over_ideal)
        return text + (_("; peak micro-batches alive per rank: {peak}").format(peak=self.peak_in_flight) if peaks
                       else "")

    def timeline(self) -> list[dict]:
        """One dict per action, ready for a timeline figure (rank, start, end, stage, kind, mb, label)."""
        return [{"rank": r, "start": t0, "end": t1, "stage": a.stage, "kind": a.kind, "mb": a.mb,
                 "label": str(a)} for r, spans in enumerate(self.spans) for t0, t1, a in spans]


Costs = Mapping[str, float] | Callable[[Action], float] | None
UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}          # B = I + W: a backward costs about two forwards


def unit_cost(action: Action, v: int = 1) -> float:
    """The default duration of `action` when a rank holds v chunks: F = 1, B = 2, I = W = 1, divided by v
    (a chunk holds 1/v of a rank's layers, so the step's work does not depend on v)."""
    return UNIT_COSTS[action.kind] / v


def _cost_fn(costs: Costs, v: int) -> tuple[Callable[[Action], float], Callable[[Action, Action], float]]:
    """(duration of one action, duration of an overlapped F&B pair): "F&B" in `costs`, else F + B (no gain)."""
    if callable(costs):
        return costs, lambda f, b: costs(f) + costs(b)
    table = {k: c / v for k, c in UNIT_COSTS.items()}
    if costs is not None:
        unknown = set(costs) - set(KINDS) - {"F&B"}
        if unknown:
            raise ValueError(f"costs has unknown kinds {sorted(unknown)}; use keys among F, B, I, W (and F&B)")
        table.update({k: float(c) for k, c in costs.items()})   # given costs are per action, taken as they are
    return (lambda a: table[a.kind]), (lambda f, b: table.get("F&B", table[f.kind] + table[b.kind]))


def simulate(schedule: Schedule, costs: Costs = None, comm: float = 0.0) -> Simulation:
    """Run the schedule on a model machine: each rank runs its actions in order, each starting when the rank is
    free and its inputs have arrived (a message from another rank arrives `comm` after its sender finished).

    `costs`: per-action durations, a dict like {"F": 1, "B": 2} (kinds left out keep their default) or a
    function of the Action; by default F = 1, B = 2, I = W = 1, divided by the chunks per rank v (a chunk holds
    1/v of a rank's layers, so the step's work does not depend on v). An overlapped pair (DualPipe's F&B,
    `Schedule.overlapped`) starts when the inputs of both have arrived, lasts ``costs["F&B"]`` (default F + B: no
    gain from overlapping) and both its actions finish at its end; its spans split that time in proportion F : B.
    Raises `ScheduleError` for an invalid schedule or a deadlock (naming what each stuck rank waits for)."""
    _check_structure(schedule)
    (cost, pair_cost), S = _cost_fn(costs, schedule.chunks), schedule.stages
    finish: dict[tuple[int, str, int], float] = {}
    spans: list[list[tuple[float, float, Action]]] = [[] for _ in range(schedule.ranks)]
    pos, free = [0] * schedule.ranks, [0.0] * schedule.ranks
    total = sum(map(len, schedule.actions))

    def arrived(r: int, a: Action) -> float | None:
        """When everything `a` waits for has reached rank r (None: not yet produced)."""
        ready = 0.0
        for st, kinds, mb in _needs(a, S):
            t = next((finish[(st, k, mb)] for k in kinds if (st, k, mb) in finish), None)
            if t is None:
                return None
            ready = max(ready, t + (comm if schedule.placement[st] != r else 0.0))
        return ready

    while sum(pos) < total:
        progress = False
        for r, acts in enumerate(schedule.actions):
            while pos[r] < len(acts):
                i = pos[r]
                group = acts[i:i + 2] if schedule.pair_of(r, i) == i + 1 else acts[i:i + 1]
                times = [arrived(r, a) for a in group]
                if None in times:
                    break
                start = max([free[r], *times])
                if len(group) == 2:                       # F&B: one span of work, split F : B for the figure
                    end = start + pair_cost(*group)
                    mid = start + (end - start) * cost(group[0]) / max(cost(group[0]) + cost(group[1]), 1e-300)
                    cuts = [(start, mid), (mid, end)]
                else:
                    end = start + cost(group[0])
                    cuts = [(start, end)]
                for a, (t0, t1) in zip(group, cuts):
                    spans[r].append((t0, t1, a))
                    finish[(a.stage, a.kind, a.mb)] = end
                free[r] = end
                pos[r] += len(group)
                progress = True
        if not progress:
            # the separator is a message too: Chinese joins its clauses with a full-width semicolon
            raise ScheduleError(_("deadlock: {waits}").format(waits=_("; ").join(_waiting(schedule, pos, finish))))
    return Simulation(schedule, spans, max(free), [sum(e - s for s, e, _ in sp) for sp in spans],
                      *_peaks(schedule, spans))


def message_order(schedule: Schedule) -> dict[tuple[int, int], list[tuple[int, str, int, int]]]:
    """For each pair of ranks (a, b), a < b, that exchange messages: every message between them as
    (sender rank, kind "act" or "grad", receiving stage, micro-batch), in the order both ranks post them:
    `message_sequence` split by pair.

    The order is the simulated time each message is produced (unit costs, all positive), ties broken by the
    sender's rank. A rank's own messages are produced in its program order, so it can post its sends in this
    order as it produces them, posting the receives that come between them early (non-blocking); and the
    order respects every dependency, so the two streams of a pair never wait on each other in a cycle."""
    order: dict[tuple[int, int], list[tuple[int, str, int, int]]] = defaultdict(list)
    for src, dst, kind, stage, mb in message_sequence(schedule):
        order[(min(src, dst), max(src, dst))].append((src, kind, stage, mb))
    return dict(order)


def message_sequence(schedule: Schedule) -> list[tuple[int, int, str, int, int]]:
    """Every message of the schedule as (sender, receiver, kind "act" or "grad", receiving stage, micro-batch),
    in one global order: the simulated time it is produced (unit costs), ties broken by sender rank. A rank
    that posts all its messages, with every peer, in this one merged order never waits in a cycle even when
    its point-to-point operations run one at a time (`parlab.parallel.pipeline.plan`)."""
    sim, S, pl = simulate(schedule), schedule.stages, schedule.placement
    produced = []                                  # (time, sender, receiver, kind, receiving stage, mb)
    for r, spans in enumerate(sim.spans):
        for _, end, a in spans:
            if a.kind == "F" and a.stage < S - 1 and pl[a.stage + 1] != r:
                produced.append((end, r, pl[a.stage + 1], "act", a.stage + 1, a.mb))
            elif a.kind in "BI" and a.stage > 0 and pl[a.stage - 1] != r:
                produced.append((end, r, pl[a.stage - 1], "grad", a.stage - 1, a.mb))
    return [(src, dst, kind, stage, mb) for _, src, dst, kind, stage, mb in sorted(produced)]


def _waiting(s: Schedule, pos: list[int], finish) -> list[str]:
    """For each stuck rank: the action it is at, and the actions (and their ranks) it waits for."""
    out = []
    for r, acts in enumerate(s.actions):
        if pos[r] < len(acts):
            a = acts[pos[r]]
            missing = [("/".join(f"{st}{k}{mb}" for k in kinds), s.placement[st])
                       for st, kinds, mb in _needs(a, s.stages) if not any((st, k, mb) in finish for k in kinds)]
            needs = [_("{action}, which rank {rank} itself runs only later in its list").format(action=m, rank=q)
                     if q == r else _("{action} (on rank {rank})").format(action=m, rank=q) for m, q in missing]
            out.append(_("rank {rank} waits at {action} for {needs}").format(rank=r, action=a, needs=", ".join(needs)))
    return out


def _peaks(s: Schedule, spans) -> tuple[list[int], dict[int, int]]:
    """Activations alive: a micro-batch's activations on a stage are allocated when its F starts and freed when
    its last backward piece (B, or W when split) ends. At equal times frees come first."""
    events = defaultdict(list)                       # rank -> (time, +1/-1, stage)
    for r, sp in enumerate(spans):
        for t0, t1, a in sp:
            if a.kind == "F":
                events[r].append((t0, 1, a.stage))
            elif a.kind in "BW":
                events[r].append((t1, -1, a.stage))
    per_rank, per_stage = [0] * s.ranks, {st: 0 for st in range(s.stages)}
    for r, evs in events.items():
        live, live_stage = 0, defaultdict(int)
        for _, d, st in sorted(evs):
            live += d
            live_stage[st] += d
            per_rank[r] = max(per_rank[r], live)
            per_stage[st] = max(per_stage[st], live_stage[st])
    return per_rank, per_stage
