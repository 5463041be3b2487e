"""Expert parallelism's communication: tokens to the ranks that hold their experts, and back.

Under expert parallelism (EP) the E experts of a layer are split over the ep ranks of an EP group, E/ep each:
expert e lives on EP rank e // (E/ep). Every rank routes its own tokens (`parlab.models.moe.route`) and sorts
its kept assignments by expert, so the rows for EP rank j are one contiguous block. Then [1, 2]:

1. **counts** (`exchange_counts`): an all-to-all of the per-expert counts, (ep, E/ep) per rank: afterwards each
   rank knows how many rows every source will send to each of its local experts. The token all-to-all needs
   these sizes on both ends (NCCL and gloo take the split sizes from the caller), which is why Megatron-Core's
   dispatcher does this first (``token_dispatcher.py``, ``preprocess``).
2. **dispatch**: one all-to-all with *uneven* split sizes (`torch.distributed.all_to_all_single` with split
   lists; gloo has no list form with uneven sizes): block j of this rank's sorted rows goes to EP rank j.
   Received rows come ordered by source rank, then local expert; they are re-sorted to local expert, then
   source, so each expert's rows are contiguous (Megatron's ``sort_chunks_by_idxs``).
3. the local experts run on their rows;
4. **combine**: the inverse: un-sort, and the reverse all-to-all (the split sizes swapped) returns every row to
   the rank of its token, in the order it left.

A rank may receive no rows at all (every token routed elsewhere): its split sizes are zero, the collective still
runs on every rank (skipping it would hang the others), and its experts' gradients are zero.

    _AllToAll   forward: all-to-all, rows `in_splits` out and `out_splits` in;
                backward: the reverse all-to-all of the gradient (the two split lists swapped)

References
    [1] D. Lepikhin et al., "GShard", arXiv:2006.16668, section 3.2 (the all-to-all dispatch and combine).
    [2] S. Rajbhandari et al., "DeepSpeed-MoE", ICML 2022, arXiv:2201.05596, section 5.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from parlab import comm
from parlab.i18n import _

__all__ = ["DispatchPlan", "exchange_counts", "all_to_all_rows", "dispatch", "combine", "gather_over_etp",
           "reduce_scatter_over_etp"]


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all of rows, `in_splits` sent to each rank, `out_splits` received from each;
    backward: the reverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group, label):
        ctx.meta = (in_splits, out_splits, group, label)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))                           # (M, H)
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group=group, label=label)
        return out

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits, group, label = ctx.meta
        out = grad.new_empty((sum(in_splits), *grad.shape[1:]))                      # (N, H)
        comm.all_to_all(out, grad.contiguous(), in_splits, out_splits, group=group, label=f"{label} backward")
        return out, None, None, None, None


def all_to_all_rows(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group=None,
                    label: str = "") -> torch.Tensor:
    """Rows of x (N, ...) to the ranks of `group`, in_splits[j] to rank j; returns the rows received (M, ...),
    out_splits[j] from rank j, in rank order. Differentiable (`_AllToAll`)."""
    return _AllToAll.apply(x, list(in_splits), list(out_splits), group, label)


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """counts (E,): this rank's rows per expert -> (ep, E/ep): received[s, e] rows rank s sends to local
    expert e. One all-to-all of E integers (what a rank sends to rank j is its counts for j's experts)."""
    ep = comm.get_world_size(group)
    if counts.numel() % ep:
        raise ValueError(_("{experts} experts do not split over an expert-parallel group of {ep} ranks: choose ep "
                           "dividing the number of experts").format(experts=counts.numel(), ep=ep))
    out = torch.empty_like(counts)
    comm.all_to_all(out, counts.contiguous(), group=group, label="ep counts")
    return out.view(ep, -1)                                                          # (ep, E/ep)


@dataclass
class DispatchPlan:
    """What combine needs to undo a dispatch: rows sent to / received from each rank, the permutation from the
    received order (source, expert) to local-expert order, and rows per local expert."""
    in_splits: list[int]
    out_splits: list[int]
    order: torch.Tensor             # (M,) received row of each local-expert-ordered row
    local_counts: list[int]         # (E/ep,) rows per local expert


def dispatch(x_sorted: torch.Tensor, counts: torch.Tensor, group=None) -> tuple[torch.Tensor, DispatchPlan]:
    """This rank's kept rows sorted by expert (N, H) with counts (E,) per expert -> the rows of every rank for
    this rank's experts (M, H), sorted by local expert (then source rank), and the plan to send them back."""
    received = exchange_counts(counts, group)                                        # (ep, E/ep)
    ep, local = received.shape
    in_splits = counts.view(ep, local).sum(1).tolist()                               # rows to each rank
    out_splits = received.sum(1).tolist()                                            # rows from each rank
    rows = all_to_all_rows(x_sorted, in_splits, out_splits, group, label="ep dispatch")   # (M, H) by source
    plan = DispatchPlan(in_splits, out_splits, *_by_local_expert(received.tolist(), x_sorted.device))
    return rows[plan.order], plan                                                    # (M, H)


def _by_local_expert(rec: list[list[int]], device) -> tuple[torch.Tensor, list[int]]:
    """Rows received as blocks (source s, local expert e), rec[s][e] rows each, source-major: the permutation to
    expert-major order (M,) and the rows per local expert."""
    ep, local = len(rec), len(rec[0])
    start = list(itertools.accumulate([0] + [n for row in rec for n in row]))        # block (s, e) at s E/ep + e
    order = [i for e in range(local) for s in range(ep)
             for i in range(start[s * local + e], start[s * local + e] + rec[s][e])]
    order = torch.tensor(order, dtype=torch.long, device=device)                     # (M,) expert-major
    return order, [sum(rec[s][e] for s in range(ep)) for e in range(local)]


def gather_over_etp(rows: torch.Tensor, local_counts: list[int], group=None) -> tuple[torch.Tensor, DispatchPlan]:
    """Expert tensor parallelism: this rank's dispatched rows (M, H), sorted by local expert, -> the rows of all
    etp ranks of `group` (M_all, H), sorted by local expert (then etp rank), for experts sharded over them.
    Uneven sizes (each etp rank received its own tokens): counts first, then an all-to-all sending every rank
    the same rows (gloo has no uneven all-gather); backward sums the rows' gradients from every etp rank."""
    etp = comm.get_world_size(group)
    counts = torch.tensor(local_counts * etp, dtype=torch.long, device=rows.device)   # (etp E/ep,)
    received = exchange_counts(counts, group)                                        # (etp, E/ep)
    in_splits, out_splits = [rows.shape[0]] * etp, received.sum(1).tolist()
    out = all_to_all_rows(rows.repeat(etp, 1), in_splits, out_splits, group, label="etp gather")  # by source
    plan = DispatchPlan(in_splits, out_splits, *_by_local_expert(received.tolist(), rows.device))
    return out[plan.order], plan                                                     # (M_all, H)


def reduce_scatter_over_etp(y: torch.Tensor, plan: DispatchPlan, group=None) -> torch.Tensor:
    """The inverse of `gather_over_etp` for partial sums: every etp rank's partial outputs (M_all, H) of all
    rows -> this rank's rows (M, H), summed over the etp ranks (in rank order: the same sum everywhere)."""
    back = y.new_zeros(y.shape).index_copy(0, plan.order, y)                          # (M_all, H) by source
    parts = all_to_all_rows(back, plan.out_splits, plan.in_splits, group, label="etp reduce-scatter")
    return parts.view(len(plan.in_splits), -1, y.shape[-1]).sum(0)                   # (M, H)


def combine(y: torch.Tensor, plan: DispatchPlan, group=None) -> torch.Tensor:
    """The local experts' outputs (M, H), in dispatch's order, back to the ranks they came from: (N, H) in the
    order the rows left (sorted by expert)."""
    back = y.new_zeros(y.shape).index_copy(0, plan.order, y)                          # (M, H) by source again
    return all_to_all_rows(back, plan.out_splits, plan.in_splits, group, label="ep combine")   # (N, H)
