"""Replay: re-time a trace of what parlab really ran on a model of other hardware (a virtual cluster).

`replay(trace, hardware)` keeps the program every rank ran (its order of compute spans, collectives,
messages and waits, from `parlab.cluster.program.build_programs`) and gives every step a new duration:

* compute spans from their work (`Event.flops`, `nbytes`, `kernels`, `mem_hist`, `special`, metered by
  `parlab.trace.count_costs`) on the hardware's roofline (`Hardware.compute_time`: products at the kernel-level
  efficiency, memory-bound bytes at the cache's or memory's bandwidth by working set, special functions at
  their own rate);
* collectives and messages from the alpha-beta model of their algorithm (`Hardware.collective_time`: ring,
  or tree for an all-reduce across nodes where that is faster), on the slowest link the group crosses. Which
  groups cross nodes follows from the placement: rank r sits on node ``r // gpus_per_node`` (torchrun's and
  `parlab.parallel.topology.ParallelGrid`'s rule; pass a grid to use its `node_of`, or `nodes`, the node of each rank).

A discrete-event loop then runs every rank's program against the others, with the dependencies of the real run:

    compute            starts when the rank is free, runs for its cost
    collective         starts when every member has called it and the group's earlier calls are done (one
                       communication stream per rank and group, as torch's ProcessGroupNCCL has; gloo's pool of
                       threads runs `Hardware.comm_streams` at once); a blocking call holds its rank until it
                       ends, an asynchronous one does not
    send / recv        a message moves once both sides have posted it (rendezvous); blocking sides wait for it
    wait               holds the rank until that asynchronous call has finished
                       (so compute issued after the wait waits for it; compute before it overlaps); a wait for
                       a send whose receiver has not posted yet does not hold it (the send is buffered), so a
                       program that polled its sends for completion cannot deadlock in the replay

On hardware whose communication does not overlap compute (`Hardware.comm_overlap` False: gloo on a CPU with a
rank per core) an asynchronous call also holds its rank for its cost when it is issued. A calibrated CPU's
`Hardware.comm_delay` makes every transfer end that much later without holding a rank (the backend's threads
waiting for a core inside a step): a blocking call pays it, compute issued after an asynchronous call hides it;
with `Hardware.comm_cpu` an asynchronous call also takes that much of its rank's core. A message (send / recv)
is delayed by `Hardware.p2p_delay` and takes `Hardware.p2p_cpu` of its rank instead, when the description has
them (calibrated from pipeline and ring-attention steps apart from DDP's and FSDP's collectives: gloo runs a
collective on its own worker threads, a message on its transport thread).

The result is an ordinary `parlab.Trace` (times from 0, in seconds; `trace.hardware` names the hardware), so
`parlab.viz.timeline`, the animations and `Trace.to_chrome` draw it unchanged. Every rank starts at 0; time a
rank spent outside any traced event (Python between calls) is not replayed.

Anchors: ASTRA-sim (Chakra traces on network models), vTrain, Echo, Proteus, SimAI re-time a program's
operator graph the same way; none of them runs the program it models, and none is built for teaching.
Pure Python: no torch.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from typing import Callable

from parlab.cluster.hardware import Hardware
from parlab.cluster.program import Step, build_programs
from parlab.parallel.topology import ParallelGrid
from parlab.trace import Event, Trace

__all__ = ["replay", "ReplayError", "step_time", "measured_step", "bubble", "Placement", "timed"]


class ReplayError(ValueError):
    """A trace that cannot be replayed: unmatched calls, or a program that would wait forever."""


class Placement:
    """Which node each rank sits on: ``rank // gpus_per_node``, a `ParallelGrid`'s `node_of`, or an explicit list
    `nodes` (``nodes[r]`` is the node of rank r), e.g. to place the ranks of a run as another rank order would."""

    def __init__(self, hardware: Hardware, grid: ParallelGrid | None = None, gpus_per_node: int | None = None,
                 nodes=None):
        if grid is not None and not isinstance(grid, ParallelGrid):
            raise ValueError(f"grid must be a parlab.parallel.topology.ParallelGrid, got {type(grid).__name__}")
        gpn = gpus_per_node if gpus_per_node is not None else hardware.gpus_per_node
        if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
            raise ValueError(f"gpus_per_node must be a positive integer, got {gpn!r}")
        self.grid, self.gpus_per_node, self.node_map = grid, gpn, None
        if nodes is not None:
            if grid is not None or gpus_per_node is not None:
                raise ValueError("give either nodes= (the node of each rank) or grid= / gpus_per_node=, not both")
            try:
                node_map = [] if isinstance(nodes, (str, bytes)) else list(nodes)
            except TypeError:                                        # not a sequence at all
                node_map = []
            if not node_map or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in node_map):
                raise ValueError(f"nodes must list a node number (an integer >= 0) for each rank, e.g. [0, 1, 0, 1]; "
                                 f"got {nodes!r}")
            self.node_map = node_map

    def node_of(self, rank: int) -> int:
        if self.node_map is not None:
            if rank >= len(self.node_map):
                raise ReplayError(f"the trace has rank {rank} but nodes= places only {len(self.node_map)} ranks; "
                                  f"give the node of every rank of the run")
            return self.node_map[rank]
        if self.grid is not None:
            if rank >= self.grid.world_size:
                raise ReplayError(f"the trace has rank {rank} but the grid has {self.grid.world_size} ranks; pass "
                                  f"the ParallelGrid of the run that was traced")
            return self.grid.node_of(rank)
        return rank // self.gpus_per_node

    def nodes(self, ranks) -> int:
        return len({self.node_of(r) for r in ranks})


def default_costs(hardware: Hardware, placement: Placement, compute_scale: float | None, metered: bool = False):
    """The two cost callbacks `replay` uses unless given its own (seconds per event). In a `metered` trace (some
    compute span carries work) a span without work costs nothing; otherwise its measured duration is scaled."""

    def compute(e: Event) -> float:
        if e.flops or e.nbytes or e.kernels or (metered and compute_scale is None):
            return hardware.compute_time(e.flops, e.nbytes, e.kernels, e.mem_hist, e.batched_flops, e.special,
                                         e.plain_kernels)
        if compute_scale is not None:
            return e.duration * compute_scale
        raise ReplayError(f"compute span {e.op!r} ({e.label or 'no label'}) of rank {e.rank} carries no work "
                          f"(flops, bytes, kernels): record the run inside parlab.trace.count_costs(), give the "
                          f"region flops=..., or pass compute_scale= to replay measured durations scaled")

    def comm(e: Event) -> float:
        if e.kind == "p2p":
            return hardware.collective_time(e.op, e.nbytes, 2, placement.node_of(e.rank) != placement.node_of(e.peer))
        group = tuple(e.group) or (e.rank,)
        nodes = placement.nodes(group)
        return hardware.collective_time(e.op, e.nbytes, len(group), nodes > 1, nodes)

    return compute, comm


def replay(trace: Trace, hardware: Hardware, *, grid: ParallelGrid | None = None, gpus_per_node: int | None = None,
           nodes=None, compute_scale: float | None = None, compute_time: Callable[[Event], float] | None = None,
           comm_time: Callable[[Event], float] | None = None, untraced: bool = True) -> Trace:
    """The trace re-timed on `hardware` (see the module docstring). Returns a new `Trace`.

    grid / gpus_per_node   placement of the ranks on nodes (default: the hardware's GPUs per node)
    nodes                  or an explicit placement: ``nodes[r]`` is the node of rank r (e.g. [0, 1, 0, 1])
    compute_scale          for compute spans without metered work: measured duration x this factor
    compute_time, comm_time  replace the cost models: functions of an `Event`, returning seconds
                           (`parlab.cluster.scaleup` re-costs spans with a big model's shapes this way)
    untraced               in a metered trace, also replay the work the meter counted outside every compute
                           span, as compute steps of op "untraced" (`parlab.cluster.program`)"""
    if not isinstance(trace, Trace):
        raise ReplayError(f"replay needs a parlab.Trace (e.g. parlab.run(..., trace=True).trace), "
                          f"got {type(trace).__name__}")
    if not isinstance(hardware, Hardware):
        raise ReplayError(f"replay needs a parlab.cluster.hardware.Hardware (e.g. "
                          f"parlab.cluster.hardware.hardware_preset('dgx-h100')), got {type(hardware).__name__}")
    if not trace.events:
        raise ReplayError("the trace is empty: run with parlab.run(fn, n, trace=True) and call parlab.comm / "
                          "parlab.trace.region inside fn")
    placement = Placement(hardware, grid, gpus_per_node, nodes)
    metered = any(e.kind == "compute" and (e.flops or e.nbytes or e.kernels) for e in trace.events)
    compute, comm = default_costs(hardware, placement, compute_scale, metered)
    try:
        programs = build_programs(trace, compute_time or compute, comm_time or comm, untraced)
    except ReplayError:
        raise
    except ValueError as err:
        raise ReplayError(str(err)) from None
    events = _run(programs, serial=not hardware.comm_overlap, delay=hardware.comm_delay,
                  streams=hardware.comm_streams, cpu=hardware.comm_cpu, p2p_delay=hardware.p2p_delay,
                  p2p_cpu=hardware.p2p_cpu)
    return Trace(events, hardware.name)


def _run(programs: dict[int, list[Step]], serial: bool = False, delay: float = 0.0, streams: int = 1,
         cpu: float = 0.0, p2p_delay: float | None = None, p2p_cpu: float | None = None) -> list[Event]:
    """The discrete-event loop: advance every rank as far as its dependencies allow, until all are done.
    `serial` (`Hardware.comm_overlap` False): an asynchronous call also occupies its rank for its cost when issued
    (calls issued at the same moment, e.g. a ring step's send and receive, overlap each other: calibration times
    them as one pair). `delay` (`Hardware.comm_delay`): every transfer between two or more ranks ends that much
    later than its cost says, without occupying a rank (a rank that waits for it waits longer; the group's next
    collective queues behind it, as the backend runs a group's calls in order). `streams`
    (`Hardware.comm_streams`): each rank runs that many of a group's collectives at once; a collective starts when
    every member has a stream free (the one free earliest) and takes it until it ends. `cpu`
    (`Hardware.comm_cpu`, with `serial`): an asynchronous call (collective or message) also occupies its
    rank that much longer. `p2p_delay`, `p2p_cpu` (`Hardware.p2p_delay`, `p2p_cpu`): a message's delay and share
    instead (None: `delay`, `cpu`)."""
    msg_delay = delay if p2p_delay is None else p2p_delay
    msg_cpu = cpu if p2p_cpu is None else p2p_cpu
    ranks = sorted(programs)
    pos = {r: 0 for r in ranks}
    clock = {r: 0.0 for r in ranks}
    arrivals: dict[tuple, dict[int, float]] = defaultdict(dict)   # collective key -> rank -> call time
    posts: dict[tuple, dict[str, float]] = defaultdict(dict)      # message key -> side -> post time
    done: dict[tuple, tuple[float, float]] = {}                    # key -> (start, end) of the transfer
    stream: dict[tuple, list[float]] = {}                          # (rank, group) -> when each of its streams is free
    issued: dict[tuple[int, tuple], Step] = {}                     # (rank, key) -> the async call's step
    out: list[tuple[Step, float, float]] = []

    def resolve_coll(step: Step) -> None:
        key, members = step.key, step.members
        got = arrivals[key]
        if key in done or not set(members) <= set(got):
            return
        free = [stream.setdefault((m, members), [0.0] * streams) for m in members]
        start = max([*got.values(), *(min(f) for f in free)])
        end = start + step.cost + (delay if len(members) > 1 else 0.0)
        for f in free:                                              # each member's earliest free stream
            f[f.index(min(f))] = end
        done[key] = (start, end)

    def resolve_msg(step: Step) -> None:
        key, got = step.key, posts[step.key]
        if key in done or len(got) < 2:
            return
        start = max(got.values())
        done[key] = (start, start + step.cost + msg_delay)

    burst: dict[int, float] = {}                                   # serial: when the rank's run of async calls began

    def advance(r: int) -> bool:
        moved = False
        prog = programs[r]
        while pos[r] < len(prog):
            st = prog[pos[r]]
            t = clock[r]
            burst_at = burst.pop(r, None)
            if burst_at is not None and st.asynchronous and st.kind in ("coll", "send", "recv"):
                t = burst[r] = burst_at                             # issued with the calls just before it
            if st.kind == "compute":
                out.append((st, t, t + st.cost))
                clock[r] = t + st.cost
            elif st.kind == "mark":
                out.append((st, t, t))
            elif st.kind in ("coll", "send", "recv"):
                if st.kind == "coll":
                    arrivals[st.key].setdefault(r, t)
                    resolve_coll(st)
                else:
                    posts[st.key].setdefault(st.kind, t)
                    resolve_msg(st)
                if st.asynchronous:
                    issued[(r, st.key)] = st
                    st.extra["issue"] = t
                    out.append((st, t, None))                      # end filled in when known
                    if serial:          # the rank's core moves the bytes; calls issued together share it
                        burst.setdefault(r, t)
                        share = (msg_cpu if st.kind != "coll" else cpu if len(st.members) > 1
                                 else 0.0)                         # not a 1-rank group
                        clock[r] = max(clock[r], burst[r] + st.cost + share)
                        pos[r] += 1
                        moved = True
                        continue
                elif st.key in done:
                    start_at = arrivals[st.key][r] if st.kind == "coll" else posts[st.key][st.kind]
                    out.append((st, start_at, done[st.key][1]))
                    clock[r] = max(t, done[st.key][1])
                else:
                    return moved                                    # blocked until the others arrive
            elif st.kind == "wait":
                if st.key not in done:
                    if st.event.op == "send" and "recv" not in posts[st.key]:
                        pos[r] += 1                # a buffered send: its receiver has not posted yet, go on
                        moved = True
                        continue
                    return moved
                clock[r] = max(t, done[st.key][1])
                if (r, st.key) in issued:
                    issued[(r, st.key)].extra["waited"] = clock[r]
            pos[r] += 1
            moved = True
        return moved

    while any(pos[r] < len(programs[r]) for r in ranks):
        progress = False
        for r in ranks:
            progress |= advance(r)
        if not progress:
            raise ReplayError("the replayed program waits forever: " + "; ".join(
                f"rank {r} at {_describe(programs[r][pos[r]])}" for r in ranks if pos[r] < len(programs[r])))
    events = []
    for st, start, end in out:
        e = st.event
        if end is None:                                             # an async call: ends when its transfer does
            if st.key not in done:
                raise ReplayError(f"rank {e.rank}: {_describe(st)} never completed (its partner never called it)")
            end = max(start, done[st.key][1])
        events.append(dataclasses.replace(e, start=start, end=end, group=tuple(e.group),
                                          waited=st.extra.get("waited") if e.asynchronous else None))
    return events


def _describe(st: Step) -> str:
    e = st.event
    what = f"{e.op}" + (f" ({e.label})" if e.label else "")
    if st.kind == "coll":
        return f"collective {what} on group {list(st.members)}, waiting for its other members"
    if st.kind in ("send", "recv"):
        other = st.key[2] if st.kind == "send" else st.key[1]
        return f"{st.kind} {what} with rank {other}, waiting for the matching {'recv' if st.kind == 'send' else 'send'}"
    if st.kind == "wait":
        return f"wait for {what}, which has not completed"
    return what


# ---------------------------------------------------------------------- measures of a (replayed) trace
def step_time(trace: Trace, kind: str | None = None) -> float:
    """Seconds from the first event's start to the last event's end (optionally of one kind)."""
    evs = [e for e in trace.events if kind is None or e.kind == kind]
    if not evs:
        raise ValueError("no events to measure" + (f" of kind {kind!r}" if kind else ""))
    return max(e.end for e in evs) - min(e.start for e in evs)


def measured_step(trace: Trace) -> float:
    """Seconds from the moment the last rank began (its first event's start) to the last event's end: a measured
    step to compare with a replayed one. Timed steps are separated by barriers, and a barrier releases its ranks up
    to a few milliseconds apart on a CPU (the rank that arrives last leaves first; the others must be woken: 1-2 ms
    in the ring-attention steps of benchmarks/README.md). A training loop without barriers does not pay that, and a
    replay, where every rank starts at 0, cannot know it. On a replayed trace it equals `step_time`."""
    if not trace.events:
        raise ValueError("no events to measure")
    first: dict[int, float] = {}
    for e in trace.events:
        first[e.rank] = min(first.get(e.rank, e.start), e.start)
    return max(e.end for e in trace.events) - max(first.values())


def bubble(trace: Trace) -> float:
    """Idle fraction of the compute window over all ranks: 1 - busy / (ranks x (last compute end - first
    compute start)); for a pipeline run, its bubble fraction (`parlab.parallel.pipeline.Simulation.bubble_fraction`)."""
    comp = [e for e in trace.events if e.kind == "compute"]
    if not comp:
        raise ValueError("the trace has no compute spans, so it has no bubble")
    span = max(e.end for e in comp) - min(e.start for e in comp)
    ranks = {e.rank for e in comp}
    busy = sum(e.duration for e in comp)
    return 1 - busy / (len(ranks) * span) if span > 0 else 0.0


def timed(fn, *args, **kwargs):
    """(result, seconds) of one call: for reporting how long a replay takes."""
    t = time.perf_counter()
    res = fn(*args, **kwargs)
    return res, time.perf_counter() - t
