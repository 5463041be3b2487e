"""parlab.trace: what the ranks did. The record every lesson draws from and the virtual cluster re-times.

Read in this order:

* ``events.py``   `Event` (one call or compute span on one rank), the per-process `Recorder`, `recording()`,
                   `region("forward")` for compute spans, `mark()`, `count_costs()`; and `Trace`, every rank's
                   events merged, with tables, byte counts and the Chrome/Perfetto export.
* ``wire.py``     the byte model: what a collective of a given payload puts on the wire under the ring
                   algorithms (2(N-1)/N for all-reduce, (N-1)/N for all-gather and reduce-scatter). The one
                   place in parlab where these factors are written (Patarasuk and Yuan 2009; NCCL's
                   PERFORMANCE.md).
* ``clock.py``    the "cuda-events" clock: GPU-timed spans, since host time means little under NCCL.
* ``meter.py``    `CostMeter`: the FLOPs, bytes and kernels of a compute span, counted from the ops torch runs
                   (``torch.utils.flop_counter``), and the message-size histograms the virtual cluster prices.

Nothing here communicates: `parlab.comm` records into the trace, `parlab.launch` brings it home, `parlab.viz`
draws it, `parlab.cluster.replay` re-times it.
"""
from parlab.trace.events import (CLOCKS, COLLECTIVES, P2P, Event, Recorder, Trace, count_costs, current_recorder,
                                 mark, now, recording, region)
from parlab.trace.wire import format_bytes, wire_bytes

__all__ = ["Event", "Recorder", "Trace", "recording", "current_recorder", "region", "mark", "now", "count_costs",
           "wire_bytes", "format_bytes", "CLOCKS", "COLLECTIVES", "P2P"]
