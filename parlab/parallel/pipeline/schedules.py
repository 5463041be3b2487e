"""Pipeline schedules as data: GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1, DualPipeV (the data types:
`parlab.parallel.pipeline.actions`; their validation and simulation: `parlab.parallel.pipeline.simulation`).

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
    dualpipe_v(p, m)            DeepSeek-V3's DualPipe cut in half: 2p stages in a V, rank r holds stages r and
                                2p - 1 - r; in its steady state a forward of one runs overlapped with a backward of
                                the other ("0F6&7B0", forward listed first) [6]

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
    DualPipeV        idle time per rank (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages and per-chunk costs, m >= 2p
    peak in flight   1F1B: p - r on rank r (<= p);   GPipe: m

References
    [1] Y. Huang et al., "GPipe", NeurIPS 2019, arXiv:1811.06965, section 2.2.
    [2] D. Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training" (PipeDream-Flush / 1F1B),
        ICML 2021, arXiv:2006.09503.
    [3] D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
        Megatron-LM", SC 2021, arXiv:2104.04473, section 2.2 (interleaved schedule).
    [4] P. Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:2401.10241, section 3 (ZB-H1).
    [5] PyTorch, torch.distributed.pipelining (schedules as per-rank lists of actions such as "0F3").
    [6] DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, section 3.2.1 (DualPipe); the V-shaped
        "cut-in-half" variant and its bubble table: github.com/deepseek-ai/DualPipe (README, dualpipev.py);
        torch.distributed.pipelining.ScheduleDualPipeV lists the same actions.
"""
from __future__ import annotations

from typing import Callable

from parlab.i18n import _
from parlab.parallel.pipeline.actions import KINDS, Action, Schedule, ScheduleError   # noqa: F401 (the data types)

__all__ = ["Action", "Schedule", "ScheduleError", "naive", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zero_bubble_h1", "dualpipe_v", "SCHEDULES", "bubble_formula", "split_layers"]

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
        raise ScheduleError(_("interleaved 1F1B runs micro-batches in groups of p = {p}, so microbatches must be a "
                              "multiple of {p} (got {m}); use e.g. microbatches={fix}").format(
                                  p=p, m=m, fix=p * max(1, round(m / p))))
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


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV [6]: 2p stages folded into a V, rank r holding stage r (chunk 0, on the way down) and stage
    2p - 1 - r (chunk 1, on the way back), so rank 0 holds the first stage and the last (with the loss).

    The eight phases of DeepSeek's dualpipev.py, per rank r (each chunk runs its micro-batches in order):

        1  2 (p - r - 1) forwards of chunk 0                                 warm-up
        2  r + 1 times: F chunk 0, F chunk 1
        3  p - r - 1 times: I chunk 1, a W, F chunk 1                       zero-bubble split
        4  m - 2p + r + 1 times: F0&B1, F1&B0                                 the steady state, overlapped
        5  p - r - 1 times: B chunk 1, F1&B0
        6  r + 1 times: B chunk 1, B chunk 0 (I instead of B from the middle of this phase on)
        7  p - r - 1 times: a W, then I chunk 0
        8  r + 1 W's: the weight gradients deferred so far, oldest first

    (the last rank's first phase-4 pair runs F then B, not overlapped, as in DeepSeek's code). A W always takes
    the oldest deferred weight gradient. Needs m >= 2p micro-batches, as torch's ScheduleDualPipeV does.

    The overlap itself is a GPU's: DeepSeek runs a pair's forward compute while the backward's all-to-all is on
    the wire, with a model-specific overlapped forward-backward. parlab's executor runs a pair as its F, then its
    B (one CPU stream); `simulate` models the pair, with its "F&B" cost."""
    _check(p, m)
    if m < 2 * p:
        raise ScheduleError(_("DualPipeV needs at least as many micro-batches as stages (2p = {stages}), got "
                              "microbatches={m}; use microbatches >= {stages}").format(stages=2 * p, m=m))
    out, pairs = [], []
    for r in range(p):
        stage = (r, 2 * p - 1 - r)                      # chunk 0, chunk 1
        acts: list[Action] = []
        pos: list[int] = []
        done = {(c, k): 0 for c in (0, 1) for k in "FB"}    # micro-batches each chunk has run forward / backward
        deferred: list[Action] = []                        # W's owed, oldest first

        def forward(c):
            acts.append(Action(stage[c], "F", done[(c, "F")]))
            done[(c, "F")] += 1

        def backward(c, split=False):
            acts.append(Action(stage[c], "I" if split else "B", done[(c, "B")]))
            if split:
                deferred.append(Action(stage[c], "W", done[(c, "B")]))
            done[(c, "B")] += 1

        def weight():
            if deferred:
                acts.append(deferred.pop(0))

        def overlapped(f, b):                               # F&B: the forward of chunk f with the backward of b
            pos.append(len(acts))
            forward(f)
            backward(b)

        for _k in range(2 * (p - r - 1)):                    # 1
            forward(0)
        for _k in range(r + 1):                              # 2
            forward(0)
            forward(1)
        for _k in range(p - r - 1):                          # 3
            backward(1, split=True)
            weight()
            forward(1)
        for i in range(m - 2 * p + r + 1):                  # 4
            if i == 0 and r == p - 1:
                forward(0)
                backward(1)
            else:
                overlapped(0, 1)
            overlapped(1, 0)
        for _k in range(p - r - 1):                          # 5
            backward(1)
            overlapped(1, 0)
        split = False
        for i in range(r + 1):                              # 6
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            backward(1, split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            backward(0, split)
        for _k in range(p - r - 1):                          # 7
            weight()
            backward(0, split)
        for _k in range(r + 1):                              # 8
            weight()
        out.append(acts)
        pairs.append(tuple(pos))
    placement = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return Schedule(out, 2 * p, m, placement, name="dualpipe-v", overlapped=tuple(pairs))


SCHEDULES: dict[str, Callable[..., Schedule]] = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b,
                                                 "interleaved": interleaved_1f1b, "zb-h1": zero_bubble_h1,
                                                 "dualpipe-v": dualpipe_v}


def bubble_formula(name: str, p: int, m: int, v: int = 1) -> float:
    """The closed-form bubble fraction of the step (unit costs F = 1, B = 2 or F = I = W = 1).

    DualPipeV (`v` ignored: always 2 chunks): the idle time per rank is (PP/2 - 1)(F&B + B - 3W) [6] with PP = 2p
    stages and per-chunk costs F = 1/2, B = 1, W = 1/2 and F&B = F + B (no gain from overlapping), that is p - 1;
    each rank computes 3m, so the fraction is (p - 1) / (3m + p - 1), ZB-H1's."""
    forms = {"naive": lambda: 1 - 1 / p, "gpipe": lambda: (p - 1) / (m + p - 1),
             "1f1b": lambda: (p - 1) / (m + p - 1), "interleaved": lambda: (p - 1) / (v * m + p - 1),
             "zb-h1": lambda: (p - 1) / (3 * m + p - 1), "dualpipe-v": lambda: (p - 1) / (3 * m + p - 1)}
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

