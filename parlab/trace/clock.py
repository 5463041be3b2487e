"""The "cuda-events" trace clock: timing traced calls by the GPU's own clock.

On the CPU a call's host time is its execution time. On a GPU it is not: NCCL completes a work's future at
enqueue, ``wait()`` only orders streams, and a kernel launch returns at once, so host timestamps would show
launches, not execution. A recorder on the ``"cuda-events"`` clock brackets every traced call and region with a
pair of ``torch.cuda.Event`` records on the current stream; when the recording ends it synchronises once and
converts them to wall seconds through an anchor event recorded (and waited for) when the clock started:

    start_wall(ev) = t0 + anchor.elapsed_time(start_mark) / 1e3        # elapsed_time is in milliseconds

Only the current stream is timed: both events of a span are recorded on ``torch.cuda.current_stream()``,
so work on another stream (a side stream, NCCL's own stream) counts only as far as the current stream
waits for it inside the span (a waited NCCL work does: ``wait()`` makes the current stream wait for it).

Reference: CUDA C++ Programming Guide, "Events" (cudaEventRecord / cudaEventElapsedTime), and
``torch.cuda.Event``. `parlab.trace.Recorder` owns one `DeviceClock` when it records on this clock;
tests/test_trace_clock.py checks the conversion with fake events.
"""
from __future__ import annotations

import time

CLOCKS = ("wall", "cuda-events")


def default_clock() -> str:
    """"cuda-events" when this process already uses a GPU (and communicates over NCCL, if it communicates),
    else "wall" (gloo moves CPU tensors: host time is execution time there)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return "wall"
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return "wall"
    if dist.is_available() and dist.is_initialized() and "nccl" not in str(dist.get_backend()):
        return "wall"
    return "cuda-events"


class DeviceSpan:
    """An event being timed by a pair of CUDA events (the end one recorded at completion)."""

    def __init__(self, event, start):
        self.event, self.start, self.end = event, start, None

    def close(self) -> None:
        if self.end is None:
            import torch
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record()


class DeviceClock:
    """The CUDA events of one recorder: an anchor (CUDA event, wall seconds) and the spans to retime."""

    def __init__(self):
        self.anchor = None                        # (CUDA event, wall seconds) taken when the clock starts
        self.spans: list[DeviceSpan] = []

    def start(self) -> None:
        import torch
        torch.cuda.synchronize()
        anchor = torch.cuda.Event(enable_timing=True)
        anchor.record()
        anchor.synchronize()
        self.anchor = (anchor, time.time())

    def mark(self):
        """A timing CUDA event recorded now on the current stream."""
        import torch
        if self.anchor is None:
            self.start()
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def span(self, event, start_mark, end: bool = True) -> DeviceSpan:
        """Retime `event` from `start_mark` to a CUDA event recorded now (`end`) or later (`DeviceSpan.close`)."""
        span = DeviceSpan(event, start_mark)
        if end:
            span.close()
        self.spans.append(span)
        return span

    def finish(self) -> None:
        """Convert the spans to wall seconds (one device synchronisation). A span whose end was never recorded
        (an asynchronous work nobody waited on) keeps its host duration."""
        if not self.spans:
            return
        import torch
        torch.cuda.synchronize()
        anchor, t0 = self.anchor
        for sp in self.spans:
            ev, host = sp.event, sp.event.end - sp.event.start
            ev.start = t0 + anchor.elapsed_time(sp.start) / 1e3          # elapsed_time is in milliseconds
            ev.end = t0 + anchor.elapsed_time(sp.end) / 1e3 if sp.end is not None else ev.start + host
            ev.clock = "cuda-events"
        self.spans = []
