"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1; validation; simulation.

A pipeline cuts the model into `stages` pieces that live on `p` ranks and streams
`m` micro-batches through them. A *schedule* says, for every rank, in which order
it runs its pieces of work. It is plain data, one list of actions per rank, each
action written like PyTorch's pipelining tests [5]:

    "1F3"   stage 1 runs the forward of micro-batch 3
    "1B3"   ... its whole backward          (needs the gradient from stage 2)
    "1I3"   ... only the input gradient     (zero bubble: what stage 0 waits for)
    "1W3"   ... only the weight gradient    (zero bubble: nobody waits for it)

    >>> print(one_f_one_b(2, 3).text())
    rank 0: 0F0 0F1 0B0 0F2 0B1 0B2
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2

Stage s lives on rank ``placement[s]``; by default ``s % p``, so with v = stages / p
chunks per rank (interleaving [3]) rank r holds the virtual stages r, r + p, r + 2p, ...

The generators (p = ranks, m = micro-batches, v = chunks per rank):

    naive(p, m)                 one micro-batch at a time through the whole pipe: one rank busy
    gpipe(p, m)                 all forwards, then all backwards [1]; m activations live
    one_f_one_b(p, m)           p - r - 1 warm-up forwards, then alternate F and B [2]
    interleaved_1f1b(p, m, v)   Megatron's depth-first order over v chunks; needs m % p == 0 [3]
        memory_optimised=True   fewer warm-up forwards, fewer micro-batches alive (MindSpore's idea, seed 003)
    zero_bubble_h1(p, m)        B split into I and W, W deferred into the bubbles [4]

How the executor runs a schedule, and so how `simulate` models it: each rank runs its
actions in order; a forward waits for its input activation, a backward for its output
gradient; sends never block (isend, each waited once it completes or at the end of the step). So a schedule is
free of deadlock exactly when "action A needs the message of action B" never forms a
cycle together with each rank's order; `simulate` finds such cycles and names them.

`message_order(schedule)` gives, for every pair of ranks, the one order in which both post the
messages between them (each activation or gradient as a send on one side and a receive on the other).
NCCL runs a pair's sends and receives one after another on one stream, and a send may wait until its
receive is posted, so two ranks that post "send X, recv Y" and "send Y, recv X" wait for each other
forever; posting in one shared order, taken from the simulated time each message is produced, cannot.
`message_sequence(schedule)` is that order before it is split by pair: with eager NCCL communicators a
rank's sends and receives to *all* peers run one at a time, so the executor posts in this one merged
order (`parlab.p2p_plan`; per-pair orders alone can wait in a cycle across three ranks).

`simulate(schedule, costs)` times every action (unit costs by default: F = 1, B = 2,
I = W = 1, each divided by v) and returns per-rank (start, end, action) spans for
timeline figures, the makespan, the bubble fraction of each rank and overall, and the
peak number of micro-batch activations alive on each rank and stage. Closed forms it
reproduces (bubble as a fraction of the step, i.e. of the makespan):

    GPipe, 1F1B      (p - 1) / (m + p - 1)        [= (p - 1) / m of the ideal time]
    interleaved      (p - 1) / (v m + p - 1)      (the bubble time divided by v)
    ZB-H1            (p - 1) / (3 m + p - 1)      F = I = W, m >= p: a third of 1F1B's bubble time
    peak in flight   1F1B: p - r on rank r (<= p);   GPipe: m

References
    [1] Y. Huang et al., "GPipe", NeurIPS 2019, arXiv:1811.06965, section 2.2.
    [2] D. Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-Flush / 1F1B),
        ICML 2021, arXiv:2006.09503.
    [3] D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
        Megatron-LM", SC 2021, arXiv:2104.04473, section 2.2 (interleaved schedule).
    [4] P. Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:2401.10241, section 3 (ZB-H1).
    [5] PyTorch, torch.distributed.pipelining (schedules as per-rank lists of actions such as "0F3").
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

__all__ = ["Action", "Schedule", "ScheduleError", "Simulation", "naive", "gpipe", "one_f_one_b",
           "interleaved_1f1b", "zero_bubble_h1", "SCHEDULES", "validate", "simulate", "bubble_formula", "unit_cost",
           "message_order", "message_sequence", "split_layers"]

KINDS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
_ACTION = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


class ScheduleError(ValueError):
    """A schedule that the executor cannot run correctly (wrong, incomplete, or deadlocking)."""


@dataclass(frozen=True, order=True)
class Action:
    """One piece of work: `kind` ("F", "B", "I" or "W") of virtual stage `stage` on micro-batch `mb`."""
    stage: int
    kind: str
    mb: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """'1F3' -> Action(stage=1, kind='F', mb=3)."""
        hit = _ACTION.match(text)
        if not hit:
            raise ScheduleError(f"cannot read action {text!r}: write stage, kind (F, B, I or W), micro-batch, "
                                f"e.g. '1F3' for the forward of micro-batch 3 on stage 1")
        return cls(int(hit[1]), hit[2], int(hit[3]))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions of one training step, plus where each virtual stage lives.

    Actions may be given as `Action`s or in their text form: ``Schedule([["0F0", "0B0"], ["1F0", "1B0"]], 2, 1)``."""
    actions: tuple[tuple[Action, ...], ...]   # actions[r]: what rank r runs, in order
    stages: int                               # virtual stages (p * v)
    microbatches: int
    placement: tuple[int, ...] = ()           # placement[s]: the rank holding stage s (default s % p)
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "actions", tuple(tuple(a if isinstance(a, Action) else Action.parse(str(a))
                                                        for a in acts) for acts in self.actions))
        if not self.placement and self.actions:
            object.__setattr__(self, "placement", tuple(s % len(self.actions) for s in range(self.stages)))
        object.__setattr__(self, "placement", tuple(self.placement))

    @property
    def ranks(self) -> int:
        return len(self.actions)

    @property
    def chunks(self) -> int:
        """Virtual stages per rank (v), 1 without interleaving."""
        return self.stages // max(self.ranks, 1)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s in range(self.stages) if self.placement[s] == rank]

    def text(self) -> str:
        """One line per rank: 'rank 0: 0F0 0F1 0B0 ...'; `Schedule.from_text` reads it back."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))

    def __str__(self) -> str:
        return self.text()

    @classmethod
    def from_text(cls, text: str, stages: int | None = None, microbatches: int | None = None,
                  placement: Iterable[int] = (), name: str = "custom") -> "Schedule":
        """Read `text()` output (the 'rank r:' prefixes are optional; one line per rank).

        `stages` and `microbatches` default to the largest indices seen plus one."""
        rows = [line.split(":", 1)[-1].split() for line in text.strip().splitlines() if line.strip()]
        actions = [[Action.parse(t) for t in row] for row in rows]
        flat = [a for row in actions for a in row]
        stages = stages if stages is not None else max((a.stage for a in flat), default=-1) + 1
        microbatches = microbatches if microbatches is not None else max((a.mb for a in flat), default=-1) + 1
        return cls(actions, stages, microbatches, tuple(placement), name)


# ---------------------------------------------------------------------- generators
def _check(p: int, m: int, v: int = 1) -> None:
    for what, x in (("stages", p), ("microbatches", m), ("chunks", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ScheduleError(f"{what} must be a positive integer, got {x!r}")


def naive(p: int, m: int) -> Schedule:
    """Model parallelism without pipelining: micro-batch i goes all the way forward and back before i + 1."""
    _check(p, m)
    return Schedule([[Action(r, k, i) for i in range(m) for k in "FB"] for r in range(p)], p, m, name="naive")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe [1]: every rank runs all m forwards, then all m backwards (in micro-batch order, as torch does)."""
    _check(p, m)
    return Schedule([[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
                     for r in range(p)], p, m, name="gpipe")


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B [2]: rank r runs min(p - r - 1, m) warm-up forwards, then one forward / one backward, then cools down.

    A backward starts as soon as its gradient can arrive, so rank r never holds more than p - r micro-batches."""
    _check(p, m)
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        for i in range(m - warm):                  # steady state: F(warm + i), then B(i)
            acts += [Action(r, "F", warm + i), Action(r, "B", i)]
        acts += [Action(r, "B", i) for i in range(m - warm, m)]
        out.append(acts)
    return Schedule(out, p, m, name="1f1b")


def interleaved_1f1b(p: int, m: int, v: int, memory_optimised: bool = False) -> Schedule:
    """Megatron's interleaved 1F1B [3]: rank r holds v chunks (virtual stages r, r + p, ...).

    Forwards go depth first in groups of p micro-batches: chunk 0 of micro-batches 0..p-1, chunk 1 of the same
    p, ..., then the next p micro-batches; backwards run the chunks in reverse. Rank r warms up with
    2 (p - r - 1) + (v - 1) p forwards (all of them when m == p), then alternates, then cools down.

    `memory_optimised`: in the spirit of MindSpore's variant (seed 003, figure 5), start some forwards later:
    warm up with only (p - r - 1) + (v - 1) p forwards, so fewer micro-batches are alive at the peak. With free
    communication the bubble is the same; Megatron's extra warm-up is slack that hides point-to-point latency
    (compare `simulate(..., comm=0.1)`)."""
    _check(p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ScheduleError(f"interleaved 1F1B runs micro-batches in groups of p = {p}, so microbatches must be a "
                            f"multiple of {p} (got {m}); use e.g. microbatches={p * max(1, round(m / p))}")
    total = m * v

    def action(k: int, forward: bool, r: int) -> Action:
        chunk = k % (p * v) // p
        chunk = chunk if forward else v - 1 - chunk
        return Action(chunk * p + r, "F" if forward else "B", k // (p * v) * p + k % p)

    out = []
    for r in range(p):
        if memory_optimised:
            warm = min((p - r - 1) + (v - 1) * p, total)
        else:
            warm = total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [action(k, True, r) for k in range(warm)]
        for k in range(total - warm):
            acts += [action(warm + k, True, r), action(k, False, r)]
        acts += [action(k, False, r) for k in range(total - warm, total)]
        out.append(acts)
    return Schedule(out, p * v, m, name=f"interleaved-1f1b(v={v}{', memory' if memory_optimised else ''})")


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 [4]: B split into I (input gradient, on the critical path) and W (weight gradient, deferrable).

    Rank r warms up with p - r forwards, as 1F1B does; then each step runs I(k), W(k - r) and the next F, so
    rank r defers its first r weight gradients and runs them at the end, in the cool-down where 1F1B idles.
    The bubble per rank shrinks from (p - 1)(F + B) to (p - 1)(F + I - W); at most p micro-batches are alive on
    any rank (from F to W), the same peak as 1F1B's first stage."""
    _check(p, m)
    out = []
    for r in range(p):
        warm = min(p - r, m)
        acts, w = [Action(r, "F", i) for i in range(warm)], 0
        for k in range(m):
            acts.append(Action(r, "I", k))
            if k >= r:                                   # the first r W's wait for the cool-down
                acts.append(Action(r, "W", w))
                w += 1
            if warm + k < m:
                acts.append(Action(r, "F", warm + k))
        acts += [Action(r, "W", i) for i in range(w, m)]
        out.append(acts)
    return Schedule(out, p, m, name="zb-h1")


SCHEDULES: dict[str, Callable[..., Schedule]] = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b,
                                                 "interleaved": interleaved_1f1b, "zb-h1": zero_bubble_h1}


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """The closed-form bubble fraction of the step (unit costs F = 1, B = 2 or F = I = W = 1)."""
    forms = {"naive": lambda: 1 - 1 / p, "gpipe": lambda: (p - 1) / (m + p - 1),
             "1f1b": lambda: (p - 1) / (m + p - 1), "interleaved": lambda: (p - 1) / (v * m + p - 1),
             "zb-h1": lambda: (p - 1) / (3 * m + p - 1)}
    if name not in forms:
        raise ValueError(f"no closed form for {name!r}; known: {', '.join(forms)}")
    return forms[name]()


def split_layers(n_layer: int, stages: int) -> list[range]:
    """Balanced contiguous runs of blocks, one per stage; sizes differ by at most one, and the extra blocks go
    to the middle stages (the first stage also embeds, the last one also runs the head and the loss)."""
    if stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {stages}")
    if n_layer < stages:
        raise ValueError(f"the model has {n_layer} layers but the pipeline has {stages} (virtual) stages; every "
                         f"stage needs at least one layer: use at most {n_layer} stages (ranks x chunks) or "
                         f"a model with n_layer >= {stages}")
    base, extra = divmod(n_layer, stages)
    middle_first = sorted(range(stages), key=lambda s: -min(s, stages - 1 - s))
    sizes = [base + (s in middle_first[:extra]) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


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


def _cost_fn(costs: Costs, v: int) -> Callable[[Action], float]:
    if callable(costs):
        return costs
    table = {k: c / v for k, c in UNIT_COSTS.items()}
    if costs is not None:
        unknown = set(costs) - set(KINDS)
        if unknown:
            raise ValueError(f"costs has unknown kinds {sorted(unknown)}; use keys among F, B, I, W")
        table.update({k: float(c) for k, c in costs.items()})   # given costs are per action, taken as they are
    return lambda a: table[a.kind]


def simulate(schedule: Schedule, costs: Costs = None, comm: float = 0.0) -> Simulation:
    """Run the schedule on a model machine: each rank runs its actions in order, each starting when the rank is
    free and its inputs have arrived (a message from another rank arrives `comm` after its sender finished).

    `costs`: per-action durations, a dict like {"F": 1, "B": 2} (kinds left out keep their default) or a
    function of the Action; by default F = 1, B = 2, I = W = 1, divided by the chunks per rank v (a chunk holds
    1/v of a rank's layers, so the step's work does not depend on v).
    Raises `ScheduleError` for an invalid schedule or a deadlock (naming what each stuck rank waits for)."""
    _check_structure(schedule)
    cost, S = _cost_fn(costs, schedule.chunks), schedule.stages
    finish: dict[tuple[int, str, int], float] = {}
    spans: list[list[tuple[float, float, Action]]] = [[] for _ in range(schedule.ranks)]
    pos, free = [0] * schedule.ranks, [0.0] * schedule.ranks
    total = sum(map(len, schedule.actions))
    while sum(pos) < total:
        progress = False
        for r, acts in enumerate(schedule.actions):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                ready = free[r]
                for st, kinds, mb in _needs(a, S):
                    t = next((finish[(st, k, mb)] for k in kinds if (st, k, mb) in finish), None)
                    if t is None:
                        break
                    ready = max(ready, t + (comm if schedule.placement[st] != r else 0.0))
                else:
                    end = ready + cost(a)
                    spans[r].append((ready, end, a))
                    finish[(a.stage, a.kind, a.mb)] = free[r] = end
                    pos[r] += 1
                    progress = True
                    continue
                break
        if not progress:
            raise ScheduleError("deadlock: " + "; ".join(_waiting(schedule, pos, finish)))
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
    its point-to-point operations run one at a time (`parlab.p2p_plan`)."""
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
            out.append(f"rank {r} waits at {a} for " + ", ".join(f"{m} (rank {q})" for m, q in missing))
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
