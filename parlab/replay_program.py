"""From a trace to per-rank programs: the ordered steps a replay (`parlab.replay`) re-times.

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
cut at them; its cost is shared among the pieces in proportion to their measured durations. A compute span
inside another compute span of the same rank is dropped: the outer one's cost already includes it.
Pure Python: no torch.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from .trace import Event, Trace

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
                   comm_cost: Callable[[Event], float]) -> dict[int, list[Step]]:
    """Per-rank lists of `Step`s in program order, with costs from the two callbacks (seconds)."""
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in trace.events:
        by_rank[e.rank].append(e)
    programs: dict[int, list[Step]] = {}
    for r, evs in by_rank.items():
        programs[r] = _program(r, evs, compute_cost, comm_cost)
    _check_matching(programs)
    return programs


def _program(rank: int, evs: list[Event], compute_cost, comm_cost) -> list[Step]:
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
        total = sum(max(b - a, 0.0) for a, b in cuts)
        for a, b in cuts:
            share = (max(b - a, 0.0) / total) if total > 0 else 1.0 / len(cuts)
            piece = Step("compute", c, cost * share, extra={"piece": True})
            steps.append((a, _LAST, piece))
    steps.sort(key=lambda p: (p[0], p[1]))
    return [s for _, _, s in steps]


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
