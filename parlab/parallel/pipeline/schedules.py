"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1 (their validation and
simulation: `parlab.parallel.pipeline.simulation`).

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
order (`parlab.parallel.pipeline.plan`; per-pair orders alone can wait in a cycle across three ranks).

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
from dataclasses import dataclass
from typing import Callable, Iterable

__all__ = ["Action", "Schedule", "ScheduleError", "naive", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zero_bubble_h1", "SCHEDULES", "bubble_formula", "split_layers"]

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

