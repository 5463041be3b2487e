"""From a trace to per-rank programs: the ordered steps a replay (`parlab.cluster.replay`) re-times.

Each rank's events, in the order the rank ran them, become `Step`s:

    compute   a compute span (or a piece of one, see below), with its cost in seconds
    mark      an instant
    coll      a collective call: blocking, or the issue of an asynchronous one
    send/recv a point-to-point message, blocking or issued asynchronously (isend / irecv)
    wait      the moment the program first waited for an asynchronous call (`Event.waited`)

Matching across ranks (the only cross-rank information a trace has):

* collectives: the k-th collective a rank issued on a group (the tuple of its global ranks) is the k-th of every
  other member: every rank calls a group's collectives in the same order, as torch.distributed requires;
* messages: the k-th send from rank a to rank b is the k-th receive of b from a (messages between a pair are
  matched in order; parlab sends no tags).

A compute span that contains communication or waits (e.g. a region around a step that all-reduces inside) is
cut at them. In a metered trace (`parlab.trace.count_costs`) each piece costs the work done in it: every event
carries the meter's running totals when it was recorded (`Event.meter_at`), so the work between two cuts is
their difference, and the piece costs ``compute_cost`` of that work; this does not depend on how long the
pieces happened to take, so replaying two runs of the same program gives the same times. Otherwise (no meter,
or a cost callback that is not additive over work, e.g. `parlab.cluster.scaleup`'s, which costs a span by its label)
the span's cost is shared among the pieces in proportion to their measured durations. A compute span inside
another compute span of the same rank is dropped: the outer one's cost already includes it.

Work outside every compute span (ops run between regions, e.g. a gradient accumulation between two ring
steps): in a metered trace the running totals show it, between two consecutive metered moments of a rank (its
calls, waits, marks, span starts and ends, ordered by the kernels counted) that no span covers. It becomes a
compute step of its own (op "untraced"), placed after the first of the two moments. Work before a rank's first
metered event is not seen.
Pure Python: no torch.
"""
from __future__ import annotations

import bisect
import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from parlab.trace.histogram import hist_sub
from parlab.trace import Event, Trace

__all__ = ["Step", "build_programs"]


@dataclass
class Step:
    kind: str                       # compute | mark | coll | send | recv | wait
    event: Event                    # the traced event this step comes from
    cost: float = 0.0               # seconds: compute time, or the call's communication time
    key: tuple = ()                 # matching key (coll, send, recv, wait)
    asynchronous: bool = False
    members: tuple[int, ...] = ()   # ranks that must all arrive (coll)
    extra: dict = field(default_factory=dict)


_LAST = 1 << 62   # at equal times, a compute span comes after the calls and waits that precede it


def _at(e: Event) -> float:
    """Where an event sits in its rank's program: its start (an async call's start is its issue)."""
    return e.start


def build_programs(trace: Trace, compute_cost: Callable[[Event], float],
                   comm_cost: Callable[[Event], float], untraced: bool = True) -> dict[int, list[Step]]:
    """Per-rank lists of `Step`s in program order, with costs from the two callbacks (seconds). `untraced`:
    add compute steps for the metered work done outside every compute span (module docstring)."""
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in trace.events:
        by_rank[e.rank].append(e)
    programs: dict[int, list[Step]] = {}
    for r, evs in by_rank.items():
        programs[r] = _program(r, evs, compute_cost, comm_cost, untraced)
    _check_matching(programs)
    return programs


def _program(rank: int, evs: list[Event], compute_cost, comm_cost, untraced: bool = True) -> list[Step]:
    computes = sorted((e for e in evs if e.kind == "compute"), key=lambda e: (e.start, -e.end))
    outer: list[Event] = []
    for e in computes:                           # drop spans nested in an earlier, longer one
        if outer and e.start >= outer[-1].start and e.end <= outer[-1].end and e is not outer[-1]:
            continue
        outer.append(e)
    # points: (time, order, Step) for everything that is not compute
    points: list[tuple[float, int, Step]] = []
    coll_count: dict[tuple, int] = defaultdict(int)
    send_count: dict[int, int] = defaultdict(int)
    recv_count: dict[int, int] = defaultdict(int)
    for i, e in enumerate(evs):
        if e.kind == "mark":
            points.append((e.start, i, Step("mark", e)))
        elif e.kind == "collective":
            g = tuple(e.group) or (rank,)
            k = coll_count[g]
            coll_count[g] += 1
            key = ("coll", g, k)
            points.append((_at(e), i, Step("coll", e, comm_cost(e), key, e.asynchronous, g)))
            if e.asynchronous and e.waited is not None:
                points.append((e.waited, i, Step("wait", e, 0.0, key)))
        elif e.kind == "p2p":
            if e.peer is None:
                raise ValueError(f"rank {rank}: a {e.op} event has no peer; point-to-point events need the other "
                                 f"rank (record them with parlab.comm.send / recv)")
            if e.op == "send":
                key = ("p2p", rank, e.peer, send_count[e.peer])
                send_count[e.peer] += 1
            else:
                key = ("p2p", e.peer, rank, recv_count[e.peer])
                recv_count[e.peer] += 1
            points.append((_at(e), i, Step(e.op, e, comm_cost(e), key, e.asynchronous)))
            if e.asynchronous and e.waited is not None:
                points.append((e.waited, i, Step("wait", e, 0.0, key)))
    points.sort(key=lambda p: (p[0], p[1]))
    # blocking communication occupies an interval; compute spans are cut at every point inside them
    steps: list[tuple[float, int, Step]] = list(points)
    times = [p[0] for p in points]
    for c in outer:
        inside = points[bisect.bisect_right(times, c.start):bisect.bisect_left(times, c.end)]
        cost = compute_cost(c)
        if not inside:
            steps.append((c.start, _LAST, Step("compute", c, cost)))
            continue
        cuts, t = [], c.start
        for at, _, st in inside:                 # pieces between the points, skipping blocking calls' own time
            cuts.append((t, at))
            blocking = st.kind in ("coll", "send", "recv") and not st.asynchronous
            t = max(at, min(st.event.end, c.end)) if blocking else at
        cuts.append((t, c.end))
        costs = _piece_costs(c, [_state(st) for _, _, st in inside], cost, compute_cost)
        if costs is None:                        # not metered: share the cost by measured durations
            total = sum(max(b - a, 0.0) for a, b in cuts)
            costs = [cost * ((max(b - a, 0.0) / total) if total > 0 else 1.0 / len(cuts)) for a, b in cuts]
        for (a, b), piece_cost in zip(cuts, costs):
            steps.append((a, _LAST, Step("compute", c, piece_cost, extra={"piece": True})))
    if untraced:
        steps += _untraced_work(rank, outer, points, compute_cost)
    steps.sort(key=lambda p: (p[0], p[1]))
    return [s for _, _, s in steps]


def _totals(s: tuple) -> tuple:
    """Running totals (flops, bytes, kernels, size histogram, batched flops, special elements, kernels run
    outside autograd); () when there are none. A trace recorded before special elements (plain kernels) were
    counted has five (six): the missing counts are 0."""
    return (*s, *(0,) * (7 - len(s))) if 5 <= len(s) <= 7 else ()


def _state(st: Step) -> tuple:
    """The meter's running totals where a point step happened (at a wait: when the program waited)."""
    return _totals(st.event.meter_waited if st.kind == "wait" else st.event.meter_at)


def _minus(b: tuple, a: tuple) -> tuple:
    """Work between two running totals (`_totals`)."""
    return b[0] - a[0], b[1] - a[1], b[2] - a[2], hist_sub(b[3], a[3]), b[4] - a[4], b[5] - a[5], b[6] - a[6]


def _span_start(c: Event) -> tuple:
    """The meter's running totals when span `c` began: its end totals less its own work."""
    end = _totals(c.meter_at)
    return (end[0] - c.flops, end[1] - c.nbytes, end[2] - c.kernels, hist_sub(end[3], c.mem_hist),
            end[4] - c.batched_flops, end[5] - c.special, end[6] - c.plain_kernels)


def _untraced_work(rank: int, outer: list[Event], points, compute_cost) -> list[tuple[float, int, Step]]:
    """Compute steps for the work the meter counted outside every compute span (module docstring): between
    two consecutive metered moments of the rank (its calls, waits, marks, the starts and ends of its spans, in
    the order of the kernels counted) that no span covers, placed after the first of the two."""
    marks = [(at, _state(st)) for at, _, st in points if _state(st)]
    metered = [c for c in outer if _totals(c.meter_at)]
    spans = [(_span_start(c), _totals(c.meter_at)) for c in metered]
    marks += [(c.start, s) for c, (s, _) in zip(metered, spans)]
    marks += [(c.end, e) for c, (_, e) in zip(metered, spans)]
    marks.sort(key=lambda m: (m[1][2], m[0]))                 # kernels counted so far: the program's order
    covered = sorted((s[2], e[2]) for s, e in spans)          # the kernels each span ran (spans do not nest)
    starts = [s for s, _ in covered]
    out = []
    for (t, a), (t_next, b) in zip(marks, marks[1:]):
        work = _minus(b, a)
        if work[2] <= 0 or work[0] < 0 or work[1] < 0 or any(v < 0 for _, v in work[3]):
            continue                                          # nothing ran (or the totals are inconsistent)
        i = bisect.bisect_right(starts, a[2]) - 1
        if i >= 0 and b[2] <= covered[i][1]:
            continue                                          # inside a span: its own cost covers it
        ev = Event(rank, "compute", "untraced", t, max(t, t_next), flops=work[0], nbytes=work[1], kernels=work[2],
                   mem_hist=work[3], batched_flops=max(work[4], 0.0), special=max(work[5], 0),
                   plain_kernels=min(max(work[6], 0), work[2]), label="metered work outside any traced region")
        out.append((t, _LAST, Step("compute", ev, compute_cost(ev))))
    return out


def _piece_costs(c: Event, states: list[tuple], cost: float, compute_cost) -> list[float] | None:
    """The cost of each piece of span `c` cut at points with the meter's running totals `states`, from the work
    counted between the cuts (module docstring); None when the trace does not say (no running totals, work given
    by hand that the totals do not match) or the cost model is not additive over work (the pieces would not sum
    to `cost`)."""
    if not _totals(c.meter_at) or not all(states):
        return None
    end = _totals(c.meter_at)
    marks = [_span_start(c), *states, end]
    pieces = []
    for a, b in zip(marks, marks[1:]):
        work = _minus(b, a)
        # a negative piece: the totals are not this span's work (e.g. flops= given to the region by hand)
        # (tolerances: float rounding of running sums, and of bytes scaled by parlab.cluster.scaleup.scale_work)
        if (work[0] < -1e-9 * max(abs(end[0]), 1.0) or work[1] < -1e-9 * max(abs(end[1]), 1.0) - 1 or work[2] < 0
                or any(v < 0 for _, v in work[3])):
            return None
        pieces.append(dataclasses.replace(c, flops=max(work[0], 0.0), nbytes=max(work[1], 0), kernels=work[2],
                                          mem_hist=work[3], batched_flops=min(max(work[4], 0.0), max(work[0], 0.0)),
                                          special=max(work[5], 0), plain_kernels=min(max(work[6], 0), work[2])))
    costs = [compute_cost(p) for p in pieces]
    if abs(sum(costs) - cost) > 1e-9 * max(abs(cost), 1e-300):
        return None
    return costs


def _check_matching(programs: dict[int, list[Step]]) -> None:
    """Every collective key needs every member's call; every message a send and a receive."""
    seen: dict[tuple, set[int]] = defaultdict(set)
    sends, recvs = set(), set()
    for r, steps in programs.items():
        for s in steps:
            if s.kind == "coll":
                seen[s.key].add(r)
            elif s.kind == "send":
                sends.add(s.key)
            elif s.kind == "recv":
                recvs.add(s.key)
    for key, ranks in seen.items():
        members = set(key[1])
        if not members <= set(programs) and len(members) > 1:
            missing = sorted(members - set(programs))
            raise ValueError(f"the trace has a collective on group {list(key[1])} but no events of rank(s) {missing}; "
                             f"replay needs the trace of every rank (parlab.run(..., trace=True) merges them)")
        if len(members) > 1 and ranks != members:
            raise ValueError(f"collective #{key[2]} on group {list(key[1])} was called by ranks {sorted(ranks)} only; "
                             f"every member must call a group's collectives in the same order")
    for key in sends ^ recvs:
        _, a, b, k = key
        side = "received" if key in sends else "sent"
        raise ValueError(f"message #{k} from rank {a} to rank {b} was never {side} in the trace: every send needs "
                         f"its recv (is the trace of rank {b if key in sends else a} missing or cut short?)")
