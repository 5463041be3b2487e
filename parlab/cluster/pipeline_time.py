"""A pipeline step timed by running its schedule: what the replay of the built program gives, without building it.

`parlab.cluster.closed_form.step_terms` adds a pipeline step up in a few terms; it leaves out the order of each
rank's steps in the fill and drain and the waits of a steady state whose ranks differ (a slow last stage with
the logits, alternating MoE and dense stages, ZeRO-3's gathers on one rank). `simulated_step(costs, m, schedule)`
runs the schedule instead, with `parlab.cluster.step_costs.StepCosts`'s action and message times, under the rules
the replay (`parlab.cluster.replay`) applies to the program `parlab.cluster.pipeline_program.pipeline_trace`
builds from the same schedule:

    each rank        runs its actions in the schedule's order, each when the rank is free and its input is there
    a message        (an activation forward, a gradient back) moves when both ends have posted it: the sender
                     right after the action that produces it, the receiver when its merged posting order
                     (`parlab.parallel.pipeline.simulation.message_sequence`) reaches it: early when a send of its
                     own comes later in that order, else only just before the action that needs it. It arrives a
                     `StepCosts.message()` after the later of the two posts: a receive posted late pays the whole
                     transfer after it, though the sender finished long before (the rendezvous the closed form
                     and `parlab.parallel.pipeline.simulation.simulate` leave out)
    end of the step  the tied embedding's gradients exchanged between the first and last stage's ranks (two
                     messages in turn); then each rank's exposed gradient sync (`StepCosts.exposed_grad_sync`) and
                     its Adam step (`SyncCosts.optimizer`), beside its sends still in flight: the rank ends when
                     both are done (the program waits for its sends after the step's other work)

The step is the last rank's end; a message also ends the hardware's `p2p_delay` (or `comm_delay`) later, as in
the replay. It equals the replay of the built program to float rounding on every schedule here
(tests/test_cost_model_property.py), on hardware whose communication overlaps compute (the GPU presets). A
description with `comm_overlap` False (a calibrated CPU, whose cores move the bytes) also charges each send and
receive to its rank's core; that is left out here (1-3% short on a 4-stage example).

The schedule's structure (who waits for which action, after which of its own actions each receive is posted)
depends only on (schedule, pp, m, v) and is cached (0.1-0.3 s for pp 32 and m 512); the timing is one pass over
the actions (2 pp v m of them, 3 for ZB-H1), about 2 us each. References: Narayanan et al., SC 2021 (1F1B,
interleaved); Qi et al., ICLR 2024 (ZB-H1); Huang et al., NeurIPS 2019 (GPipe).
Pure Python: no torch.
"""
from __future__ import annotations

import functools

from parlab.parallel.pipeline import schedules as sch
from parlab.parallel.pipeline.simulation import UNIT_COSTS

__all__ = ["schedule_for", "simulated_step"]

_OPS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


@functools.lru_cache(maxsize=32)
def schedule_for(name: str, pp: int, m: int, v: int = 1) -> sch.Schedule:
    """The `Schedule` the planner's `schedule` names: "1f1b" (interleaved with v > 1), "gpipe", "zb-h1"."""
    if name == "1f1b":
        return sch.one_f_one_b(pp, m) if v == 1 else sch.interleaved_1f1b(pp, m, v)
    if v != 1 or name not in ("gpipe", "zb-h1"):
        raise ValueError(f"no pipeline schedule {name!r} with virtual={v}; known: 1f1b (interleaved with virtual "
                         f"> 1), gpipe, zb-h1")
    return (sch.gpipe if name == "gpipe" else sch.zero_bubble_h1)(pp, m)


@functools.lru_cache(maxsize=32)
def _shape(name: str, pp: int, m: int, v: int):
    """The timing-free structure of a schedule: per rank its actions as (op, stage), what each one waits for from
    another rank as (producer rank, producer's index, index of this rank's action after which the receive is
    posted, -1: before the first), and its sends as (index, receiver, receiver's posting index)."""
    s = schedule_for(name, pp, m, v)
    keys, outs, src = _messages(s)
    posted = _posting(s, keys, outs, src)
    needs = tuple(tuple(None if k is None else (*src[r][i], posted[r][k]) for i, k in enumerate(keys_r))
                  for r, keys_r in enumerate(keys))
    sends = tuple(tuple((i, o[0], posted[o[0]][o[1]]) for i, o in enumerate(outs_r) if o is not None)
                  for outs_r in outs)
    return s, tuple(tuple((_OPS[a.kind], a.stage) for a in acts) for acts in s.actions), needs, sends


def _messages(s):
    """Per rank and action: the message it receives from another rank (its key: kind, receiving stage, mb), the
    one it sends (receiver, key), and the (rank, index) of the action that produced what it receives; the rules
    of `parlab.parallel.pipeline.plan.needs_remote` and `produces_remote`, inlined (one pass over the actions)."""
    S, pl = s.stages, s.placement
    where = {(a.stage, a.kind, a.mb): (r, i) for r, acts in enumerate(s.actions) for i, a in enumerate(acts)}
    keys, outs, src = [], [], []
    for r, acts in enumerate(s.actions):
        keys_r, outs_r, src_r = [], [], []
        for a in acts:
            kind, st, mb = a.kind, a.stage, a.mb
            got = out = made = None
            if kind == "F":
                if st > 0 and pl[st - 1] != r:
                    got, made = ("act", st, mb), where[(st - 1, "F", mb)]
                if st < S - 1 and pl[st + 1] != r:
                    out = (pl[st + 1], ("act", st + 1, mb))
            elif kind in "BI":
                if st < S - 1 and pl[st + 1] != r:
                    got, made = ("grad", st, mb), where.get((st + 1, "B", mb)) or where[(st + 1, "I", mb)]
                if st > 0 and pl[st - 1] != r:
                    out = (pl[st - 1], ("grad", st - 1, mb))
            keys_r.append(got)
            outs_r.append(out)
            src_r.append(made)
        keys.append(keys_r)
        outs.append(outs_r)
        src.append(src_r)
    return keys, outs, src


def _posting(s, keys, outs, src) -> list[dict[tuple, int]]:
    """Per rank, after which of its own actions (-1: before the first) each receive is posted: the merged order
    of `simulation.message_sequence` (each message by the time it is produced at unit costs, ties by sender rank,
    then receiver, kind, stage, micro-batch) walked as `pipeline_program.pipeline_trace` walks it."""
    unit = {k: c / s.chunks for k, c in UNIT_COSTS.items()}
    unit = [[unit[a.kind] for a in acts] for acts in s.actions]
    fin = _run([[None if q is None else (*q, -1) for q in src_r] for src_r in src], unit, 0.0)[1]
    plans: list[list[tuple[str, tuple]]] = [[] for _ in s.actions]
    for _, r, dst, key in sorted((fin[r][i], r, o[0], o[1]) for r, outs_r in enumerate(outs)
                                 for i, o in enumerate(outs_r) if o is not None):
        plans[r].append(("send", key))
        plans[dst].append(("recv", key))
    posted: list[dict[tuple, int]] = [{} for _ in s.actions]
    for r, plan in enumerate(plans):
        k = 0
        for i, (got, out) in enumerate(zip(keys[r], outs[r])):
            while got is not None and got not in posted[r]:   # every receive up to it, just before the action
                posted[r][plan[k][1]] = i - 1
                k += 1
            if out is not None:                  # after the action: the receives before its send, then the send
                while plan[k][0] == "recv":
                    posted[r][plan[k][1]] = i
                    k += 1
                k += 1
    return posted


def _run(needs, dur, x: float):
    """Every rank's actions timed by the replay's rules (module docstring), durations `dur`, message time `x`:
    (when each rank's last action ends, per rank its actions' ends)."""
    P = len(dur)
    fin: list[list[float | None]] = [[None] * len(d) for d in dur]
    pos, free = [0] * P, [0.0] * P
    while any(pos[r] < len(dur[r]) for r in range(P)):
        progress = False
        for r in range(P):
            need_r, dur_r, fin_r, i = needs[r], dur[r], fin[r], pos[r]
            while i < len(dur_r):
                start = free[r]
                if need_r[i] is not None:
                    q, k, j = need_r[i]
                    t = fin[q][k]
                    if t is None:
                        break
                    if j >= 0 and fin_r[j] > t:       # the rank's own earlier action ends later
                        t = fin_r[j]
                    if t + x > start:                 # start = max(start, max(t, fin_r[j]) + x)
                        start = t + x
                free[r] = fin_r[i] = start + dur_r[i]
                i += 1
                progress = True
            pos[r] = i
        if not progress:                              # a valid schedule never gets here (`simulation.validate`)
            raise ValueError("the pipeline schedule waits forever")
    return free, fin


def _ends(needs, sends, dur, x: float) -> tuple[list[float], list[float]]:
    """Per rank, when its last action ends, and when the last of its sends has arrived."""
    free, fin = _run(needs, dur, x)
    arrived = [0.0] * len(dur)          # max over the sends of max(fin[r][i], fin[q][j]) + x, written out
    for r, sends_r in enumerate(sends):
        fin_r, last = fin[r], 0.0
        for i, q, j in sends_r:
            t = fin_r[i]
            if j >= 0 and fin[q][j] > t:
                t = fin[q][j]
            if t > last:
                last = t
        arrived[r] = last + x if sends_r else 0.0
    return free, arrived


def simulated_step(costs, m: int, schedule: str = "1f1b") -> float:
    """Seconds of one step of `schedule` ("1f1b", interleaved with the layout's virtual > 1; "gpipe"; "zb-h1")
    over m micro-batches, with the action and message times of `costs` (a `StepCosts`), as the replay of the
    program built from that schedule times it (module docstring)."""
    pp, v = costs.layout.pp, costs.layout.virtual
    s, ops, needs, sends = _shape(schedule, pp, m, v)
    once = {key: costs.action(*key) for key in {key for ops_r in ops for key in ops_r}}   # the same for every mb
    dur = [[once[key] for key in ops_r] for ops_r in ops]
    hw = costs.hw                                      # a message ends its link's delay later (Hardware.p2p_delay)
    delay = hw.comm_delay if hw.p2p_delay is None else hw.p2p_delay
    ends, sent = _ends(needs, sends, dur, costs.message() + delay)
    S, pl = s.stages, s.placement
    if costs.model.tied and pl[0] != pl[S - 1]:       # the tied embedding's gradient, one way and back
        ends[pl[0]] = ends[pl[S - 1]] = max(ends[pl[0]], ends[pl[S - 1]]) + 2 * (costs.message(tied=True) + delay)
    last = "backward_weight" if schedule == "zb-h1" else "backward"
    held = [[st for st in range(S) if pl[st] == r] for r in range(s.ranks)]
    return max(max(ends[r] + costs.exposed_grad_sync(held[r], last) + costs.sync.optimizer(held[r]), sent[r])
               for r in range(s.ranks))
