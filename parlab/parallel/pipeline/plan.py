"""Posting plans for the pipeline's point-to-point messages, and a model of NCCL's serialised p2p queue.

A pipeline rank exchanges activations and gradients with several peers. The order in which it *posts* them
(isend / irecv) matters on NCCL, for two reasons:

* a send of a large message completes only once the peer has posted the matching receive (rendezvous: the
  data goes straight into the receiver's buffer; only small messages may slip through NCCL's buffers);
* when torch.distributed is initialised with ``device_id=`` (eager communicators, as ``parlab.init`` and
  ``parlab.run`` do on NCCL), torch >= 2.5 issues every plain ``isend`` / ``irecv`` of a process group on
  the group's one communicator and stream, so **all of a rank's p2p operations run one at a time, in post
  order, whatever the peer** - not one independent FIFO per pair of ranks.

Under these two rules a rank whose first queued operation is "send to rank 1" is stuck until rank 1's first
queued operation is the matching receive. Posting each pair's messages in one mirrored order (what the
executor did first, `simulation.message_order`) is not enough: with three or more ranks the heads of the
queues can wait on each other in a cycle. At p = 3 with interleaving, rank 0 sends act(stage 1, mb 2) to
rank 1 while rank 1 sends act(stage 2, mb 1) to rank 2 and rank 2 sends act(stage 3, mb 0) to rank 0.

The fix: every rank posts *all* its messages in one order merged across peers, the global order
`simulation.message_sequence` (the simulated time each message is produced). Both ends of every message then
agree on a single total order, and the earliest unfinished message is always at the head of both queues, so
the queues never wait in a cycle. `merged_plan(schedule, rank)` is that plan, what the executor posts.

`serialised_run(schedule, posting, queues)` models the executor's host logic (post a send when its data is
produced, post the receives before it in the plan early, wait for a receive when an action needs it, wait
for every send at the end of the step) against one serialised rendezvous queue per rank (``queues="rank"``)
or per pair (``queues="pair"``, the assumption the old order relied on), and returns a description of the
deadlock, or None when the step completes. Pure Python: no torch, no torch.distributed.

References
    NCCL User Guide, "Point-to-point communication" and "Group calls" (sends block until the peer receives).
    PyTorch, ProcessGroupNCCL: eagerly initialised communicators (``init_process_group(device_id=...)``)
    run a group's point-to-point operations on the group's one communicator (torch >= 2.5).
    D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
    SC 2021, arXiv:2104.04473 (interleaved 1F1B; Megatron batches each step's p2p in one call).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator

from parlab.parallel.pipeline.schedules import Action, Schedule, ScheduleError
from parlab.parallel.pipeline.simulation import message_order, message_sequence

__all__ = ["Post", "merged_plan", "pair_plans", "serialised_run", "check_serialised", "POSTINGS", "QUEUES",
           "needs_remote", "produces_remote"]

POSTINGS = ("merged", "per-pair")
QUEUES = ("rank", "pair")
_FLIP = {"send": "recv", "recv": "send"}


@dataclass(frozen=True)
class Post:
    """One point-to-point operation a rank posts: a send to or a receive from pipeline rank `peer` of the
    message `key` = (kind "act" or "grad", receiving stage, micro-batch)."""
    op: str
    peer: int
    key: tuple[str, int, int]

    def __str__(self) -> str:
        kind, stage, mb = self.key
        return f"{self.op} {kind}(stage {stage}, mb {mb}) {'to' if self.op == 'send' else 'from'} rank {self.peer}"


def merged_plan(schedule: Schedule, rank: int) -> list[Post]:
    """Every point-to-point operation of `rank`, with every peer, in the one global order
    (`simulation.message_sequence`): the order the pipeline executor posts them."""
    out = []
    for src, dst, kind, stage, mb in message_sequence(schedule):
        if src == rank:
            out.append(Post("send", dst, (kind, stage, mb)))
        elif dst == rank:
            out.append(Post("recv", src, (kind, stage, mb)))
    return out


def pair_plans(schedule: Schedule, rank: int) -> dict[int, list[Post]]:
    """Peer -> `rank`'s operations with that peer in the pair's mirrored order (`simulation.message_order`):
    the executor's first plan, right for one independent FIFO per pair, not for one queue per rank."""
    out: dict[int, list[Post]] = {}
    for (a, b), msgs in message_order(schedule).items():
        if rank in (a, b):
            peer = b if rank == a else a
            out[peer] = [Post("send" if src == rank else "recv", peer, (kind, stage, mb))
                         for src, kind, stage, mb in msgs]
    return out


def _host(schedule: Schedule, rank: int) -> Iterator[tuple[str, Post | None]]:
    """The executor's host program on `rank` as ("need", recv) / ("produce", send) / ("drain", None) steps."""
    S, pl = schedule.stages, schedule.placement
    for a in schedule.actions[rank]:
        need = needs_remote(a, S, pl, rank)
        if need is not None:
            yield "need", need
        made = produces_remote(a, S, pl, rank)
        if made is not None:
            yield "produce", made
    yield "drain", None


def needs_remote(a: Action, S: int, pl, rank: int) -> Post | None:
    """The message action `a` on `rank` waits for from another rank (a receive), or None: a forward of stage s > 0
    needs act(s) from stage s - 1, a backward (or B_input) of s < S - 1 needs grad(s) from s + 1."""
    if a.kind == "F" and a.stage > 0 and pl[a.stage - 1] != rank:
        return Post("recv", pl[a.stage - 1], ("act", a.stage, a.mb))
    if a.kind in "BI" and a.stage < S - 1 and pl[a.stage + 1] != rank:
        return Post("recv", pl[a.stage + 1], ("grad", a.stage, a.mb))
    return None


def produces_remote(a: Action, S: int, pl, rank: int) -> Post | None:
    """The message action `a` on `rank` hands to another rank (a send), or None: the mirror of `needs_remote`."""
    if a.kind == "F" and a.stage < S - 1 and pl[a.stage + 1] != rank:
        return Post("send", pl[a.stage + 1], ("act", a.stage + 1, a.mb))
    if a.kind in "BI" and a.stage > 0 and pl[a.stage - 1] != rank:
        return Post("send", pl[a.stage - 1], ("grad", a.stage - 1, a.mb))
    return None


class _Rank:
    """One rank of the model: its host program, what it has posted, and its queue(s) of unfinished posts."""

    def __init__(self, schedule: Schedule, rank: int, posting: str, queues: str):
        self.rank, self.queues = rank, queues
        if posting == "merged":
            self.plans = {None: merged_plan(schedule, rank)}
        else:
            self.plans = pair_plans(schedule, rank)
        self.pos = {k: 0 for k in self.plans}
        self.host = _host(schedule, rank)
        self.step = next(self.host)
        self.queue: dict[int | None, deque[Post]] = {}
        self.done: set[Post] = set()
        self.posted: set[Post] = set()

    def post_until(self, target: Post) -> None:
        plan_key = None if None in self.plans else target.peer
        plan = self.plans.get(plan_key, [])
        while self.pos[plan_key] < len(plan):
            post = plan[self.pos[plan_key]]
            if post.op == "send" and post != target:
                raise ScheduleError(f"rank {self.rank} would post {target} before its own {post}: the plan does not "
                                    f"fit the schedule")
            self.pos[plan_key] += 1
            self.posted.add(post)
            self.queue.setdefault(None if self.queues == "rank" else post.peer, deque()).append(post)
            if post == target:
                return
        raise ScheduleError(f"rank {self.rank}: {target} is not in its posting plan")

    def advance(self) -> bool:
        """Run the host program as far as it goes without blocking; True if it moved."""
        moved = False
        while self.step is not None:
            kind, post = self.step
            if kind == "need":
                if post not in self.posted:
                    self.post_until(post)
                    moved = True
                if post not in self.done:
                    return moved
            elif kind == "produce":
                self.post_until(post)
            else:   # drain: every send waited (the executor's end of step)
                unposted = sum(len(p) - self.pos[k] for k, p in self.plans.items())
                if unposted:
                    raise ScheduleError(f"rank {self.rank} ends the step with {unposted} operations never posted")
                if any(q for q in self.queue.values()):
                    return moved
            self.step = next(self.host, None)
            moved = True
        return moved

    def head(self, peer: int) -> Post | None:
        q = self.queue.get(None if self.queues == "rank" else peer)
        return q[0] if q else None

    def blocked_on(self) -> str:
        heads = [str(q[0]) for q in self.queue.values() if q]
        at = "done" if self.step is None else (f"host waits for {self.step[1]}" if self.step[0] == "need"
                                               else "host waits for its sends at the end of the step")
        return f"rank {self.rank}: {at}; queue head {' / '.join(heads) or '(empty)'}"


def serialised_run(schedule: Schedule, posting: str = "merged", queues: str = "rank") -> str | None:
    """Run the executor's posting logic for `schedule` against rendezvous queues (a send finishes only together
    with its receive, and only when both are at the head of their queues). `posting`: "merged" (one order per
    rank across peers, what the executor does) or "per-pair" (each pair's mirrored order, the old executor).
    `queues`: "rank" (one serialised p2p queue per rank: NCCL with eager communicators) or "pair" (one
    independent FIFO per pair of ranks). Returns None when the step completes, else what each rank waits for."""
    if posting not in POSTINGS:
        raise ValueError(f"posting must be one of {POSTINGS}, got {posting!r}")
    if queues not in QUEUES:
        raise ValueError(f"queues must be one of {QUEUES}, got {queues!r}")
    ranks = [_Rank(schedule, r, posting, queues) for r in range(schedule.ranks)]
    while True:
        moved = False
        for rk in ranks:
            moved |= rk.advance()
        for rk in ranks:                                  # complete every send whose receive faces it
            for q in list(rk.queue.values()):
                if not q or q[0].op != "send":
                    continue
                post, other = q[0], ranks[q[0].peer]
                facing = other.head(rk.rank)
                if facing is not None and facing.op == "recv" and facing.peer == rk.rank:
                    if facing.key != post.key:
                        raise ScheduleError(f"rank {rk.rank} posts {post} facing rank {other.rank}'s {facing}: "
                                            f"the two sides disagree on the message order")
                    q.popleft()
                    other.queue[None if queues == "rank" else rk.rank].popleft()
                    rk.done.add(post)
                    other.done.add(facing)
                    moved = True
        if not moved:
            break
    if all(rk.step is None for rk in ranks):
        return None
    return "; ".join(rk.blocked_on() for rk in ranks if rk.step is not None)


def check_serialised(schedule: Schedule) -> Schedule:
    """Raise `ScheduleError` unless the executor's merged posting order runs `schedule` to the end with one
    serialised rendezvous queue per rank (NCCL's behaviour); returns the schedule."""
    stuck = serialised_run(schedule, "merged", "rank")
    if stuck is not None:
        raise ScheduleError(f"{schedule.name}: deadlock with one serialised p2p queue per rank: {stuck}")
    return schedule
