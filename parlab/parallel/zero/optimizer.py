"""ZeRO stages 1 and 2: shard the optimizer state (and the gradients) across data-parallel ranks.

In plain data parallelism every one of the Nd ranks holds the whole training state:
16-bit weights (2 psi bytes), 16-bit gradients (2 psi) and the optimizer state
(K psi; K = 12 for mixed-precision Adam: fp32 master weights, m and v). ZeRO [1]
notices that the update of a parameter only needs that parameter's gradient and
state, so the optimizer work can be split by *parameters* instead of by data:

    ZeRO-1 (P_os)    rank r keeps optimizer state only for the parameters it owns       2psi + 2psi + K psi/Nd
    ZeRO-2 (P_os+g)  ... and, after the reduction, only the gradients of those            2psi + (2psi + K psi)/Nd
    ZeRO-3 (P_os+g+p) ... and only a shard of the weights themselves (see parlab.parallel.zero.fsdp)   (2psi + 2psi + K psi)/Nd

One step of `ShardedOptimizer` on rank r of Nd (psi parameters, owner-major flat layout):

    grads of all params on every rank (local batch)
        | reduce-scatter, averaged        each rank receives the mean gradient of the params it owns
        v
    [ g_own(r) ]                          ZeRO-2 frees the other gradients here; ZeRO-1 keeps the buffers
        | inner optimizer step            torch.optim.<Any> on the owned parameters only
        v
    [ p_own(r) ]
        | all-gather (in place)           every rank gets every owner's updated parameters
        v
    full parameters on every rank

The traffic is a reduce-scatter plus an all-gather of psi elements: the same 2 psi a DDP
all-reduce moves (an all-reduce *is* a reduce-scatter followed by an all-gather [2]).

Partition. Whole parameters are assigned to ranks, largest first, each to the rank
that owns the fewest elements so far (as torch's ZeroRedundancyOptimizer does), so any
optimizer works, including ones whose update is not element-wise. Per dtype, the
gradients and parameters travel in one flat buffer laid out owner by owner, each
owner's segment padded to the longest one, so a single reduce-scatter / all-gather of
equal chunks moves them (gloo cannot gather unequal sizes); see `parlab.parallel.zero.flat`.

Hot path. The parameters are views into that flat buffer. The buffer is moved in buckets of
at most `bucket_numel` elements: bucket c is chunk c of every owner's segment, so one
reduce-scatter per bucket leaves each rank chunk c of its own segment and one all-gather
per bucket sends it back (with a single bucket the all-gather runs in place, straight into
the model). Gradients are reduce-scattered into a persistent (seg,) shard whose slices become
the owned ``.grad`` (on gloo pieces of 1 MiB or more straight from ``.grad``, smaller ones
staged together; on NCCL through persistent staging, one ``torch.cat`` per bucket): no
multi-MB tensor is allocated per step. On gloo both collectives are built from
point-to-point messages (`parlab.parallel.zero.bucket_sync` says why). For element-wise optimizers (SGD,
Adam, AdamW, ...) the inner optimizer steps each parameter group's owned run of the segment
as a few flat tensors (1 MiB chunks, so each pass of the update finds its operands in
cache), not a Python loop over parameters.

Checkpoints. `state_dict()` gathers the full state in the format of the inner optimizer class;
`save_sharded` / `load_sharded` write one verified file per rank (`parlab.parallel.zero.checkpoint`) and
reload at any DP size (several nodes need a shared file system).

Overlap. By default the reduce-scatters run during backward, bucket by bucket, as DDP's all-reduce
and DeepSpeed's ``overlap_comm`` do (`parlab.parallel.zero.bucket_sync`); ``overlap=False`` runs them all at `step()`.

Simplifications, said plainly: a trainable parameter without a gradient on some rank counts as a
zero gradient there; frozen parameters
(``requires_grad=False`` at construction) are never sharded, stepped or sent.

Padded targets. Averaging the ranks' gradients of their own mean losses gives the global mean only when
every rank holds equally many non-ignored targets. With padding (ignore_index -100) spread unevenly, use
``loss = parlab.parallel.data.loss.global_mean_loss(logits, targets, group)``: D * (this rank's sum) / (the global
count, one all-reduce), whose average over the ranks is the global mean over the non-ignored targets.

References
    [1] S. Rajbhandari, J. Rasley, O. Ruwase, Y. He, "ZeRO: Memory Optimizations Toward Training
        Trillion Parameter Models", SC 2020, arXiv:1910.02054, sections 3 and 5.
    [2] P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
        workstations", JPDC 2009.
    [3] PyTorch, torch.distributed.optim.ZeroRedundancyOptimizer; Stanford CS336 assignment 2.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch

from parlab import comm
from parlab.parallel.zero.bucket_sync import ZeroComm
from parlab.parallel.zero.flat import ELEMENTWISE, STEP_CHUNK_BYTES, chunk_bounds, make_layouts, owned_runs
from parlab.parallel.zero.optimizer_state import ShardedOptimizerState, _hyper
from parlab.trace import region

__all__ = ["ShardedOptimizer", "partition_parameters", "iter_owned"]


def partition_parameters(numels: list[int], world_size: int) -> list[int]:
    """Owner rank of each parameter: largest first, each to the least-loaded rank (ties: lowest rank).

    >>> partition_parameters([4, 3, 2, 1], 2)
    [0, 1, 1, 0]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    load = [0] * world_size
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


class ShardedOptimizer(ShardedOptimizerState, torch.optim.Optimizer):
    """ZeRO-1 (``stage=1``) or ZeRO-2 (``stage=2``) around any torch optimizer class.

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, stage=2)
        loss.backward(); opt.step(); opt.zero_grad()

    `params` may be parameters or parameter groups, as for any torch optimizer. Gradients are
    averaged over `group` bucket by bucket while backward runs (``overlap=True``: hooks start each
    bucket's reduce-scatter, `step()` waits for them; see `parlab.parallel.zero.bucket_sync`), or all inside `step()`
    (``overlap=False``). Pass ``reduce_grads=False`` if something else, e.g. DDP, already averaged them.
    Gradient accumulation: k backward calls, then `step()`; inside ``with opt.no_sync():`` backward
    does not communicate (as DDP's ``no_sync``). `state_dict()` returns the full, unsharded state in the format
    of ``optimizer_cls`` itself, so a checkpoint loads into a plain optimizer or into a
    ShardedOptimizer of any DP size; `save_sharded` / `load_sharded` write and read per-rank files.

    The trainable parameters become views into flat per-dtype buffers (`parlab.parallel.zero.flat`): move or
    cast the model *before* building the optimizer, and change weights in place (``p.copy_``), not by
    assigning ``p.data``. `flat_step` (default: on for element-wise optimizers such as SGD and AdamW)
    steps each group's owned parameters as flat tensors, cache-sized chunks of each run of owned
    parameters (`parlab.parallel.zero.flat.STEP_CHUNK_BYTES`); `opt.state` then holds one flat state per chunk
    (per-parameter state: `state_dict()`). `bucket_numel` caps the elements
    of one reduce-scatter / all-gather (and of one flat run).
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], *, stage: int = 1, group=None,
                 reduce_grads: bool = True, flat_step: bool | None = None, bucket_numel: int = 1 << 22,
                 overlap: bool = True, **optimizer_kwargs: Any):
        if stage not in (1, 2):
            raise ValueError(f"ShardedOptimizer implements ZeRO stages 1 and 2, got stage={stage}; "
                             f"for stage 3 wrap the model in parlab.parallel.zero.fsdp.FullyShardedDataParallel")
        if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"bucket_numel must be a positive int (elements per reduce-scatter / all-gather), "
                             f"got {bucket_numel!r}")
        self._ready = False
        super().__init__(params, defaults=dict(optimizer_kwargs))
        self.stage, self.group, self.reduce_grads = stage, group, reduce_grads
        self.rank, self.world_size = comm.get_rank(group), comm.get_world_size(group)
        self.params = [p for g in self.param_groups for p in g["params"]]   # global index = position here
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        if not self.trainable:
            raise ValueError("ShardedOptimizer got no trainable parameters (all have requires_grad=False)")
        owners = partition_parameters([self.params[i].numel() for i in self.trainable], self.world_size)
        self.owner = {i: r for i, r in zip(self.trainable, owners)}   # global index -> owning rank
        self.owned = [i for i in self.trainable if self.owner[i] == self.rank]
        self._not_owned = [self.params[i] for i in self.trainable if self.owner[i] != self.rank]
        self._device = self.params[self.trainable[0]].device
        self._index = {id(p): i for i, p in enumerate(self.params)}
        backward_order = dict(reversed(self.owner.items()))    # segments in reverse order: see zero/bucket_sync.py
        self.layouts = make_layouts([p.numel() for p in self.params], [p.dtype for p in self.params],
                                    backward_order, self.world_size)
        self._flats = [self._bind(lay) for lay in self.layouts]            # the parameters' new storage
        # Buckets, their persistent buffers (no multi-MB tensor allocated per step: page faults) and the
        # backward hooks that start each bucket's reduce-scatter once its gradients are ready.
        self.zero_comm = ZeroComm(self.params, self.trainable, self.layouts, self._flats, bucket_numel, group,
                                  overlap=overlap and reduce_grads)
        self.flat_step = optimizer_cls in ELEMENTWISE if flat_step is None else flat_step
        group_of = dict(enumerate(g for g, grp in enumerate(self.param_groups) for _ in grp["params"]))
        # The inner optimizer sees only this rank's parameters, group by group (a group may be empty here):
        # the owned parameters themselves, or (flat_step) one view of the flat buffer per run of them.
        self._runs = []           # (layout index, start, end in segment, members, tensor, chunk bounds, chunks)
        local = [[] for _ in self.param_groups]
        for k, lay in enumerate(self.layouts):
            for g, a, b, ids in owned_runs(lay, self.rank, group_of, cap=bucket_numel):
                if self.flat_step:
                    seg = self._flats[k][self.rank * lay.seg:(self.rank + 1) * lay.seg]
                    members = [(i, lay.offset[i] - self.rank * lay.seg - a, self.params[i].shape) for i in ids]
                    run = seg[a:b]                                           # (b - a,) a view: steps in place
                    bounds = chunk_bounds(b - a, STEP_CHUNK_BYTES // run.element_size())
                    chunks = [run[c0:c1] for c0, c1 in bounds]               # (<= chunk,) views: cache-sized
                    self._runs.append((k, a, b, members, run, bounds, chunks))
                    local[g] += chunks
                else:
                    local[g] += [self.params[i] for i in ids]
        self.optim = optimizer_cls([{**_hyper(g), "params": ps} for g, ps in zip(self.param_groups, local)],
                                   **optimizer_kwargs)
        for mine, inner in zip(self.param_groups, self.optim.param_groups):  # the class's defaults, as shown
            for k, v in _hyper(inner).items():                                # by optimizer_cls itself
                mine.setdefault(k, v)
        self.state = self.optim.state        # only the state of what this rank owns
        self._reduced = False
        self._ready = True

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ready", False):
            raise NotImplementedError("ShardedOptimizer cannot add parameter groups after construction; "
                                      "pass every group to the constructor")
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ flat owner-major buffers
    @torch.no_grad()
    def _bind(self, lay) -> torch.Tensor:
        """Copy the layout's parameters into a new flat buffer and make each parameter a view of it."""
        flat = torch.zeros(self.world_size * lay.seg, dtype=lay.dtype, device=self._device)  # (Nd*seg,)
        for i, off in lay.offset.items():
            p = self.params[i]
            flat[off:off + p.numel()].copy_(p.reshape(-1))
            p.data = flat[off:off + p.numel()].view_as(p)
        return flat

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the gradients over the group; each rank receives only the mean of the ones it owns (with
        overlap, backward already started the reduce-scatters: this waits for them). ZeRO-2 then drops every
        other gradient; ZeRO-1 leaves them allocated (with local values). With ``reduce_grads=False`` the
        owned gradients are taken as they are (already averaged)."""
        if self._reduced and any(p.grad is not g or (g is not None and g._version != v) for p, g, v in self._seen):
            raise RuntimeError("a backward ran after reduce_gradients() and before step(): the gradients were already "
                               "averaged and sharded, so the new ones cannot be accumulated into them. Run every "
                               "backward first, then step() (which reduces once), or zero_grad() before the backward")
        if self._reduced:
            return
        if self.reduce_grads:
            self.zero_comm.reduce()
        for k, lay in enumerate(self.layouts):
            base, mine = self.rank * lay.seg, self.zero_comm.shards[k]                  # (seg,)
            if self.reduce_grads:
                for i in lay.segs[self.rank]:                     # owned gradients: views of the shard
                    a = lay.offset[i] - base
                    self.params[i].grad = mine[a:a + lay.numel[i]].view_as(self.params[i])
            else:
                pieces = [self.params[i].grad.reshape(-1) if self.params[i].grad is not None else
                          mine.new_zeros(lay.numel[i]) for i in lay.segs[self.rank]]
                if pieces:
                    torch.cat(pieces, out=mine[:sum(lay.numel[i] for i in lay.segs[self.rank])])
        for k, a, _, _, _, bounds, chunks in self._runs:
            for (c0, c1), t in zip(bounds, chunks):
                t.grad = self.zero_comm.shards[k][a + c0:a + c1]                # (c1 - c0,)
        if self.stage == 2 and self.reduce_grads:
            for p in self._not_owned:
                p.grad = None
        self._reduced = self.zero_comm.frozen = True
        self._seen = [(p, p.grad, None if p.grad is None else p.grad._version)   # to notice a later backward
                      for p in (self.params[i] for i in self.trainable)]

    @contextlib.contextmanager
    def no_sync(self):
        """Backward calls inside the block only accumulate ``.grad`` locally (no communication); the next
        reduction (a backward outside the block, or ``step()``) reduces the sum once. As DDP's ``no_sync``."""
        before, self.zero_comm.sync = self.zero_comm.sync, False
        try:
            yield
        finally:
            self.zero_comm.sync = before

    def _gather_parameters(self) -> None:
        self.zero_comm.gather()

    def step(self, closure=None):
        """Reduce gradients (if not done yet), step the owned shard, all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.reduce_gradients()
        for mine, local in zip(self.param_groups, self.optim.param_groups):  # e.g. an LR scheduler changed lr
            local.update(_hyper(mine))
        if self.owned:                       # with more ranks than parameters a rank may own nothing
            with region("optimizer", label=f"zero-{self.stage} shard step"):
                self.optim.step()
        self._gather_parameters()
        self._reduced = self.zero_comm.frozen = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for t in (t for *_, chunks in self._runs for t in chunks):
            if set_to_none:
                t.grad = None
            elif t.grad is not None:
                t.grad.zero_()
        self.zero_comm.reset()
        self._reduced = self.zero_comm.frozen = False


def iter_owned(opt: ShardedOptimizer) -> Iterable[torch.nn.Parameter]:
    """The parameters this rank owns (steps and holds state for)."""
    return (opt.params[i] for i in opt.owned)
