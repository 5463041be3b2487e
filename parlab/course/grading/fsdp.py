"""Checks for exercise 09 (one ZeRO-3 / FSDP unit: gather - compute - free - reduce-scatter).

ZeRO stage 3 (Rajbhandari et al., arXiv:1910.02054, sections 5.3 and 7.2; PyTorch FSDP, arXiv:2304.11277):
each rank keeps a 1/N shard of a unit's flat parameters; forward all-gathers the full flat, computes and
drops it; backward all-gathers it again, computes the gradients and reduce-scatters the gradient of the full
flat, so each rank receives the (averaged) gradient of its own shard. The student writes
(exercises/solutions/09_fsdp_unit.ipynb)

    gather_full(shard)       the full flat vector from every rank's shard: one comm.all_gather
    FSDPUnitFn.apply(x, shard)   forward: gather, unit_forward(x, full), keep only x and the shard;
                              backward: gather again, recompute, autograd.grad, reduce-scatter / N

with the unit an MLP, ``unit_forward(x, flat)`` (given, `unit_forward` here). The checks:
`check_gather_full` (every rank gets the full flat, one all-gather); `check_fsdp_unit_grads` (output, x
gradient and the shard's gradient equal one process: the shard's gradient is rank r's slice of the average over
ranks of the full gradient; 2 and 4 ranks, float64); `check_fsdp_unit_trace` (one all-gather in forward, one
all-gather and one reduce-scatter in backward, bytes on the wire 3 (N-1)/N psi = 1.5x DDP's all-reduce of
2 (N-1)/N psi; and nothing full-size saved between forward and backward: every tensor autograd saved is
inspected with ``torch.autograd.graph.saved_tensors_hooks``, and the backward node's attributes too).
"""
from __future__ import annotations

import gc
import inspect
import types

import torch
import torch.nn.functional as F

from parlab import comm
from parlab.i18n import _
from parlab.trace import mark, wire_bytes
from parlab.course.grading.runner import TIMEOUT, run_student
from parlab.course.grading.guard import fresh_seed, graded, protect

__all__ = ["unit_forward", "shard_of", "flat_numel", "check_gather_full", "check_fsdp_unit_grads",
           "check_fsdp_unit_trace", "H"]

REFS = ("parlab.parallel.zero.fsdp:FullyShardedDataParallel", "parlab.parallel.zero.optimizer:ShardedOptimizer", "parlab.parallel.zero.fsdp:_GatherParams",
        "parlab.parallel.zero.fsdp:_Flat")
H, BATCH = 8, 12                     # the unit: MLP H -> 4H -> H; 12 rows split over 2 or 4 ranks
SHAPES = ((4 * H, H), (4 * H,), (H, 4 * H), (H,))
WORLD_SIZES = (2, 4)
TOL = 1e-10                          # float64; the ranks sum the same per-row gradients in another order


def flat_numel() -> int:
    return sum(torch.Size(s).numel() for s in SHAPES)


def unit_forward(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """The unit, an MLP, computed from a full flat parameter vector (padding at the end ignored):
    x (b, H) -> gelu(x W1^T + b1) W2^T + b2, (b, H)."""
    views, at = [], 0
    for s in SHAPES:
        n = torch.Size(s).numel()
        views.append(flat[at:at + n].view(s))
        at += n
    w1, b1, w2, b2 = views
    return F.gelu(x @ w1.t() + b1) @ w2.t() + b2          # (b, H)


def shard_of(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s shard: `flat` zero-padded to N s elements, s = ceil(psi / N), elements [r s, (r+1) s)."""
    s = -(-flat.numel() // world_size)
    padded = torch.zeros(world_size * s, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return padded[rank * s:(rank + 1) * s].clone()


def _data(seed: int):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(flat_numel(), generator=g, dtype=torch.float64) * 0.3
    x = torch.randn(BATCH, H, generator=g, dtype=torch.float64)
    dout = torch.randn(BATCH, H, generator=g, dtype=torch.float64)
    return flat, x, dout


# ---------------------------------------------------------------------- part 1: the gather
def _rank_gather(fn, seed):
    P, r = comm.get_world_size(), comm.get_rank()
    flat = _data(seed)[0]
    out = fn(shard_of(flat, r, P))
    return out.detach().clone() if isinstance(out, torch.Tensor) else out


@graded(*REFS)
def check_gather_full(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """``fn(shard)`` returns the full (padded) flat vector on every rank, with one all-gather."""
    for P in world_sizes:
        seed = fresh_seed()
        res = run_student(_rank_gather, P, fn, seed, timeout=timeout, what="gather_full")
        flat = _data(seed)[0]
        want = torch.cat([shard_of(flat, r, P) for r in range(P)])       # (N s,) padded
        for r, got in enumerate(res.results):
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.equal(got, want):
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise AssertionError(_("gather_full on {P} ranks: rank {r} returned {shape}, expected the full "
                                       "padded flat vector {want}, rank j's shard at [j s, (j+1) s).\nHint: full = "
                                       "torch.empty(P * shard.numel(), dtype=shard.dtype); comm.all_gather(full, "
                                       "shard); return full.").format(P=P, r=r, shape=shape, want=tuple(want.shape)))
        ops = [e.op for e in res.trace.comm().events if e.rank == 0]
        if ops != ["all_gather"]:
            raise AssertionError(_("gather_full on {P} ranks: rank 0 called {ops}; one comm.all_gather of the shards "
                                   "is all it takes.").format(P=P, ops=ops or _("nothing")))
    print(_("gather_full rebuilds the full flat vector on {sizes} ranks, one all-gather").format(
        sizes=", ".join(map(str, world_sizes))))


# ---------------------------------------------------------------------- part 2: the unit
def _big_tensors(numel: int) -> dict[int, torch.Tensor]:
    """The tensors of at least `numel` elements alive in this process (torch tensors are tracked by the garbage
    collector), by id: one kept outside autograd (a global, a closure, an attribute) shows up here."""
    gc.collect()
    return {id(o): o for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.numel() >= numel}


def _held(t: torch.Tensor, mine: list) -> bool:
    """Is `t` held by something that outlives forward (a dict, a list, an object, a closure cell, a suspended
    generator)? A plain function's frame does not count: the watchdog thread may briefly hold the frame of a
    forward that already returned (it samples the main thread's stack)."""
    gen = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
    return any(o is not mine and (not isinstance(o, types.FrameType) or o.f_code.co_flags & gen)
               for o in gc.get_referrers(t))


def _rank_unit(cls, seed, watch_kept: bool = False):
    P, r = comm.get_world_size(), comm.get_rank()
    flat, x, dout = _data(seed)
    b = BATCH // P
    shard = torch.nn.Parameter(shard_of(flat, r, P))                     # (s,) the only weights this rank keeps
    xr = x[r * b:(r + 1) * b].clone().requires_grad_(True)              # (b, H) this rank's rows
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    before = _big_tensors(P * shard.numel()) if watch_kept else {}   # the grader's own full `flat` among them
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = cls.apply(xr, shard)                                      # (b, H)
    kept = [v.numel() for v in vars(out.grad_fn).values() if isinstance(v, torch.Tensor)] \
        if out.grad_fn is not None and hasattr(out.grad_fn, "__dict__") else []
    if watch_kept:
        after = _big_tensors(P * shard.numel())
        fresh = [t for i, t in after.items() if i not in before]     # full-size tensors made by forward, alive
        del after
        kept += [t.numel() for t in fresh if _held(t, fresh)]
    del before
    mark("backward")
    (out * dout[r * b:(r + 1) * b]).sum().backward()
    return {"out": out.detach().clone(), "x_grad": None if xr.grad is None else xr.grad.clone(),
            "shard_grad": None if shard.grad is None else shard.grad.clone(), "saved": saved + kept,
            "shard_numel": shard.numel()}


def _reference(seed, P):
    """One process: each rank's output and x gradient, and the full gradient averaged over the ranks."""
    flat, x, dout = _data(seed)
    flat = flat.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    out = unit_forward(x, flat)
    (out * dout).sum().backward()
    return out.detach(), x.grad, flat.grad / P                        # mean over ranks of the per-rank sums


@graded(*REFS)
def check_fsdp_unit_grads(cls, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """Output, x gradient and the shard's gradient equal one process (the shard's: rank r's slice of the average)."""
    hint = _("backward: full = gather_full(shard) again; with torch.enable_grad(): recompute y = unit_forward(x, "
             "full) from detached copies that require grad; dx, dfull = torch.autograd.grad(y, (x, full), grad_y); "
             "comm.reduce_scatter(dshard, dfull) then divide by P (the average over ranks, as DDP).")
    names = {"output": _("output"), "x gradient": _("x gradient"), "shard gradient": _("shard gradient")}
    for P in world_sizes:
        seed = fresh_seed()
        res = run_student(_rank_unit, P, cls, seed, timeout=timeout, what="FSDPUnitFn")
        out, xg, fg = _reference(seed, P)
        b = BATCH // P
        for r, got in enumerate(res.results):
            rows = slice(r * b, (r + 1) * b)
            checks = (("output", got["out"], out[rows]), ("x gradient", got["x_grad"], xg[rows]),
                      ("shard gradient", got["shard_grad"], shard_of(fg, r, P)))
            for what, g, w in checks:
                if g is None or g.shape != w.shape or (g - w).abs().max() > TOL:
                    detail = "None" if g is None else (
                        _("shape {shape}, expected {want}").format(shape=tuple(g.shape), want=tuple(w.shape))
                        if g.shape != w.shape else _("off by {err:.3g}").format(err=(g - w).abs().max()))
                    why = ""
                    if what == "shard gradient" and g is not None and g.shape == w.shape:
                        if (g - P * w).abs().max() < TOL:
                            why = _(" It is the SUM over ranks: divide by P (the average, as DDP).")
                        elif g.abs().max() == 0:
                            why = _(" It is all zeros: was the reduce-scatter's output returned?")
                    raise AssertionError(_("FSDPUnitFn on {P} ranks: rank {r}'s {what} is {detail}.{why}\n"
                                           "Hint: {hint}").format(P=P, r=r, what=names[what], detail=detail, why=why,
                                                                  hint=hint))
    print(_("FSDPUnitFn: output, x and shard gradients equal one process on {sizes} ranks").format(
        sizes=", ".join(map(str, world_sizes))))


@graded(*REFS)
def check_fsdp_unit_trace(cls, world_size: int = 4, timeout: float = TIMEOUT) -> None:
    """From the trace: gather in forward, gather + reduce-scatter in backward, 1.5x DDP's bytes; and nothing
    full-size kept between forward and backward."""
    P = world_size
    res = run_student(_rank_unit, P, cls, fresh_seed(), True, timeout=timeout, what="FSDPUnitFn")
    for r in range(P):
        got = res.results[r]
        full = got["shard_numel"] * P
        big = [n for n in got["saved"] if n >= full]
        if big:
            raise AssertionError(_("rank {r} kept a tensor of {numel} elements from forward to backward, the size "
                                   "of the full flat parameters ({full}): ZeRO-3 frees them after forward (in ctx, a "
                                   "global or an attribute alike). Save only x and the shard "
                                   "(ctx.save_for_backward(x, shard)) and all-gather again in backward.").format(
                r=r, numel=big[0], full=full))
        tr = res.trace.filter(rank=r)
        back = next((e.start for e in tr.events if e.kind == "mark" and e.op == "backward"), None)
        events = tr.comm().events
        fwd = [e.op for e in events if back is None or e.start < back]
        bwd = sorted(e.op for e in events if back is not None and e.start >= back)
        if fwd != ["all_gather"] or bwd != ["all_gather", "reduce_scatter"]:
            raise AssertionError(_("rank {r}: forward called {fwd}, backward {bwd}; a ZeRO-3 unit all-gathers in "
                                   "forward, and all-gathers again and reduce-scatters the gradient in "
                                   "backward.").format(r=r, fwd=fwd or _("nothing"), bwd=bwd or _("nothing")))
        sent = sum(wire_bytes(e.op, e.nbytes, P) for e in events)
        ddp = wire_bytes("all_reduce", full * 8, P)
        if abs(sent / ddp - 1.5) > 1e-9:
            raise AssertionError(_("rank {r} sent {sent:.0f} bytes per step, {ratio:.2f}x what DDP's all-reduce of "
                                   "the same parameters sends ({ddp:.0f}); ZeRO-3 sends 1.5x: each collective moves "
                                   "the whole flat vector once (float64, {full} elements).").format(
                r=r, sent=sent, ratio=sent / ddp, ddp=ddp, full=full))
    print(_("FSDPUnitFn on {P} ranks: all-gather forward, all-gather + reduce-scatter backward = 1.5x DDP's bytes; "
            "nothing full-size kept between forward and backward").format(P=P))


protect(__name__)
