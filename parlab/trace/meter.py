"""Cost meter: the work of every torch op run while a trace records, for replaying it on other hardware.

`CostMeter` is a ``TorchDispatchMode``: each aten op that reaches the dispatcher is run as usual and counted:

    FLOPs    of matrix products and attention kernels, with the formulas ``torch.utils.flop_counter``
             registers (mm, addmm, bmm, baddbmm, convolutions, scaled-dot-product attention): 2 m n k for an
             (m x k) @ (k x n) product; those of batched products (bmm, baddbmm, attention) also on their own,
             since a CPU runs them at a rate of their own (`parlab.cluster.hardware.Hardware.bmm_flops`)
    bytes    read and written by every other op (the memory-bound ones: elementwise, reductions, norms,
             softmax, copies): the sizes of its tensor inputs and outputs
    kernels  the number of ops counted (views and metadata ops launch nothing and count nothing)
    plain    of those, the ops run outside autograd: with grad mode off and not inside a backward node (the
             optimizer step, ``torch.no_grad()`` bookkeeping, and the adds of gradient accumulation into
             ``.grad``, which the backward's AccumulateGrad node runs without graph bookkeeping). An op autograd
             records in the forward, or runs in the backward, also pays the engine's graph bookkeeping; on a CPU
             that is most of an op's cost in a small model (14 us per forward or backward op against 3 us per
             AdamW op in one calibration: `parlab.cluster.calibrate.step`), so a replay charges the two kinds apart
             (`parlab.cluster.hardware.Hardware.plain_kernel_overhead`)
    special  elements computed by special functions (exp, log, erf, tanh, sigmoid, sin, cos: `SPECIAL_OPS`,
             e.g. in softmax, logsumexp and GeLU), over and above their bytes: they run on a unit of their own
             (a GPU's SFUs: 16 results per clock per SM, so an H100 has 989 TFLOP/s of products but only about 3.9
             TFLOP/s of exponentials, FlashAttention-3, Shah et al. 2024), and a CPU evaluates them in software
             at a few per nanosecond, slower than memory moves their bytes (`parlab.cluster.hardware.Hardware.special_rate`)
    mem_hist the same bytes by size class of the op's working set (its bytes read and written): k -> bytes of
             the ops with working sets in [2^k, 2^(k+1)), so that a two-level memory model
             (`parlab.cluster.hardware.Hardware.cache_bw`) can charge cache-sized ops and DRAM-sized ops differently

Communication ops (namespace c10d) count nothing: the trace times them separately. Use it through
`parlab.trace.count_costs()`, which hands the totals to each compute span of the active recorder.
A replay then charges a span max-free roofline time: FLOPs / achieved FLOP/s + bytes / achieved memory
bandwidth (of the cache or of memory, by working set) + kernels x launch overhead
(`parlab.cluster.hardware.Hardware.compute_time`), i.e. matrix products are taken as compute-bound and every other op as
memory-bound, as in the roofline model (Williams, Waterman, Patterson, "Roofline", CACM 2009).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from parlab.trace.histogram import size_class

__all__ = ["CostMeter", "SPECIAL_OPS"]

_SKIP_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "prim", "profiler")

#: aten ops that evaluate a special function per element of their largest operand (softmax and logsumexp: an
#: exponential per input element; GeLU (erf) and its backward; SiLU and sigmoid: one exponential)
SPECIAL_OPS = frozenset({
    "exp", "exp_", "exp2", "expm1", "log", "log_", "log2", "log10", "log1p", "logsumexp", "logaddexp",
    "_softmax", "_log_softmax", "_log_softmax_backward_data", "gelu", "gelu_", "gelu_backward", "tanh", "tanh_",
    "sigmoid", "sigmoid_", "silu", "silu_", "silu_backward", "erf", "erf_", "erfinv", "sin", "cos", "tan",
    "softplus", "elu", "_safe_softmax"})

_ACCUMULATE = "torch::autograd::AccumulateGrad"   # the backward node that adds a leaf's gradient into .grad
# the backward node running now (None outside a backward); a torch without it counts no op as plain, and a replay
# then charges every op the one kernel_overhead
_current_node = getattr(torch._C, "_current_autograd_node", None)


def _tensor_bytes(obj) -> int:
    leaves, _ = tree_flatten(obj)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _largest(*objs) -> int:
    leaves = [t for obj in objs for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
    return max((t.numel() for t in leaves), default=0)


class CostMeter(TorchDispatchMode):
    """Running totals of (FLOPs, bytes of memory-bound ops, kernels) of the ops run inside ``with meter:``, the
    bytes per working-set size class (`mem_hist`), the batched products' FLOPs and the special-function
    elements."""

    def __init__(self):
        super().__init__()
        self.flops, self.bytes, self.kernels = 0.0, 0, 0
        self.hist: dict[int, int] = {}
        self.batched = 0.0          # the part of flops done by batched products
        self.special = 0            # elements computed by special functions (SPECIAL_OPS)
        self.plain = 0              # ops run outside autograd (grad mode off, not in a backward pass)

    def totals(self) -> tuple[float, int, int]:
        return self.flops, self.bytes, self.kernels

    def state(self) -> tuple[float, int, int, tuple[tuple[int, int], ...], float, int, int]:
        """The running totals, the size histogram ((k, bytes), ...), the batched products' FLOPs, the
        special-function elements and the ops run outside autograd, as `parlab.trace.Event.meter_at` keeps them:
        a replay splits a span at its communication by the work done between (`parlab.cluster.program`)."""
        return (self.flops, self.bytes, self.kernels, tuple(sorted(self.hist.items())), self.batched, self.special,
                self.plain)

    def _count_kernel(self) -> None:
        self.kernels += 1
        if _current_node is not None and not torch.is_grad_enabled():   # not recorded for a backward: plain
            node = _current_node()                           # unless a backward node runs it (its own
            if node is None or node.name() == _ACCUMULATE:   # bookkeeping), but adding into .grad is plain work
                self.plain += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _SKIP_NAMESPACES or getattr(func, "is_view", False):
            return out
        packet = func._overloadpacket
        formula = flop_registry.get(packet)
        if formula is not None:
            f = float(formula(*args, **kwargs, out_val=out))
            self.flops += f
            self._count_kernel()
            if "bmm" in packet.__name__ or "attention" in packet.__name__:
                self.batched += f
        else:
            moved = _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out)
            if moved:
                self.bytes += moved
                self._count_kernel()
                k = size_class(moved)
                self.hist[k] = self.hist.get(k, 0) + moved
                if packet.__name__ in SPECIAL_OPS:
                    self.special += _largest(args, kwargs, out)
        return out
