"""Checks for exercise 08 (Ulysses all-to-all attention, Jacobs et al., arXiv:2309.14509, section 3).

The student writes (exercises/solutions/08_ulysses.ipynb)

    seq_to_head(x)            (B, nh, S/P, hd) this rank's positions, all heads -> (B, nh/P, S, hd) all positions,
                              this rank's heads: one comm.all_to_all
    head_to_seq(x)            the inverse, (B, nh/P, S, hd) -> (B, nh, S/P, hd)
    ulysses_attention(q, k, v)   q, k, v stacked and re-sharded once, causal attention on this rank's heads,
                              the output re-sharded back; differentiable through the notebook's SeqToHead /
                              HeadToSeq autograd functions (forward: the student's all-to-all; backward: the other)

and each check compares with one process: `check_seq_to_head` / `check_head_to_seq` give every rank its exact
slice of a full tensor drawn fresh at check time; `check_ulysses_attention` compares the output and the gradients
of q, k and v with ``causal_attention`` on the whole sequence (2 and 4 ranks, float64: the same products in the
same order per head, so the results agree to rounding, ~1e-16); `check_ulysses_traffic` reads the trace: exactly
4 all-to-alls per layer (q, k, v fused and the output, forward; their conjugates, backward), each rank moving
4 B S H / P elements each way, and no other communication.
"""
from __future__ import annotations

import torch

from parlab import comm
from parlab.i18n import _
from parlab.models import causal_attention
from parlab.trace import mark
from parlab.course.grading.runner import TIMEOUT, run_student
from parlab.course.grading.guard import fresh_seed, graded, protect

__all__ = ["check_seq_to_head", "check_head_to_seq", "check_ulysses_attention", "check_ulysses_traffic",
           "full_tensors"]

REFS = (   # parlab's own answers: unavailable to the student's code while these checks run
    "parlab.parallel.context.ulysses:seq_to_head",
    "parlab.parallel.context.ulysses:head_to_seq",
    "parlab.parallel.context.ulysses:ulysses_attention",
    "parlab.parallel.context.ulysses:_a2a_seq_to_head",
    "parlab.parallel.context.ulysses:_a2a_head_to_seq",
    "parlab.parallel.context.ulysses:_SeqToHead",
    "parlab.parallel.context.ulysses:_HeadToSeq",
)
B, NH, C, HD = 2, 4, 3, 5          # batch, heads (divisible by 2 and 4), positions per rank, head size
WORLD_SIZES = (2, 4)
TOL = 1e-10                        # float64; attention of each head is computed from the same numbers as one process


def _a2a_hint() -> str:
    return _("split x along the heads into P parts (x.reshape(*L, P, nh // P, s, hd)), put the part index first "
             "(.movedim(-4, 0).contiguous()), comm.all_to_all(recv, send) so that part j goes to rank j, then "
             "join what arrived along the positions (recv[j] holds rank j's positions: .movedim(0, -3) and reshape).")


def full_tensors(S: int, seed: int, n: int = 4) -> list[torch.Tensor]:
    """`n` float64 tensors (B, nh, S, hd), the same on every rank for one seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, NH, S, HD, generator=g, dtype=torch.float64) for _tensor in range(n)]


def _err(a, b) -> float:
    return float((a - b).abs().max()) if a.shape == b.shape else float("inf")


def _seq(t, P, r):                     # this rank's positions, all heads
    c = t.shape[2] // P
    return t[:, :, r * c:(r + 1) * c]


def _heads(t, P, r):                   # all positions, this rank's heads
    h = t.shape[1] // P
    return t[:, r * h:(r + 1) * h]


# ---------------------------------------------------------------------- part 1: the two all-to-alls
def _rank_a2a(fn, seed, direction):
    P, r = comm.get_world_size(), comm.get_rank()
    (x,) = full_tensors(C * P, seed, 1)
    out = fn(_seq(x, P, r).contiguous() if direction == "seq" else _heads(x, P, r).contiguous())
    return out.detach().clone() if isinstance(out, torch.Tensor) else out


def _check_a2a(fn, direction: str, world_sizes, timeout) -> None:
    name = "seq_to_head" if direction == "seq" else "head_to_seq"
    for P in world_sizes:
        seed = fresh_seed()
        res = run_student(_rank_a2a, P, fn, seed, direction, timeout=timeout, what=name)
        (x,) = full_tensors(C * P, seed, 1)
        for r, got in enumerate(res.results):
            want = _heads(x, P, r) if direction == "seq" else _seq(x, P, r)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise AssertionError((_("{name} on {P} ranks: rank {r} returned {shape}, expected {want} (B, nh/P, "
                                        "S, hd) with B={B}, nh={nh}, S={S}, hd={hd}.") if direction == "seq" else
                                      _("{name} on {P} ranks: rank {r} returned {shape}, expected {want} (B, nh, "
                                        "S/P, hd).")).format(name=name, P=P, r=r, shape=shape, want=tuple(want.shape),
                                                             B=B, nh=NH, S=C * P, hd=HD))
            if _err(got, want) > 0:
                why = ""
                if direction == "seq" and _err(got, _heads(_seq(x, P, r).repeat(1, 1, P, 1), P, r)) == 0:
                    why = _(" It holds this rank's own positions P times: nothing was exchanged.")
                raise AssertionError(_("{name} on {P} ranks: rank {r}'s result is not its slice of the full tensor "
                                       "(largest difference {err:.3g}).{why}\nHint: {hint}").format(
                    name=name, P=P, r=r, err=_err(got, want), why=why, hint=_a2a_hint()))
        a2a = [e for e in res.trace.comm().events if e.rank == 0]
        if [e.op for e in a2a] != ["all_to_all"]:
            raise AssertionError(_("{name} on {P} ranks: rank 0 called {ops}; the re-sharding is one comm.all_to_all "
                                   "(traced), nothing else.").format(name=name, P=P,
                                                                    ops=[e.op for e in a2a] or _("nothing")))
    print(_("{name} gives every rank its slice on {sizes} ranks, with one all-to-all").format(
        name=name, sizes=", ".join(map(str, world_sizes))))


@graded(*REFS)
def check_seq_to_head(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """``fn(x)`` on (B, nh, S/P, hd) positions chunk r returns (B, nh/P, S, hd), head group r, on every rank."""
    _check_a2a(fn, "seq", world_sizes, timeout)


@graded(*REFS)
def check_head_to_seq(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """``fn(x)`` on (B, nh/P, S, hd) head group r returns (B, nh, S/P, hd), positions chunk r, on every rank."""
    _check_a2a(fn, "head", world_sizes, timeout)


# ---------------------------------------------------------------------- part 2: attention
def _rank_attention(fn, seed):
    P, r = comm.get_world_size(), comm.get_rank()
    q, k, v, dout = full_tensors(C * P, seed)
    q, k, v = (_seq(t, P, r).clone().requires_grad_(True) for t in (q, k, v))   # (B, nh, S/P, hd) each
    out = fn(q, k, v)
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return {"out": out if not isinstance(out, torch.Tensor) else out.detach(), "grads": None}
    mark("backward")
    (out * _seq(dout, P, r)).sum().backward()
    return {"out": out.detach().clone(), "grads": [None if t.grad is None else t.grad.clone() for t in (q, k, v)]}


def _reference(seed, S):
    q, k, v, dout = full_tensors(S, seed)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = causal_attention(q, k, v, causal=True)                    # (B, nh, S, hd)
    (out * dout).sum().backward()
    return out.detach(), [q.grad, k.grad, v.grad]


@graded(*REFS)
def check_ulysses_attention(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """The output and the gradients of q, k, v on every rank equal causal attention on the whole sequence."""
    hint = _("qkv = SeqToHead.apply(torch.stack([q, k, v]))  # (3, B, nh/P, S, hd); out = causal_attention(qkv[0], "
             "qkv[1], qkv[2]); return HeadToSeq.apply(out)  # (B, nh, S/P, hd). The autograd functions make the "
             "backward run the conjugate all-to-alls.")
    for P in world_sizes:
        seed = fresh_seed()
        res = run_student(_rank_attention, P, fn, seed, timeout=timeout, what="ulysses_attention")
        out, grads = _reference(seed, C * P)
        for r, got in enumerate(res.results):
            want = _seq(out, P, r)
            o = got["out"]
            if not isinstance(o, torch.Tensor) or o.shape != want.shape:
                shape = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
                raise AssertionError(_("ulysses_attention on {P} ranks: rank {r} returned {shape}, expected {want} "
                                       "(B, nh, S/P, hd), this rank's positions.\nHint: {hint}").format(
                    P=P, r=r, shape=shape, want=tuple(want.shape), hint=hint))
            if _err(o, want) > TOL:
                own = causal_attention(*(_seq(t, P, r) for t in full_tensors(C * P, seed)[:3]))
                why = (_(" It is attention over this rank's own positions only: the keys of the other ranks are "
                         "missing (no all-to-all before attention?).") if _err(o, own) < TOL else "")
                raise AssertionError(_("ulysses_attention on {P} ranks: rank {r}'s output differs from causal "
                                       "attention on the whole sequence by {err:.3g}.{why}\nHint: {hint}").format(
                    P=P, r=r, err=_err(o, want), why=why, hint=hint))
        for r, got in enumerate(res.results):                # outputs of every rank first, then gradients
            if got["grads"] is None:
                raise AssertionError(_("ulysses_attention on {P} ranks: the output does not require grad, so no "
                                       "gradient reaches q, k, v. Use the autograd functions SeqToHead / HeadToSeq "
                                       "(not the plain all-to-alls) around attention.\nHint: {hint}").format(
                    P=P, hint=hint))
            for name, g, w in zip("qkv", got["grads"], grads):
                w = _seq(w, P, r)
                if g is None or _err(g, w) > TOL:
                    err = "None" if g is None else _("off by {err:.3g}").format(err=_err(g, w))
                    raise AssertionError(_("ulysses_attention on {P} ranks: rank {r}'s gradient of {name} is {err}, "
                                           "expected that of one process on the whole sequence. The backward of "
                                           "SeqToHead must be head_to_seq and that of HeadToSeq seq_to_head.\n"
                                           "Hint: {hint}").format(P=P, r=r, name=name, err=err, hint=hint))
    print(_("ulysses_attention: output and q, k, v gradients equal one process on {sizes} ranks").format(
        sizes=", ".join(map(str, world_sizes))))


@graded(*REFS)
def check_ulysses_traffic(fn, world_size: int = 4, timeout: float = TIMEOUT) -> None:
    """From the trace: 4 all-to-alls per layer (2 forward, 2 backward), 4 B S H / P elements each way, nothing else."""
    P = world_size
    res = run_student(_rank_attention, P, fn, fresh_seed(), timeout=timeout, what="ulysses_attention")
    elems = 4 * B * C * NH * HD                                         # 4 B S H / P, S/P = C, H = nh hd
    for r in range(P):
        tr = res.trace.filter(rank=r)
        events = tr.comm().events
        others = sorted({e.op for e in events if e.op != "all_to_all"})
        if others:
            raise AssertionError(_("rank {r} called comm.{ops}; Ulysses only re-shards with all-to-alls (attention "
                                   "itself is local once a rank holds whole heads).").format(
                r=r, ops=", comm.".join(others)))
        back = next((e.start for e in tr.events if e.kind == "mark" and e.op == "backward"), None)
        fwd = [e for e in events if back is None or e.start < back]
        bwd = [e for e in events if back is not None and e.start >= back]
        if (len(fwd), len(bwd)) != (2, 2):
            fused = (_(" Three all-to-alls in forward means q, k and v travel separately: stack them "
                       "(torch.stack([q, k, v])) and re-shard once.") if len(fwd) == 4 else "")
            raise AssertionError(_("rank {r} made {fwd} all-to-alls in forward and {bwd} in backward; one Ulysses "
                                   "layer makes 2 + 2 = 4: q, k, v together and the output in forward, and their "
                                   "conjugates in backward.{fused}").format(r=r, fwd=len(fwd), bwd=len(bwd),
                                                                           fused=fused))
        for phase, evs in (("forward", fwd), ("backward", bwd)):
            got = sum(e.nbytes for e in evs) // 8                      # float64
            if got != elems:
                raise AssertionError((_("rank {r} all-to-alled {got} elements in forward; expected 4 B S H / P = "
                                        "{elems} (q, k, v and the output, each B x S/P x H = {each}). Send each "
                                        "tensor once, in the dtype it has.") if phase == "forward" else
                                      _("rank {r} all-to-alled {got} elements in backward; expected 4 B S H / P = "
                                        "{elems} (q, k, v and the output, each B x S/P x H = {each}). Send each "
                                        "tensor once, in the dtype it has.")).format(
                    r=r, got=got, elems=elems, each=B * C * NH * HD))
    print(_("ulysses_attention: 4 all-to-alls per layer on {P} ranks, {elems} elements each way per rank").format(
        P=P, elems=elems))


protect(__name__)
