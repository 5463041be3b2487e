"""The communication of tensor parallelism: conjugate pairs of autograd operators.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, section 3) splits a transformer
layer's matrix multiplies across the ranks of a tensor-parallel (TP) group and
needs only two operators to keep forward and backward correct:

    f  = copy_to_tp      forward: identity     backward: all-reduce
    g  = reduce_from_tp  forward: all-reduce   backward: identity

f stands where a replicated activation *enters* the TP region (every rank will
use all of it, so the gradients of its copies must be summed); g stands where
partial results *leave* it (each rank holds a partial sum of the output). The
two are conjugate: each one's backward is the other one's forward.

The other pairs follow the same rule, "the backward of a communication is its
transpose":

    scatter_to_tp         forward: keep my slice of the last dim    backward: all-gather the last dim
    gather_from_tp        forward: all-gather the last dim          backward: keep my slice of it
    scatter_to_sp         forward: keep my slice of the sequence    backward: all-gather the sequence
    gather_from_sp        forward: all-gather the sequence          backward: reduce-scatter the sequence
    reduce_scatter_to_sp  forward: reduce-scatter the sequence      backward: all-gather the sequence

The last three are Megatron sequence parallelism (Korthikanti et al.,
arXiv:2205.05198, section 4.2.2): an all-reduce is a reduce-scatter followed by
an all-gather, so g becomes a reduce-scatter along the sequence (the layer
norms after it then hold S/tp tokens) and f becomes an all-gather, for the
same bytes on the wire.

Every operator takes an explicit ``group`` (default: the world group) and a
``label`` (e.g. the module path), and communicates through `parlab.comm`, so
each call appears in the trace labelled ``"<label> <op> fwd"`` or ``"... bwd"``.
With a group of one rank they are plain identities and communicate nothing.

Shapes: activations are (B, S, H) in parlab's models, so the sequence
operators default to ``dim=1`` (Megatron keeps (S, B, H) and uses dim 0).
Naming follows Megatron-LM's ``megatron/core/tensor_parallel/mappings.py``.
"""
from __future__ import annotations

import torch

from parlab import comm

__all__ = ["copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "scatter_to_sp", "gather_from_sp",
           "reduce_scatter_to_sp", "f", "g", "split_dim"]


# ---------------------------------------------------------------------- plain helpers (no autograd)
def _label(label: str, op: str, direction: str) -> str:
    return " ".join(s for s in (label, op, direction) if s)


def split_dim(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim` (no communication)."""
    n = comm.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over a tensor-parallel group of {n} "
                         f"ranks; the size must be a multiple of {n}")
    return x.chunk(n, dim=dim)[comm.get_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group, label: str) -> torch.Tensor:
    out = x.contiguous().clone()   # never reduce into a tensor autograd may still hold
    comm.all_reduce(out, group=group, label=label)
    return out


def _gather(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    return comm.all_gather_dim(x, dim=dim, group=group, label=label)


def _reduce_scatter(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    if x.shape[dim] % comm.get_world_size(group):
        raise ValueError(f"sequence parallelism splits dim {dim} of size {x.shape[dim]} over "
                         f"{comm.get_world_size(group)} ranks; choose a sequence length that is a multiple of "
                         f"the tensor-parallel size")
    return comm.reduce_scatter_dim(x, dim=dim, group=group, label=label)


class _TPOp(torch.autograd.Function):
    """Shared bookkeeping: remember group, label and dim for the backward pass."""

    @staticmethod
    def save(ctx, group, label, dim=-1):
        ctx.group, ctx.label, ctx.dim = group, label, dim


# ---------------------------------------------------------------------- the TP pairs (Megatron f and g)
class _CopyToTP(_TPOp):
    """f of Megatron-LM section 3. forward: identity; backward: all-reduce (sum) over the TP group."""

    @staticmethod
    def forward(ctx, x, group, label):
        _TPOp.save(ctx, group, label)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, _label(ctx.label, "f", "bwd")), None, None


class _ReduceFromTP(_TPOp):
    """g of Megatron-LM section 3. forward: all-reduce (sum) over the TP group; backward: identity."""

    @staticmethod
    def forward(ctx, x, group, label):
        return _all_reduce(x, group, _label(label, "g", "fwd"))

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToTP(_TPOp):
    """forward: keep this rank's slice of the last dim; backward: all-gather the last dim (Megatron-LM sec. 3)."""

    @staticmethod
    def forward(ctx, x, group, label):
        _TPOp.save(ctx, group, label)
        return split_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), -1, ctx.group, _label(ctx.label, "scatter", "bwd")), None, None


class _GatherFromTP(_TPOp):
    """forward: all-gather the last dim; backward: keep this rank's slice of it (Megatron-LM sec. 3)."""

    @staticmethod
    def forward(ctx, x, group, label):
        _TPOp.save(ctx, group, label)
        return _gather(x.contiguous(), -1, group, _label(label, "gather", "fwd"))

    @staticmethod
    def backward(ctx, grad):
        return split_dim(grad, -1, ctx.group), None, None


# ---------------------------------------------------------------------- the sequence-parallel pairs
class _ScatterToSP(_TPOp):
    """forward: keep this rank's chunk of the sequence; backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group, label, dim):
        _TPOp.save(ctx, group, label, dim)
        return split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), ctx.dim, ctx.group, _label(ctx.label, "sp scatter", "bwd")), \
                None, None, None


class _GatherFromSP(_TPOp):
    """Sequence-parallel f (arXiv:2205.05198 sec. 4.2.2). forward: all-gather the sequence (S/tp -> S);
    backward: reduce-scatter the sequence (sum the partial gradients, keep this rank's S/tp)."""

    @staticmethod
    def forward(ctx, x, group, label, dim):
        _TPOp.save(ctx, group, label, dim)
        return _gather(x.contiguous(), dim, group, _label(label, "sp gather", "fwd"))

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad.contiguous(), ctx.dim, ctx.group, _label(ctx.label, "sp gather", "bwd")), \
                None, None, None


class _ReduceScatterToSP(_TPOp):
    """Sequence-parallel g (arXiv:2205.05198 sec. 4.2.2). forward: reduce-scatter the sequence (sum the
    partial outputs, keep this rank's S/tp); backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group, label, dim):
        _TPOp.save(ctx, group, label, dim)
        return _reduce_scatter(x.contiguous(), dim, group, _label(label, "sp reduce-scatter", "fwd"))

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad.contiguous(), ctx.dim, ctx.group, _label(ctx.label, "sp reduce-scatter", "bwd")), \
                None, None, None


# ---------------------------------------------------------------------- functional entry points
def _trivial(group) -> bool:
    return comm.get_world_size(group) == 1


def copy_to_tp(x: torch.Tensor, group=None, label: str = "") -> torch.Tensor:
    """f: enter the TP region. forward: identity; backward: all-reduce."""
    return x if _trivial(group) else _CopyToTP.apply(x, group, label)


def reduce_from_tp(x: torch.Tensor, group=None, label: str = "") -> torch.Tensor:
    """g: leave the TP region summing partial outputs. forward: all-reduce; backward: identity."""
    return x if _trivial(group) else _ReduceFromTP.apply(x, group, label)


def scatter_to_tp(x: torch.Tensor, group=None, label: str = "") -> torch.Tensor:
    """(..., D) -> (..., D/tp). forward: keep my slice of the last dim; backward: all-gather it."""
    return x if _trivial(group) else _ScatterToTP.apply(x, group, label)


def gather_from_tp(x: torch.Tensor, group=None, label: str = "") -> torch.Tensor:
    """(..., D/tp) -> (..., D). forward: all-gather the last dim; backward: keep my slice."""
    return x if _trivial(group) else _GatherFromTP.apply(x, group, label)


def scatter_to_sp(x: torch.Tensor, group=None, label: str = "", dim: int = 1) -> torch.Tensor:
    """(B, S, H) -> (B, S/tp, H). forward: keep my chunk of the sequence; backward: all-gather it."""
    return x if _trivial(group) else _ScatterToSP.apply(x, group, label, dim)


def gather_from_sp(x: torch.Tensor, group=None, label: str = "", dim: int = 1) -> torch.Tensor:
    """(B, S/tp, H) -> (B, S, H). forward: all-gather the sequence; backward: reduce-scatter it."""
    return x if _trivial(group) else _GatherFromSP.apply(x, group, label, dim)


def reduce_scatter_to_sp(x: torch.Tensor, group=None, label: str = "", dim: int = 1) -> torch.Tensor:
    """(B, S, H) partial sums -> (B, S/tp, H) full sums. forward: reduce-scatter; backward: all-gather."""
    return x if _trivial(group) else _ReduceScatterToSP.apply(x, group, label, dim)


f = copy_to_tp       # the names used in the paper's Figure 3
g = reduce_from_tp
