"""Traces: what every rank communicated and computed, and when.

This module is pure data (no torch.distributed): `parlab.comm` records one
`Event` per collective or point-to-point call, `region("forward")` records a
compute span, and `parlab.run` brings every rank's events home and merges them
into one `Trace`. Lessons draw their figures from a `Trace`, so every picture
shows what the code really did.

For replaying a run on other hardware (`parlab.cluster.replay`), compute events may carry their work (`flops`,
`nbytes`, `kernels`: given to `region`, or metered by `count_costs()`) and asynchronous calls the time the
program first waited for them (`waited`).

Recording is switched on per process with the `recording()` context manager
(parlab.run does it for you when ``trace=True``). When nothing records, the
cost of a traced call is one list lookup.

Clocks. On the CPU a call's host time is its execution time. On a GPU it is
not (NCCL and kernel launches return at once), so a recording on the
``"cuda-events"`` clock (the default when this process uses CUDA) times every
traced call and region with CUDA events (`parlab.trace.clock`). ``Event.clock`` says how each event was timed and
`Trace.clock` which clock a trace holds ("wall" or "cuda-events").

Bytes. An event stores the *payload* size ``nbytes`` of the call (for all-reduce the tensor, for all-gather the
gathered output, for reduce-scatter the full input, for send/recv the message); what a rank puts on the wire
under the standard ring/pipeline algorithms is `parlab.trace.wire.wire_bytes` (the table is in that module).
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator

from parlab.i18n import _
from parlab.i18n.columns import pad
from parlab.trace.clock import CLOCKS, DeviceClock, DeviceSpan, default_clock
from parlab.trace.histogram import hist_sub
from parlab.trace.wire import _chain_position, _recv_bytes, format_bytes, wire_bytes

__all__ = ["Event", "Recorder", "Trace", "recording", "current_recorder", "region", "mark", "wire_bytes", "now",
           "count_costs", "format_bytes", "CLOCKS"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
               "gather", "scatter", "barrier")
P2P = ("send", "recv")


def now() -> float:
    """The trace clock: wall-clock seconds, comparable across processes (and across NTP-synced nodes)."""
    return time.time()


@dataclass
class Event:
    """One traced call on one rank. Times are seconds on the `now()` clock."""
    rank: int
    kind: str                   # "collective" | "p2p" | "compute" | "mark"
    op: str                     # e.g. "all_reduce", "send", or the region name for compute
    start: float
    end: float
    clock: str = "wall"         # how start/end were measured: "wall" (host) or "cuda-events" (GPU, see above)
    group: tuple[int, ...] = ()  # global ranks of the process group (empty for compute)
    peer: int | None = None     # global rank of the other side (p2p) or the root (broadcast/reduce/...)
    numel: int = 0
    nbytes: int = 0             # payload bytes, see module docstring
    dtype: str = ""
    label: str = ""             # free text, e.g. "grad bucket 2" or "stage 1 -> 2 act mb 3"
    asynchronous: bool = False  # launched with async_op=True (end = completion time)
    # What a replay on other hardware needs (parlab.cluster.replay): the work of a compute span (FLOPs of its
    # matrix products; its nbytes are then the bytes its memory-bound ops moved; kernels = ops it ran),
    # and for an asynchronous call the time the program first waited for it (None: never waited).
    flops: float = 0.0
    kernels: int = 0
    waited: float | None = None
    # Metered runs (count_costs) only: a compute span's memory-bound bytes per working-set size class,
    # ((k, bytes), ...) for working sets in [2^k, 2^(k+1)); and on every event the meter's running totals when
    # it was recorded, (flops, bytes, kernels, size histogram, batched flops, special elements, plain kernels),
    # so a replay can split a span by the work done (a trace recorded before special elements or plain kernels
    # were counted has 5 or 6 of them).
    mem_hist: tuple = ()
    batched_flops: float = 0.0  # the part of flops done by batched products (bmm, attention), metered runs only
    special: float = 0.0        # elements computed by special functions (exp, log, erf, ...), metered runs only
    meter_at: tuple = ()
    plain_kernels: int = 0      # of the kernels, those run outside autograd (optimizer, no_grad), metered runs only
    meter_waited: tuple = ()    # an asynchronous call: the meter's running totals when it was first waited for
    splits: tuple = ()          # all_to_all: bytes this rank sent to each rank of the group, in group order

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def group_size(self) -> int:
        return len(self.group)

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends under the standard algorithm (see module docstring); an all-to-all with its
        per-rank bytes recorded (uneven splits): all but the block for itself."""
        if self.op == "all_to_all" and self.splits and self.rank in self.group:
            return float(sum(self.splits) - self.splits[self.group.index(self.rank)])
        return wire_bytes(self.op, self.nbytes, len(self.group), is_root=self.peer == self.rank,
                          position=_chain_position(self))


class Recorder:
    """Collects the events of one rank. Use through `recording()`."""

    def __init__(self, rank: int = 0, clock: str = "wall"):
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS} (or 'auto' in recording()), got {clock!r}")
        self.rank = rank
        self.events: list[Event] = []
        self.meter = None          # a cost meter while `count_costs()` is active
        self._stamp = (0.0, 0, 0, (), 0.0, 0, 0)  # the meter's state (CostMeter.state) when the last event was added
        self.clock = clock
        self.device = DeviceClock() if clock == "cuda-events" else None   # CUDA events to retime at the end

    def add(self, event: Event) -> Event:
        if self.meter is not None:   # a compute span added by hand gets the work metered since the last event
            state = self.meter.state()
            if event.kind == "compute" and not (event.flops or event.nbytes or event.kernels):
                event.flops, event.nbytes, event.kernels = (a - b for a, b in zip(state[:3], self._stamp[:3]))
                event.mem_hist = hist_sub(state[3], self._stamp[3])
                event.batched_flops = state[4] - self._stamp[4]
                event.special = state[5] - self._stamp[5]
                event.plain_kernels = state[6] - self._stamp[6]
            event.meter_at = state
            self._stamp = state
        self.events.append(event)
        return event

    # ---------------------------------------------------------------- the cuda-events clock (parlab.trace.clock)
    def device_mark(self):
        """A timing CUDA event recorded now on the current stream (None on the wall clock)."""
        return self.device.mark() if self.device is not None else None

    def device_span(self, event: Event, start_mark, end: bool = True) -> "DeviceSpan | None":
        """Retime `event` from `start_mark` to a CUDA event recorded now (`end`) or later (`DeviceSpan.close`)
        when the recording ends. Nothing on the wall clock (`start_mark` None)."""
        if start_mark is None or self.device is None:
            return None
        return self.device.span(event, start_mark, end)

    def finish(self) -> None:
        """Convert the CUDA-event spans to wall seconds; called when recording ends."""
        if self.device is not None:
            self.device.finish()


# The active recorders of this process, innermost last. A process-wide stack rather than a context
# variable on purpose: autograd may run backward on its own worker threads (on GPUs it does), and
# the communication issued there must land in the same trace as the forward's.
_ACTIVE: list[Recorder] = []


def current_recorder() -> Recorder | None:
    """The innermost active recorder of this process, or None when tracing is off."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def recording(rank: int | None = None, clock: str = "auto") -> Iterator[Recorder]:
    """Record every traced call made inside the block: ``with recording() as rec: ...; rec.events``.
    `clock`: "wall", "cuda-events", or "auto" (cuda-events when this process uses CUDA; module docstring)."""
    if rank is None:
        try:
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        except ImportError:  # pragma: no cover - torch is a dependency
            rank = 0
    rec = Recorder(rank, default_clock() if clock == "auto" else clock)
    if rec.device is not None:
        rec.device.start()
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.remove(rec)
        rec.finish()


@contextlib.contextmanager
def region(name: str, label: str = "", flops: float | None = None, nbytes: int | None = None) -> Iterator[None]:
    """Record the block as a compute span named `name` (a no-op when tracing is off).

    `flops` / `nbytes` state the block's work for a replay (`parlab.cluster.replay`); left out, they are what
    `count_costs()` metered inside the block (0 when nothing meters).

    On the "cuda-events" clock the span runs from a CUDA event recorded on the *current stream* when the
    block starts to one recorded there when it ends: it times the current stream only. Work the block puts
    on other streams (a side stream of its own, NCCL's communication stream for an async call nobody has
    waited on yet) is inside the span only if the current stream waits for it (``work.wait()``,
    ``stream.wait_stream``) before the block ends; otherwise that work runs outside the span."""
    rec = current_recorder()
    if rec is None:
        yield
        return
    start, device_start = now(), rec.device_mark()
    before = rec.meter.state() if rec.meter is not None else None
    try:
        yield
    finally:
        ev = Event(rank=rec.rank, kind="compute", op=name, start=start, end=now(), label=label)
        if before is not None and rec.meter is not None:
            after = rec.meter.state()
            ev.flops, ev.nbytes, ev.kernels = (a - b for a, b in zip(after[:3], before[:3]))
            ev.mem_hist = hist_sub(after[3], before[3])
            ev.batched_flops = after[4] - before[4]
            ev.special = after[5] - before[5]
            ev.plain_kernels = after[6] - before[6]
        if flops is not None:
            ev.flops, ev.batched_flops = float(flops), 0.0
        if nbytes is not None:
            ev.nbytes, ev.mem_hist, ev.special = int(nbytes), (), 0.0
        rec.add(ev)
        rec.device_span(ev, device_start)


@contextlib.contextmanager
def count_costs() -> Iterator[None]:
    """Meter the work of every torch op run inside the block, for the compute spans of the active recorder:
    FLOPs of matrix products and attention (the formulas of ``torch.utils.flop_counter``), bytes read and
    written by every other op (memory-bound: elementwise, norms, softmax), the special-function results
    (exp, log, erf: softmax, GeLU; `parlab.trace.meter.SPECIAL_OPS`) and the number of ops (kernels).
    Views and communication ops count nothing. A no-op when tracing is off. Costs a few microseconds per op,
    so time a run without it and replay a run with it (``parlab.cluster.replay``)."""
    rec = current_recorder()
    if rec is None:
        yield
        return
    from parlab.trace.meter import CostMeter   # torch only when metering
    meter, previous = CostMeter(), rec.meter
    rec.meter, rec._stamp = meter, meter.state()
    try:
        with meter:
            yield
    finally:
        rec.meter = previous


def mark(name: str, label: str = "") -> None:
    """Record an instant (zero-length) event, e.g. "optimizer step done"."""
    rec = current_recorder()
    if rec is not None:
        t = now()
        rec.add(Event(rank=rec.rank, kind="mark", op=name, start=t, end=t, label=label))


@dataclass
class Trace:
    """The merged events of all ranks of one run, sorted by start time."""
    events: list[Event] = field(default_factory=list)
    hardware: str = ""   # set by parlab.cluster.replay: the hardware the times were replayed on ("" = measured here)

    def __post_init__(self):
        self.events = sorted(self.events, key=lambda e: (e.start, e.rank))

    # ------------------------------------------------------------------ access
    @classmethod
    def merge(cls, per_rank: Iterable[Iterable[Event]]) -> "Trace":
        return cls([e for evs in per_rank for e in evs])

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    @property
    def clock(self) -> str:
        """"cuda-events" when calls and regions were timed on the GPU (converted to wall seconds), else "wall"."""
        return "cuda-events" if any(e.clock == "cuda-events" for e in self.events) else "wall"

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    @property
    def t0(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    def filter(self, rank: int | None = None, op: str | Iterable[str] | None = None, kind: str | None = None,
               label: str | None = None) -> "Trace":
        """A sub-trace; `label` matches as a substring, `op` may be one name or several."""
        ops = {op} if isinstance(op, str) else (set(op) if op is not None else None)
        return Trace([e for e in self.events
                      if (rank is None or e.rank == rank) and (ops is None or e.op in ops)
                      and (kind is None or e.kind == kind) and (label is None or label in e.label)], self.hardware)

    def comm(self) -> "Trace":
        """Only the communication events (collectives and p2p)."""
        return Trace([e for e in self.events if e.kind in ("collective", "p2p")], self.hardware)

    # ------------------------------------------------------------------ tables
    def table(self) -> list[dict]:
        """One row per (rank, op): calls, payload bytes, bytes sent and received on the wire."""
        rows: dict[tuple[int, str], dict] = {}
        for e in self.events:
            if e.kind not in ("collective", "p2p"):
                continue
            r = rows.setdefault((e.rank, e.op), {"rank": e.rank, "op": e.op, "calls": 0, "payload_bytes": 0,
                                                 "sent_bytes": 0.0, "recv_bytes": 0.0, "seconds": 0.0})
            r["calls"] += 1
            r["payload_bytes"] += e.nbytes
            r["sent_bytes"] += e.wire_bytes
            r["recv_bytes"] += _recv_bytes(e)
            r["seconds"] += e.duration
        return [rows[k] for k in sorted(rows)]

    def bytes_per_rank(self, op: str | None = None, direction: str = "sent") -> dict[int, float]:
        """Wire bytes each rank sent (or received) over the whole trace, optionally for one op."""
        out = {r: 0.0 for r in self.ranks}
        for row in self.table():
            if op is None or row["op"] == op:
                out[row["rank"]] += row[f"{direction}_bytes"]
        return out

    def count(self, op: str | None = None, rank: int | None = None, label: str | None = None) -> int:
        return len(self.filter(rank=rank, op=op, label=label).comm().events)

    def summary(self) -> str:
        """A readable text table of `table()`, its header in the language in force (padded by display width)."""
        words = [pad(w, n, ">") for w, n in ((_("calls"), 5), (_("payload"), 12), (_("sent"), 12), (_("recv"), 12))]
        lines = [f"{'rank':>4} {'op':<15} " + " ".join(words)]
        for r in self.table():
            lines.append(f"{r['rank']:>4} {r['op']:<15} {r['calls']:>5} {_fmt(r['payload_bytes']):>12} "
                         f"{_fmt(r['sent_bytes']):>12} {_fmt(r['recv_bytes']):>12}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ export
    def records(self, relative: bool = True) -> list[dict]:
        """Plain dicts (times in seconds from the first event when `relative`), for plotting or pandas."""
        t0 = self.t0 if relative else 0.0
        out = []
        for e in self.events:
            d = asdict(e)
            d["start"] -= t0
            d["end"] -= t0
            if d.get("waited") is not None:
                d["waited"] -= t0
            d["group"] = list(e.group)
            d["wire_bytes"] = e.wire_bytes
            out.append(d)
        return out

    def to_chrome(self, path: str | None = None) -> dict:
        """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one complete event per call,
        one thread per rank, times in microseconds. Written to `path` when given."""
        t0 = self.t0
        evs = []
        if self.hardware:
            evs.append({"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"replayed on {self.hardware}"}})
        for r in self.ranks:
            evs.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        for e in self.events:
            args = {"op": e.op, "bytes": e.nbytes, "wire_bytes": e.wire_bytes, "dtype": e.dtype,
                    "group": list(e.group), "label": e.label}
            if e.peer is not None:
                args["peer"] = e.peer
            if e.flops:
                args["flops"] = e.flops
            evs.append({"name": e.label or e.op, "cat": e.kind, "ph": "X", "pid": 0, "tid": e.rank,
                        "ts": (e.start - t0) * 1e6, "dur": max(e.duration, 0.0) * 1e6, "args": args})
        doc = {"traceEvents": evs, "displayTimeUnit": "ms", "otherData": {"clock": self.clock}}
        if path is not None:
            with open(path, "w") as f:
                json.dump(doc, f)
        return doc


_fmt = format_bytes
