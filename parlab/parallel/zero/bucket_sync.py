"""ZeRO-1/2's bucketed synchronisation for `parlab.parallel.zero.optimizer.ShardedOptimizer`: gradients
reduce-scattered bucket by bucket while backward still runs, updated parameters all-gathered after the step.

Buckets. The flat owner-major buffer of one dtype (`parlab.parallel.zero.flat`) moves in buckets: bucket c is chunk c
of every owner's segment, so one reduce-scatter of it leaves each rank chunk c of its own segment and one
all-gather sends it back. Inside a segment the parameters lie in *reverse* order of the optimizer's parameter
list (for one parameter group: reverse registration order), so chunk 0 of every segment holds the parameters
whose gradients backward produces first (the last layers).

Overlap (``overlap=True``, the default), as DDP overlaps its all-reduce [1]: a post-accumulate-grad hook on
every trainable parameter notes its gradient; when every parameter of the next bucket has its gradient, the
bucket's reduce-scatter starts asynchronously while backward computes the gradients of earlier layers. On
gloo it sends the bucket's gradient pieces of at least `DIRECT_MIN_BYTES` straight from ``.grad``
(`comm.reduce_scatter_pieces`: one message per piece, no copy) and each run of smaller pieces copied into a
small staging buffer as one message; on other backends all pieces are first copied into the bucket's own
staging slice for the native collective. Buckets start in index order on every rank (collectives
match by call order). An autograd-engine callback at the end of each backward starts the buckets still
waiting (a parameter without a gradient sends zeros), so every backward reduces every bucket exactly once.
`reduce()` (from ``step()``) waits for them.

Accumulation. k backward calls without ``zero_grad`` give k rounds: each reduces the locally accumulated
``.grad`` again and overwrites the shard, so the shard ends with the average of the k-call sums, as one
process accumulating k batches would. Inside `ShardedOptimizer.no_sync()` backward reduces nothing, and the
next reduction (the next backward outside it, or the step) reduces the sum once. Gradients that changed after
the last round (a backward under ``no_sync`` after one outside it, or ``.grad`` edited in place) are noticed
at `reduce()` (tensor identity and version counter) and reduced again there, so the result never silently
misses them; every rank must make the same sequence of backward calls, as under DDP.

Cost: on NCCL (native collectives) one staging buffer as large as the parameters (per dtype), as DDP's
buckets; ``overlap=False`` reduces at the step through one bucket-sized staging buffer instead. On gloo only
the small pieces are staged (the big ones are sent from where backward left them); they must stay unchanged until
the reduction is waited for, which `reduce()` does before anything reads the shard, and a gradient changed in
place after its bucket was sent is noticed there and reduced again.

Collectives on gloo. gloo has no reduce-scatter of its own: torch's ``reduce_scatter_tensor`` on gloo clones
the input, all-reduces all of it (twice the bytes a reduce-scatter needs) and copies this rank's chunk out, and
``all_gather_into_tensor`` gathers into a freshly allocated buffer and copies it out (as read in torch's
ProcessGroupGloo.cpp; in benchmarks/README.md's micro-benchmark the reduce-scatter takes about twice an
all-reduce's time). parlab's trace would record a reduce-scatter's bytes where an all-reduce's went over the
wire. On a gloo group this
module therefore uses `comm.reduce_scatter_direct` / `comm.all_gather_direct`: the same collectives built from
point-to-point messages (each rank sends chunk j straight to rank j, piece by piece), which put exactly a
reduce-scatter's and an all-gather's (N-1)/N of the bytes on the wire, so the trace (one reduce_scatter /
all_gather event each) is what happened; the all-gather receives every chunk straight into its place in the
parameters. On NCCL the
native collectives are used.

References
    [1] S. Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020,
        arXiv:2006.15704, section 3.2.3 (gradient buckets overlapped with backward).
    [2] S. Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
        arXiv:1910.02054, section 5 (reduce-scatter of gradients, all-gather of parameters).
    [3] DeepSpeed, deepspeed/runtime/zero/stage_1_and_2.py (``overlap_comm``: bucketed reduction during backward).
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist

from parlab import comm
from parlab.parallel.zero.flat import FlatLayout, bucket_plans, gloo_messages, split_by_rank

# On gloo a gradient piece of at least this many bytes is sent straight from .grad; smaller neighbouring
# pieces are copied together and sent as one message (see ZeroComm.__init__).
DIRECT_MIN_BYTES = 1 << 20

__all__ = ["ZeroComm"]


def _hook(ref: weakref.ref, i: int, p: torch.Tensor) -> None:
    """Post-accumulate-grad hook of parameter i: tell its ZeroComm, if that is alive and still the parameter's."""
    zc = ref()
    if zc is not None and getattr(p, "_parlab_zero_comm", None) is ref:
        zc._on_grad(i, p)


class ZeroComm:
    """The gradient reduction and parameter gather of one ShardedOptimizer (one instance per optimizer).

    `params` are all of the optimizer's parameters (global index = position), `flats` the per-layout flat
    parameter buffers (the parameters are views of them), `trainable` the indices that get gradients."""

    def __init__(self, params: list[torch.Tensor], trainable: list[int], layouts: list[FlatLayout],
                 flats: list[torch.Tensor], bucket_numel: int, group, overlap: bool):
        self.params, self.layouts, self.flats, self.group, self.overlap = params, layouts, flats, group, overlap
        self.rank, self.world = comm.get_rank(group), comm.get_world_size(group)
        self.direct = "gloo" in str(dist.get_backend(group))    # gloo: collectives from messages (see above)
        device = flats[0].device
        self.buckets = [bucket_plans(lay, bucket_numel) for lay in layouts]      # per layout: (cs, plans)
        self.order = [(k, c) for k, (_, plans) in enumerate(self.buckets) for c in range(len(plans))]
        self.shards = [torch.zeros(lay.seg, dtype=lay.dtype, device=device) for lay in layouts]   # (seg,) owned
        self.pads = [torch.zeros(cs, dtype=lay.dtype, device=device)                              # (cs,) zeros
                     for lay, (cs, _) in zip(layouts, self.buckets)]
        # Staging: with overlap every bucket has its own slice (several are in flight at once); without,
        # one bucket-sized buffer is reused, bucket after bucket.
        # Each (Nd*seg,) with overlap, else (Nd*cs,). On gloo (direct) none: big gradient pieces are sent
        # from .grad itself and small ones through the small per-bucket buffers below (self.small).
        self.staging = [torch.zeros(self.world * (lay.seg if overlap else cs), dtype=lay.dtype, device=device)
                        for lay, (cs, _) in zip(layouts, self.buckets)] if not self.direct else []
        self.members = [sorted({x[0] for x in self.buckets[k][1][c] if not isinstance(x, int)})
                        for k, c in self.order]                   # parameter indices with a piece in the bucket
        self.touch: dict[int, list[int]] = {}                     # parameter index -> bucket positions
        for pos, ids in enumerate(self.members):
            for i in ids:
                self.touch.setdefault(i, []).append(pos)
        # per bucket: per rank, its chunk's plan entries
        self.by_rank = [split_by_rank(self.buckets[k][1][c], self._size(pos)[2])
                        for pos, (k, c) in enumerate(self.order)]
        # gloo: each bucket's messages, per rank [(entries, length, staging start | None)], and the small
        # per-bucket staging buffers its copied runs go through (`gloo_messages`)
        self.msgs, self.small = [], []
        for pos, per in enumerate(self.by_rank if self.direct else ()):
            k = self.order[pos][0]
            rows, used = gloo_messages(per, max(1, DIRECT_MIN_BYTES // flats[k].element_size()))
            self.msgs.append(rows)
            self.small.append(torch.zeros(used, dtype=layouts[k].dtype, device=device))      # (staged elements,)
        self.works: list = [None] * len(self.order)
        self.copied: dict[int, tuple] = {}       # index -> (grad, its version) when last copied into staging
        self.sync = True                         # False inside ShardedOptimizer.no_sync()
        self.frozen = False                      # True between reduce() and the end of the step
        self._new_round()
        self.rounds = 0                          # complete rounds since the last reduce() / reset()
        # The hooks hold the ZeroComm weakly and act only while it is the newest one built over the parameter:
        # an optimizer that was dropped or replaced (a new ShardedOptimizer over the same model) goes quiet.
        me = weakref.ref(self)
        self.hooks = []
        for i in trainable if overlap else ():
            params[i]._parlab_zero_comm = me
            self.hooks.append(params[i].register_post_accumulate_grad_hook(functools.partial(_hook, me, i)))

    # ------------------------------------------------------------------ one bucket
    def _size(self, pos: int) -> tuple[int, int, int]:
        """Bucket `pos` as (layout index, first element of its chunk in a segment, chunk length n)."""
        k, c = self.order[pos]
        cs = self.buckets[k][0]
        return k, c * cs, min(cs, self.layouts[k].seg - c * cs)

    def _piece(self, x, pad: torch.Tensor) -> torch.Tensor:
        """One entry of a bucket plan as a 1-D tensor: a slice of a gradient (zeros if it has none) or padding."""
        if isinstance(x, int):
            return pad[:x]
        i, a, b = x
        g = self.params[i].grad
        return g.reshape(-1)[a:b] if g is not None else pad[:b - a]

    def _message(self, k: int, entries: list, n: int, start: int | None, small: torch.Tensor) -> torch.Tensor:
        """One message of a bucket on gloo: a gradient piece itself, or small pieces copied into staging."""
        if start is None:
            return self._piece(entries[0], self.pads[k])
        buf = small[start:start + n]                                                     # (n,)
        torch.cat([self._piece(x, self.pads[k]) for x in entries], out=buf)
        return buf

    @torch.no_grad()
    def _launch(self, pos: int, async_op: bool = True) -> None:
        """Copy bucket `pos`'s gradient pieces into staging and start its averaging reduce-scatter."""
        k, lo, n = self._size(pos)
        if self.works[pos] is not None:          # the previous round's reduction of this bucket reads staging
            self.works[pos].wait()
            self.works[pos] = None
        for i in self.members[pos]:
            g = self.params[i].grad
            self.copied[i] = (g, None if g is None else g._version)
        label = f"zero grads {k}.{self.order[pos][1]}"
        if self.direct:                          # gloo: big pieces straight from .grad, small ones staged
            pieces = [[self._message(k, entries, n, start, self.small[pos]) for entries, n, start in row]
                      for row in self.msgs[pos]]
            self.works[pos] = comm.reduce_scatter_pieces(self.shards[k][lo:lo + n], pieces, op=comm.ReduceOp.AVG,
                                                         group=self.group, async_op=async_op, label=label)
        else:
            base = self.world * lo if self.overlap else 0
            flat = self.staging[k][base:base + self.world * n]                            # (Nd*n,)
            torch.cat([self._piece(x, self.pads[k]) for x in self.buckets[k][1][self.order[pos][1]]], out=flat)
            self.works[pos] = comm.reduce_scatter(self.shards[k][lo:lo + n], flat, op=comm.ReduceOp.AVG,
                                                  group=self.group, async_op=async_op, label=label)
        if not async_op:
            self.works[pos] = None

    # ------------------------------------------------------------------ hooks (run inside autograd)
    def _new_round(self) -> None:
        self.missing = [set(ids) for ids in self.members]
        self.next = 0
        self.round_open = False

    def _on_grad(self, i: int, _p: torch.Tensor) -> None:
        if not self.sync or self.frozen:         # no_sync, or a backward after reduce() (step() reports it)
            return
        if not self.round_open:
            self.round_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_round)
        for pos in self.touch.get(i, ()):
            self.missing[pos].discard(i)
        while self.next < len(self.order) and not self.missing[self.next]:
            self._launch(self.next)
            self.next += 1

    def _end_round(self) -> None:
        """End of a backward: start the buckets still waiting (parameters without a gradient send zeros)."""
        while self.next < len(self.order):
            self._launch(self.next)
            self.next += 1
        self._new_round()
        self.rounds += 1

    def _changed(self) -> bool:
        """Did any gradient change since it was last copied into staging?"""
        for pos in range(len(self.order)):
            for i in self.members[pos]:
                g, v = self.copied.get(i, (None, None))
                now = self.params[i].grad
                if now is not g or (now is not None and now._version != v):
                    return True
        return False

    # ------------------------------------------------------------------ the optimizer's side
    def reduce(self) -> None:
        """Leave the average over the group of every owned gradient element in `shards`."""
        if not self.overlap:
            for pos in range(len(self.order)):
                self._launch(pos, async_op=False)
        else:
            if self.rounds == 0 or self._changed():   # no backward reduced them yet, or they changed since
                for pos in range(len(self.order)):
                    self._launch(pos)
            for pos, w in enumerate(self.works):
                if w is not None:
                    w.wait()
                    self.works[pos] = None
        self.reset()

    def reset(self) -> None:
        """Forget the current round (after a reduction or at zero_grad); wait for anything in flight."""
        for pos, w in enumerate(self.works):
            if w is not None:
                w.wait()
                self.works[pos] = None
        self.copied.clear()
        self._new_round()
        self.rounds = 0

    @torch.no_grad()
    def gather(self) -> None:
        """All-gather every owner's updated segment, bucket by bucket. With one bucket the gather runs in
        place (the parameters are views of the buffer); with several, each bucket lands in staging and is
        copied to its strided place (chunk c of every segment)."""
        if self.direct:                      # every chunk straight into its place: no staging, no copy
            works = []
            for k, (lay, flat) in enumerate(zip(self.layouts, self.flats)):
                cs, plans = self.buckets[k]
                segs = flat.view(self.world, lay.seg)                               # (Nd, seg)
                for c in range(len(plans)):
                    lo, hi = c * cs, min(lay.seg, (c + 1) * cs)
                    works.append(comm.all_gather_direct(list(segs[:, lo:hi]), segs[self.rank, lo:hi], group=self.group,
                                                        async_op=True, label=f"zero params {k}.{c}"))
            for w in works:
                w.wait()
            return
        for k, (lay, flat) in enumerate(zip(self.layouts, self.flats)):
            cs, plans = self.buckets[k]
            if len(plans) == 1:
                comm.all_gather(flat, flat[self.rank * lay.seg:(self.rank + 1) * lay.seg], group=self.group,
                                label=f"zero params {k}")
                continue
            segs = flat.view(self.world, lay.seg)                                   # (Nd, seg)
            for c in range(len(plans)):
                n = min(cs, lay.seg - c * cs)
                out = self.staging[k][:self.world * n]                              # (Nd*n,)
                comm.all_gather(out, segs[self.rank, c * cs:c * cs + n], group=self.group,
                                label=f"zero params {k}.{c}")
                segs[:, c * cs:c * cs + n].copy_(out.view(self.world, n))
