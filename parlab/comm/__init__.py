"""parlab.comm: the only place in parlab that talks to other ranks.

    from parlab import comm
    comm.all_reduce(t, group=g, label="grad bucket 2")      # traced: op, group, bytes, start and end

Read in this order:

* ``traced.py``  every collective and point-to-point call of torch.distributed, same arguments and result,
                  plus an explicit ``group`` (default: the world group), a ``label``, and one `parlab.trace.Event`
                  per call; `get_rank`, `get_world_size`, `group_ranks`; the dimension helpers
                  (`all_gather_dim`, `reduce_scatter_dim`) and `all_gather_uneven`.
* ``direct.py``  reduce-scatter and all-gather built from messages, for ZeRO on gloo (where the built-in ones
                  are missing or slow), traced as the collective they implement.
* ``grads.py``   `average_grads`: a gradient averaged over the replicas that computed it, one flat all-reduce (the
                  one home of the gradient sync the pipeline, Ulysses, expert parallelism and the hybrid run).
* ``strict_mode.py``  `strict()`: NCCL's rules (device, contiguity, dtype, ReduceOp.AVG) checked on gloo, so
                  a CPU run finds GPU-only failures (the test suite runs in it).

Ranks passed as ``src``/``dst``/peers are global ranks, as in torch.distributed.
"""
from parlab.comm.direct import all_gather_direct, reduce_scatter_direct, reduce_scatter_pieces
from parlab.comm.grads import average_grads
from parlab.comm.strict_mode import NCCL_DTYPES, Strict, StrictCommError, strict
from parlab.comm.traced import (ReduceOp, TracedWork, all_gather, all_gather_dim, all_gather_uneven, all_reduce,
                                all_to_all, barrier, broadcast, gather, get_rank, get_world_size, group_ranks,
                                irecv, isend, recv, reduce, reduce_scatter, reduce_scatter_dim, scatter, send)

__all__ = ["ReduceOp", "get_rank", "get_world_size", "group_ranks",
           "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
           "barrier", "send", "recv", "isend", "irecv", "all_gather_dim", "reduce_scatter_dim", "all_gather_uneven",
           "TracedWork", "reduce_scatter_direct", "reduce_scatter_pieces", "all_gather_direct", "average_grads",
           "strict", "StrictCommError", "Strict", "NCCL_DTYPES"]
