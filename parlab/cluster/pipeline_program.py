"""A pipeline step's program built from its schedule, without running ranks: what a trace of it would say.

`parlab.cluster.scaleup` re-times the program of a pipeline step (each rank's forwards, backwards, messages and
waits, in order) with a big model's costs. That program can come from a trace of a tiny run
(`parlab.parallel.pipeline.PipelineParallel` under ``parlab.run(..., trace=True)``), which needs one process per
stage and every micro-batch really run: GPT 1T on 512 GPUs (pp 64, m 512) would be 64 processes and about 200,000
events. `pipeline_trace(schedule)` writes the same program from the schedule alone, in the order the executor
issues it, so any pipeline shape replays in seconds:

    for each action of the rank, in the schedule's order (executor.PipelineParallel.step):
        F of stage s > 0, from another rank     post the receives of the plan up to act(s, mb), wait for it
        B / I of stage s < S - 1, from another  post the receives up to grad(s, mb), wait for it
        the action itself                        a compute span labelled "stage s mb i" (op forward, backward,
                                                 backward_input or backward_weight)
        F of s < S - 1 to another rank           post the receives up to it, then isend act(s + 1, mb)
        B / I of s > 0 to another rank           post the receives up to it, then isend grad(s - 1, mb)
    every send waited for at the end of the step (the gloo rule; p2p.StageMessages.end)
    the tied embedding: the ranks of the first and last stage exchange their gradients, the lower rank isend
        then recv, the higher recv then send (stages.PipelineStages._sync_tied)

Receives and sends are posted in the one merged order of `parlab.parallel.pipeline.plan.merged_plan` (receives
early, each send once its tensor exists), as `parlab.parallel.pipeline.p2p.StageMessages` posts them. Times are
ticks (one per step, a compute span half a tick long): only their order matters, the replay gives every step its
duration. A wait for a send that completed early (the executor's `reap` after each action) depends on the
measured timing and is not written: every send is waited for at the end, which is where a replay of a traced
run finds them too (tests/test_pipeline_program.py replays both to the same time).

Pure Python: no torch.distributed, no processes.
"""
from __future__ import annotations

from collections import defaultdict

from parlab.parallel.pipeline.plan import needs_remote, produces_remote
from parlab.parallel.pipeline.schedules import KINDS, Action, Schedule
from parlab.parallel.pipeline.simulation import message_sequence
from parlab.trace import Event, Trace

__all__ = ["pipeline_trace"]


def _label(kind: str, dst: int, mb: int) -> str:
    src = dst - 1 if kind == "act" else dst + 1
    return f"stage {src} -> {dst} {kind} mb {mb}"


def pipeline_trace(schedule: Schedule, tied_embedding: bool = True) -> Trace:
    """The trace one step of `schedule` run by `PipelineParallel` would record, its times in ticks (module
    docstring). `tied_embedding`: the model ties its input embedding and output layer (GPT-2, Megatron's GPT), so
    the first and last stage exchange that gradient after the step when they sit on different ranks."""
    if not isinstance(schedule, Schedule):
        raise ValueError(f"pipeline_trace needs a parlab.parallel.pipeline.Schedule (e.g. one_f_one_b(8, 64)), "
                         f"got {type(schedule).__name__}")
    S, pl, P = schedule.stages, schedule.placement, schedule.ranks
    plans: dict[int, list[tuple[str, int, tuple]]] = defaultdict(list)   # rank -> (op, peer, key) in posting order
    for src, dst, kind, stage, mb in message_sequence(schedule):
        plans[src].append(("send", dst, (kind, stage, mb)))
        plans[dst].append(("recv", src, (kind, stage, mb)))
    events: list[Event] = []
    for r in range(P):
        events += _rank_program(r, schedule.actions[r], plans[r], S, pl)
    if tied_embedding and pl[0] != pl[S - 1]:
        events += _tied_exchange(pl[0], pl[S - 1], events)
    return Trace(events, "pipeline program (ticks)")


def _rank_program(r: int, actions: tuple[Action, ...], plan: list[tuple[str, int, tuple]], S: int,
                  pl: tuple[int, ...]) -> list[Event]:
    steps: list[tuple] = []                  # (kind, op, tick, label, peer) in program order
    waited: dict[int, float] = {}            # index in steps of an isend / irecv -> the tick it was waited for
    recvs: dict[tuple, int] = {}             # message key -> index in steps of its posted irecv
    sends: list[int] = []
    posted, tick = 0, 0

    def post_until(op: str, key: tuple) -> None:
        nonlocal posted, tick
        while posted < len(plan):
            p_op, peer, p_key = plan[posted]
            if p_op == "recv":
                recvs[p_key] = len(steps)
            elif (p_op, p_key) != (op, key):
                raise ValueError(f"pipeline rank {r} would post send {p_key} before {op} {key}: the schedule "
                                 f"produces its messages out of the merged order")
            else:
                sends.append(len(steps))
            steps.append(("p2p", p_op, tick, _label(*p_key), peer))
            tick += 1
            posted += 1
            if (p_op, p_key) == (op, key):
                return
        raise ValueError(f"pipeline rank {r}: {op} {key} is not among its messages")

    for a in actions:
        post = needs_remote(a, S, pl, r)
        if post is not None:
            if post.key not in recvs:
                post_until("recv", post.key)
            waited[recvs.pop(post.key)] = tick
            tick += 1
        steps.append(("compute", KINDS[a.kind], tick, f"stage {a.stage} mb {a.mb}", None))
        tick += 1
        post = produces_remote(a, S, pl, r)
        if post is not None:
            post_until("send", post.key)
    for i in sends:                          # p2p.StageMessages.end: every isend waited
        waited[i] = tick
        tick += 1
    if posted != len(plan) or recvs:
        raise ValueError(f"pipeline rank {r}: messages left unexchanged at the end of the step")  # a schedule bug
    out = []
    for i, (kind, op, t, label, peer) in enumerate(steps):
        if kind == "compute":
            out.append(Event(r, kind, op, t, t + 0.5, label=label))
        else:
            out.append(Event(r, kind, op, t, t, group=(min(r, peer), max(r, peer)), peer=peer, label=label,
                             asynchronous=True, waited=waited.get(i)))
    return out


def _tied_exchange(first: int, last: int, events: list[Event]) -> list[Event]:
    """The tied embedding's gradient exchange after the step (stages._sync_tied): lower rank isend + recv,
    higher rank recv + send."""
    end = {r: max(e.end for e in events if e.rank == r) + 1 for r in (first, last)}
    lo, hi = min(first, last), max(first, last)
    g, label = (lo, hi), "tied embedding grad"
    t = end[lo]
    return [Event(lo, "p2p", "send", t, t, group=g, peer=hi, label=label, asynchronous=True, waited=t + 2),
            Event(lo, "p2p", "recv", t + 1, t + 1.5, group=g, peer=hi, label=label),
            Event(hi, "p2p", "recv", end[hi], end[hi] + 0.5, group=g, peer=lo, label=label),
            Event(hi, "p2p", "send", end[hi] + 1, end[hi] + 1.5, group=g, peer=lo, label=label)]
