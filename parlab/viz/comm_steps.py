"""A trace's communication as steps and messages (pure data; `parlab.viz.animation` draws them).

A *step* is one send with its matching recv, or one collective call across its group; its messages are
(sender, receiver, bytes):

* a send and the matching recv are one step (the k-th send from rank a to rank b pairs with the k-th recv
  on b from a: torch matches messages in order);
* a collective call is one step across its group (every rank calls the collectives of a group in the same
  order, so the k-th call on a group is the same call on every member). Its arrows follow the algorithm
  whose bytes `parlab.trace.wire_bytes` counts, so the arrows leaving a rank add up to that rank's
  `Event.wire_bytes`:

      all_reduce                      ring g0 -> g1 -> ... -> g0, 2 (N-1)/N X per arrow
      all_gather / reduce_scatter     ring, (N-1)/N X per arrow
      all_to_all                      every rank to every other, X/N per arrow, or the bytes each rank
                                      recorded for each peer (`Event.splits`: an uneven all-to-all, such as
                                      tokens dispatched to their experts); empty messages are not drawn
      broadcast                       pipelined chain from the root, X per arrow
      reduce                          chain into the root, X per arrow
      scatter / gather                root to each rank / each rank to the root, X/N per arrow

`algorithm_steps` plays a call *as its algorithm runs*: a ring all-reduce on N ranks is
2(N-1) frames (N-1 reduce-scatter steps, then N-1 all-gather steps), each moving one chunk of X/N from every rank
to its right neighbour; all-gather, reduce-scatter and all-to-all are N-1 frames, a chain broadcast/reduce N-1
hops, scatter/gather N-1 messages. Next to every rank a row of squares shows the chunks it holds after the frame
(pale: a partial sum of few ranks; full colour: complete), so the student sees the sums build up and then travel
round the ring. Summed over a call's frames, the arrows leaving a rank still carry its `Event.wire_bytes`.
`step_title` says what a step moved, in the language in force.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parlab.i18n import _
from parlab.trace import Event
from parlab.trace.wire import ring_factor
from parlab.viz import style
from parlab.viz.timeline import as_trace

__all__ = ["Step", "Move", "comm_steps", "step_edges", "algorithm_steps", "initial_chunks", "step_title", "REDUCING"]

REDUCING = ("all_reduce", "reduce_scatter", "reduce")   # ops whose chunks are summed on the way


@dataclass
class Step:
    """One communication step: a collective call across its group, or one send -> recv pair."""
    op: str
    kind: str                               # "collective" | "p2p"
    label: str
    group: tuple[int, ...]                  # the collective's group, or (src, dst) for p2p
    nbytes: int                             # payload of the call (see parlab.trace)
    root: int | None = None                 # broadcast/reduce/scatter/gather root
    events: list[Event] = field(default_factory=list)

    @property
    def start(self) -> float:
        return min(e.start for e in self.events)

    @property
    def edges(self) -> list[tuple[int, int, float]]:
        return step_edges(self)


def comm_steps(trace: Any) -> list[Step]:
    """Group a trace's communication events into steps, in order of their first event's start."""
    steps: dict[tuple, Step] = {}
    calls: dict[tuple, int] = {}            # how many calls of this kind a rank has made so far

    def nth(key: tuple) -> int:
        calls[key] = calls.get(key, -1) + 1
        return calls[key]

    for e in as_trace(trace).comm().events:  # sorted by start: each rank's events are in program order
        if e.kind == "collective":
            key = ("collective", e.group, nth((e.rank, e.group)))
            new = Step(e.op, e.kind, e.label, e.group, e.nbytes, root=e.peer)
        else:
            src, dst = (e.rank, e.peer) if e.op == "send" else (e.peer, e.rank)
            key = ("p2p", src, dst, nth((e.op, src, dst)))
            new = Step("send", e.kind, e.label, (src, dst), e.nbytes)
        step = steps.setdefault(key, new)
        step.events.append(e)
        step.label = step.label or e.label
    return sorted(steps.values(), key=lambda s: s.start)


def _all_to_all_bytes(step: Step) -> dict[tuple[int, int], float]:
    """{(sender, receiver): bytes} of an all-to-all: what each rank recorded for each peer (`Event.splits`), or
    X/N for every pair when a rank recorded none (an even all-to-all)."""
    g, n = list(step.group), len(step.group)
    split = {e.rank: e.splits for e in step.events if e.splits and len(e.splits) == n}
    if set(split) != set(g):
        return {(a, b): step.nbytes / n for a in g for b in g if a != b}
    return {(a, b): float(split[a][j]) for a in g for j, b in enumerate(g) if a != b}


def step_edges(step: Step) -> list[tuple[int, int, float]]:
    """The messages of one step as (sender, receiver, bytes) under the algorithm in the module docstring."""
    g, x = list(step.group), float(step.nbytes)
    n = len(g)
    if step.kind == "p2p":
        return [(g[0], g[1], x)]
    if n < 2 or step.op == "barrier":
        return []
    ring = [(g[i], g[(i + 1) % n]) for i in range(n)]
    if step.op in ("all_reduce", "all_gather", "reduce_scatter"):
        return [(a, b, ring_factor(step.op, n) * x) for a, b in ring]
    if step.op == "all_to_all":
        return [(a, b, nb) for (a, b), nb in _all_to_all_bytes(step).items() if nb > 0]
    if step.root not in g:
        return []
    k = g.index(step.root)
    chain = g[k:] + g[:k]                   # root first, then the group order around the ring
    if step.op == "broadcast":
        return [(chain[i], chain[i + 1], x) for i in range(n - 1)]
    if step.op == "reduce":
        return [(chain[i], chain[i - 1], x) for i in range(n - 1, 0, -1)]
    if step.op == "scatter":
        return [(step.root, b, x / n) for b in chain[1:]]
    if step.op == "gather":
        return [(a, step.root, x / n) for a in chain[1:]]
    return []


@dataclass
class Move:
    """One message inside a call's algorithm: `chunk` of the tensor (None: the whole payload) from src to dst,
    added to dst's copy when `reduce`, else copied over it."""
    src: int
    dst: int
    nbytes: float
    chunk: int | None = None
    reduce: bool = False


def algorithm_steps(step: Step) -> list[tuple[str, list[Move]]]:
    """The call as its algorithm runs it: [(what happens in this step, the messages of this step), ...].

    Ring (group order g0 -> g1 -> ... -> g0, chunks of X/N, rank g_i starts owning chunk i):

    * reduce-scatter, N-1 steps: in step s rank g_i sends chunk (i-s-1) mod N to g_{i+1}, which adds it to
      its own; after the last step g_i holds the complete sum of chunk i;
    * all-gather, N-1 steps: in step s rank g_i sends chunk (i-s) mod N to g_{i+1}, which keeps it;
    * all-reduce: the two in a row, 2(N-1) steps;
    * all-to-all, N-1 steps: in step s rank g_i sends its chunk for g_{i+s} straight to it;
    * broadcast / reduce: a chain from / into the root, N-1 hops of the whole tensor;
    * scatter / gather: the root sends / receives the N-1 other chunks, one per step.

    The bytes leaving each rank, summed over the steps, equal `step_edges` (and so `Event.wire_bytes`)."""
    g, x = list(step.group), float(step.nbytes)
    n = len(g)
    if step.kind == "p2p":
        return [(_("one message"), [Move(g[0], g[1], x)])]
    if n < 2 or step.op == "barrier":
        return [(_("no data moves"), [])]
    nxt = lambda i: g[(i + 1) % n]                                   # noqa: E731
    rs = [(_("reduce-scatter {step}/{steps}: every rank sends one chunk to its right neighbour, which adds it to "
             "its own").format(step=s + 1, steps=n - 1),
           [Move(g[i], nxt(i), x / n, (i - s - 1) % n, True) for i in range(n)]) for s in range(n - 1)]
    ag = [(_("all-gather {step}/{steps}: every rank passes a complete chunk to its right neighbour").format(
           step=s + 1, steps=n - 1), [Move(g[i], nxt(i), x / n, (i - s) % n) for i in range(n)]) for s in range(n - 1)]
    if step.op == "all_reduce":
        return rs + ag
    if step.op == "reduce_scatter":
        return rs
    if step.op == "all_gather":
        return ag
    if step.op == "all_to_all":
        what = (_("all-to-all {step}/{steps}: every rank sends its chunk for the rank {places} place further round "
                  "straight to it"), _("all-to-all {step}/{steps}: every rank sends its chunk for the rank {places} "
                                       "places further round straight to it"))
        sent = _all_to_all_bytes(step)
        return [(what[s > 1].format(step=s, steps=n - 1, places=s),
                 [Move(g[i], g[(i + s) % n], sent[(g[i], g[(i + s) % n])], (i + s) % n) for i in range(n)
                  if sent[(g[i], g[(i + s) % n])] > 0]) for s in range(1, n)]
    if step.root not in g:
        return [(_("root outside the group: not drawn"), [])]
    chain = g[g.index(step.root):] + g[:g.index(step.root)]             # the root first, then round the ring
    if step.op == "broadcast":
        return [(_("broadcast hop {hop}/{hops}: rank {rank} forwards the tensor").format(
                    hop=i + 1, hops=n - 1, rank=chain[i]), [Move(chain[i], chain[i + 1], x, 0)]) for i in range(n - 1)]
    if step.op == "reduce":
        return [(_("reduce hop {hop}/{hops}: rank {rank} sends its partial sum towards the root").format(
                    hop=n - i, hops=n - 1, rank=chain[i]), [Move(chain[i], chain[i - 1], x, 0, True)])
                for i in range(n - 1, 0, -1)]
    if step.op == "scatter":
        return [(_("scatter {step}/{steps}: the root sends rank {rank} its chunk").format(step=i, steps=n - 1, rank=r),
                 [Move(step.root, r, x / n, g.index(r))]) for i, r in enumerate(chain[1:], 1)]
    if step.op == "gather":
        return [(_("gather {step}/{steps}: rank {rank} sends the root its chunk").format(step=i, steps=n - 1, rank=r),
                 [Move(r, step.root, x / n, g.index(r))]) for i, r in enumerate(chain[1:], 1)]
    return [(_("not drawn"), [])]


def initial_chunks(step: Step) -> tuple[int, dict[int, list[set]]] | None:
    """(chunks per rank, {rank: [set of ranks whose data is in chunk c]}) before the call, or None when a
    row of chunk squares would not help (point to point, all-to-all, barrier)."""
    g, n = list(step.group), len(step.group)
    if step.kind == "p2p" or n < 2 or step.op in ("all_to_all", "barrier") or \
            (step.op in ("broadcast", "reduce", "scatter", "gather") and step.root not in g):
        return None
    if step.op in ("broadcast", "reduce"):
        return 1, {r: [{i} if step.op == "reduce" or r == step.root else set()] for i, r in enumerate(g)}
    if step.op == "scatter":
        return n, {r: [{c} if r == step.root else set() for c in range(n)] for r in g}
    if step.op in ("all_gather", "gather"):
        return n, {r: [{c} if c == i else set() for c in range(n)] for i, r in enumerate(g)}
    return n, {r: [{i} for _c in range(n)] for i, r in enumerate(g)}     # all_reduce, reduce_scatter


def _sent_by(edges) -> dict[int, float]:
    """{rank: bytes its arrows carry} of a call's edges (src, dst, bytes)."""
    out: dict[int, float] = {}
    for a, _dst, nb in edges:
        out[a] = out.get(a, 0) + nb
    return out


def step_title(step: Step, per_call: bool = True) -> str:
    """E.g. "all_reduce 'grads' on ranks [0, 1, 2, 3]: 64 B payload, 96 B per arrow" (per_call: the call's
    arrows are its total), or "..., 96 B sent per rank in all" when the call is played step by step (each
    frame's arrows then carry a chunk, and the call's total must not read as an arrow's). Where the arrows or
    the ranks differ it says so: "12 B to 40 B per arrow" (an uneven all-to-all), "3.2 MB sent by each of ranks
    0, 1, 2 in all, rank 3 sends nothing" (a chain broadcast: the last rank only receives)."""
    label, edges = (f" '{style.event_label(step.label)}'" if step.label else ""), step_edges(step)
    root = _(" (root {root})").format(root=step.root) if step.root is not None else ""
    sizes = sorted({e.nbytes for e in step.events}) or [step.nbytes]     # an uneven all-to-all: one per rank
    payload = style.human_bytes(sizes[0]) if len(sizes) == 1 else _("{low} to {high}").format(
        low=style.human_bytes(sizes[0]), high=style.human_bytes(sizes[-1]))
    head = dict(op=step.op, label=label, group=list(step.group), root=root, payload=payload)
    if step.kind == "p2p":
        return _("send rank {src} → rank {dst}{label}: {payload}").format(
            **head, src=step.group[0], dst=step.group[-1])
    if not edges:
        return _("{op}{label} on ranks {group}{root}: {payload} payload").format(**head)
    if per_call:
        lo, hi = min(e[2] for e in edges), max(e[2] for e in edges)
        if lo == hi:
            return _("{op}{label} on ranks {group}{root}: {payload} payload, {nbytes} per arrow").format(
                **head, nbytes=style.human_bytes(hi))
        return _("{op}{label} on ranks {group}{root}: {payload} payload, {low} to {high} per arrow").format(
            **head, low=style.human_bytes(lo), high=style.human_bytes(hi))
    sent = {r: _sent_by(edges).get(r, 0.0) for r in step.group}
    if len(set(sent.values())) == 1:
        return _("{op}{label} on ranks {group}{root}: {payload} payload, {nbytes} sent per rank in all").format(
            **head, nbytes=style.human_bytes(max(sent.values())))
    idle, senders = [r for r, b in sent.items() if b == 0], [r for r, b in sent.items() if b > 0]
    nbytes, ranks = style.human_bytes(max(sent.values())), ", ".join(map(str, senders))
    if len({sent[r] for r in senders}) > 1:
        text = _("{op}{label} on ranks {group}{root}: {payload} payload, up to {nbytes} sent by one rank in "
                 "all").format(**head, nbytes=nbytes)
    elif len(senders) == 1:
        text = _("{op}{label} on ranks {group}{root}: {payload} payload, {nbytes} sent by rank {ranks} in "
                 "all").format(**head, nbytes=nbytes, ranks=ranks)
    else:
        text = _("{op}{label} on ranks {group}{root}: {payload} payload, {nbytes} sent by each of ranks {ranks} in "
                 "all").format(**head, nbytes=nbytes, ranks=ranks)
    if idle:
        text += _(", rank {ranks} sends nothing").format(ranks=", ".join(map(str, idle))) if len(idle) == 1 else \
            _(", ranks {ranks} send nothing").format(ranks=", ".join(map(str, idle)))
    return text
