"""The trace clock: host wall time on the CPU, CUDA events (converted to wall seconds) on a GPU.

No GPU here, so torch.cuda.Event and torch.cuda.synchronize are replaced by a fake device whose clock moves
only when the test says the "GPU" ran something. A kernel launch returns at once on the host; only the
device clock shows how long the work took, so the fake device runs for much longer than the host spends."""
import pytest
import torch

import parlab
from parlab import comm
from parlab.trace import Recorder, Trace, recording, region


class FakeDevice:
    """A device clock in milliseconds, advanced by `run(ms)` (a kernel that takes ms on the GPU)."""

    def __init__(self):
        self.ms = 0.0
        self.synchronised = 0

    def run(self, ms: float) -> None:
        self.ms += ms

    def event_class(self):
        dev = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing, "timing events need enable_timing=True"
                self.t = None

            def record(self, stream=None):
                self.t = dev.ms

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                assert self.t is not None and other.t is not None, "both events must be recorded"
                return other.t - self.t
        return Event

    def sync(self, device=None):
        self.synchronised += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    dev = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", dev.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", dev.sync)
    return dev


def test_regions_are_timed_by_device_events_and_converted_to_wall_seconds(fake_cuda):
    fake_cuda.run(1000.0)                       # device work from before the recording: not in any span
    with recording(rank=3, clock="cuda-events") as rec:
        t0 = rec.device.anchor[1]                     # wall seconds of the anchor event (taken at the start)
        fake_cuda.run(20.0)                     # 20 ms of earlier work queued ahead of the region
        with region("forward", label="stage 0 mb 0"):
            fake_cuda.run(250.0)                # the region's kernels: 250 ms on the device, ~0 on the host
        assert rec.events[0].clock == "wall"    # converted only when the recording ends
    ev = rec.events[0]
    assert ev.clock == "cuda-events" and ev.rank == 3
    assert ev.start == pytest.approx(t0 + 0.020, abs=1e-6)   # wall seconds since 1970 in a double: ~0.2 us resolution
    assert ev.duration == pytest.approx(0.250, abs=1e-6)
    assert fake_cuda.synchronised == 2          # once for the anchor, once at the end: no sync per call
    tr = Trace(rec.events)
    assert tr.clock == "cuda-events" and tr.to_chrome()["otherData"] == {"clock": "cuda-events"}


def test_the_wall_clock_is_the_default_without_cuda():
    with recording() as rec:                    # "auto": this process never used CUDA
        with region("forward"):
            pass
    assert rec.clock == "wall" and rec.events[0].clock == "wall" and Trace(rec.events).clock == "wall"
    with pytest.raises(ValueError, match="clock must be one of"):
        Recorder(0, clock="tsc")


def _traced_comm(dev):
    """Each rank: a synchronous all-reduce, then an asynchronous one waited after 30 ms of device work."""
    with recording(clock="cuda-events") as rec:
        t = torch.ones(4)
        dev.run(5.0)
        comm.all_reduce(t, label="sync")
        w = comm.all_reduce(t, async_op=True, label="async")
        dev.run(30.0)                           # other device work; the collective ended within it
        w.wait()
        w2 = comm.broadcast(t, src=0, async_op=True, label="never waited")
        dev.run(7.0)
    w2.wait()                                   # after the recording: its span keeps the host duration
    return [(e.label, e.start - rec.device.anchor[1], e.duration, e.clock) for e in rec.events]


def test_comm_calls_are_timed_by_device_events(fake_cuda):
    res = parlab.run(_traced_comm, 2, fake_cuda, echo=False)   # forked ranks inherit the fake device
    for rows in res.results:
        got = {label: (start, dur, clock) for label, start, dur, clock in rows}
        assert got["sync"][:2] == pytest.approx((0.005, 0.0), abs=1e-6)     # no device time passed in the call
        # the async call ends at its future's callback (gloo: whenever its thread finishes) or at wait()
        assert got["async"][0] == pytest.approx(0.005, abs=1e-6) and -1e-6 <= got["async"][1] <= 0.030 + 1e-6
        assert got["never waited"][0] == pytest.approx(0.035, abs=1e-6)
        assert got["never waited"][1] >= 0
        assert {c for _, _, c in got.values()} == {"cuda-events"}


def _ddp_step(dev):
    from parlab.parallel.data import DistributedDataParallel
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0001)   # several buckets: several backward spans
    with recording(clock="cuda-events") as rec:
        ddp(torch.ones(3, 4)).sum().backward()
    return [(e.op, e.clock, e.duration) for e in rec.events if e.kind == "compute"]


def test_ddp_backward_spans_are_timed_by_device_events(fake_cuda):
    # the fake device never runs anything here, so device-timed spans last exactly 0 s (host time would not)
    for spans in parlab.run(_ddp_step, 2, fake_cuda, echo=False).results:
        backward = [(clock, dur) for op, clock, dur in spans if op == "backward"]
        assert len(backward) >= 2 and all(c == "cuda-events" and d == 0.0 for c, d in backward)


def test_an_async_call_ends_when_its_future_completes_not_at_wait(fake_cuda):
    # On NCCL, torch runs a work's future callbacks on a stream synchronised with its kernels, so an event
    # recorded there completes with the collective: DDP's bucket all-reduces end where they really end,
    # not at the wait after the whole backward. A fake work whose callback the test fires by hand:
    class Future:
        def add_done_callback(self, cb):
            self.cb = cb

    class Work:
        fut = Future()

        def get_future(self):
            return self.fut

        def wait(self):
            return True

    from parlab.trace import Event
    with recording(clock="cuda-events") as rec:
        ev = rec.add(Event(rank=0, kind="collective", op="all_reduce", start=0.0, end=0.0, asynchronous=True))
        work = comm.TracedWork(Work(), ev, rec.device_span(ev, rec.device_mark(), end=False))
        fake_cuda.run(12.0)                     # the all-reduce's kernels
        Work.fut.cb(Work.fut)                   # its future completes (NCCL: callback on a synced stream)
        fake_cuda.run(300.0)                    # the rest of the backward
        work.wait()
    assert ev.duration == pytest.approx(0.012, abs=1e-6) and ev.clock == "cuda-events"
