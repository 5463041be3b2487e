"""Checks for exercise 06 (ring attention): the online-softmax merge, one ring step, the zigzag layout.

    check_merge_partials(merge_partials)        two partial attentions over disjoint keys -> the full one,
                                                also when exp(score) overflows float32
    check_ring_step(ring_step)                  a ring forward built from the student's step equals full
                                                attention on 2, 3 and 4 ranks
    check_ring_traffic(ring_step)               from the trace: p2p only, to rank r+1 only, P-1 K/V blocks
    check_zigzag_chunks(zigzag_chunks)          rank r holds half-chunks r and 2P-1-r of 2P (P = 1..8)
    check_zigzag_positions(zigzag_positions)    the positions those chunks hold, as parlab.parallel.context.ring

Every check compares with parlab's reference (``parlab.parallel.context.ring`` and one-process attention) in float64
and explains the likely mistake: an average instead of a log-sum-exp weighting, a naive merge that overflows,
a rank that never received a block, a layout that is not balanced.
"""
from __future__ import annotations

from itertools import combinations

import torch

from parlab import comm
from parlab.i18n import _
from parlab.parallel.context import ring as ra
from parlab.models import causal_attention
from parlab.course.grading.runner import TIMEOUT, call_student, run_student
from parlab.course.grading.guard import fresh_seed, graded, protect

RING_REFS = ("parlab.parallel.context.ring:merge_partials", "parlab.parallel.context.ring:ring_attention",
             "parlab.parallel.context.ring:RingAttention")
ZIGZAG_REFS = (   # parlab's own answers: unavailable to the student's code while these checks run
    "parlab.parallel.context.ring:chunk_ids",
    "parlab.parallel.context.ring:shard_positions",
    "parlab.parallel.context.ring:shard_sequence",
)

__all__ = ["check_merge_partials", "check_ring_step", "check_ring_traffic", "check_zigzag_chunks",
           "check_zigzag_positions", "ring_forward_with", "qkv"]

B, NH, C, HD = 1, 2, 4, 8            # batch, heads, positions per rank, head dim
WORLD_SIZES = (2, 3, 4)


def qkv(S: int, seed: int = 0, dtype=torch.float64) -> list[torch.Tensor]:
    """The full q, k, v (B, nh, S, hd) every rank starts from (one seed, so the same on all ranks)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, NH, S, HD, generator=g, dtype=dtype) for _tensor in range(3)]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------- part 1: the merge
def _explain_merge(out, o1, l1, o2, l2) -> str:
    w1 = torch.exp(l1 - torch.logaddexp(l1, l2)).unsqueeze(-1)
    guesses = [
        (_("Your out is the plain average (o1 + o2) / 2: each part must be weighted by its share of the softmax "
           "mass, exp(lse1 - lse) and exp(lse2 - lse)."), (o1 + o2) / 2),
        (_("Your out is the sum o1 + o2: the weights exp(lse_i - lse) are missing."), o1 + o2),
        (_("Your weights are swapped: o1 must be weighted by exp(lse1 - lse), o2 by exp(lse2 - lse)."),
         (1 - w1) * o1 + w1 * o2),
        (_("Your out is o1 unchanged: the second part was not merged in."), o1),
        (_("Your out is o2 only: the first part was overwritten instead of merged."), o2),
    ]
    for text, t in guesses:
        if t.shape == out.shape and _err(out, t) < 1e-9:
            return text
    return _("Your out is none of the usual mistakes; compare it with the formula term by term.")


@graded(*RING_REFS)
def check_merge_partials(fn) -> None:
    """``fn(out1, lse1, out2, lse2) -> (out, lse)``: the attention over the union of the two key sets."""
    formula = "lse = log(exp(lse1) + exp(lse2)) (torch.logaddexp); out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2"
    q, k, v = qkv(16, seed=1)
    for cut in (8, 3, 13):
        o1, l1 = ra.attention_block(q, k[..., :cut, :], v[..., :cut, :])
        o2, l2 = ra.attention_block(q, k[..., cut:, :], v[..., cut:, :])
        where = _("merge_partials, keys 0..{last} and {cut}..15 of 16 (float64)").format(last=cut - 1, cut=cut)
        got = call_student(fn, o1, l1, o2, l2, what="merge_partials")
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise AssertionError(_("{where}: return a pair (out, lse), got {kind}.").format(
                where=where, kind=type(got).__name__))
        out, lse = got
        want_out = causal_attention(q, k, v, causal=False)                          # (B, nh, 16, hd)
        want_lse = torch.logsumexp(q @ k.transpose(-2, -1) / HD ** 0.5, dim=-1)     # (B, nh, 16)
        for name, g, w in (("out", out, want_out), ("lse", lse, want_lse)):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape:
                shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                raise AssertionError(_("{where}: {name} has shape {shape}, expected {want} (the same shape as "
                                       "{name}1).").format(where=where, name=name, shape=shape, want=tuple(w.shape)))
        if _err(lse, want_lse) > 1e-10:
            m = torch.maximum(l1, l2)
            hint = (_(" It equals max(lse1, lse2): the max is only the stable *shift*; lse adds the two masses.")
                    if _err(lse, m) < 1e-12 else "")
            raise AssertionError(_("{where}: lse is wrong (max error {err:.2e}); expected {want}, got {got}.{why}\n"
                                   "Hint: {formula}.").format(where=where, err=_err(lse, want_lse),
                                                              want=want_lse.flatten()[:3].tolist(),
                                                              got=lse.flatten()[:3].tolist(), why=hint,
                                                              formula=formula))
        if _err(out, want_out) > 1e-10:
            raise AssertionError(_("{where}: out differs from full attention by up to {err:.2e}. {why}\n"
                                   "Hint: {formula}.").format(where=where, err=_err(out, want_out),
                                                              why=_explain_merge(out, o1, l1, o2, l2), formula=formula))
    # scores shifted by 100 leave softmax unchanged; in float32 exp(100) = inf breaks the naive formula
    o1, l1 = ra.attention_block(q, k[..., :8, :], v[..., :8, :])
    o2, l2 = ra.attention_block(q, k[..., 8:, :], v[..., 8:, :])
    f32 = [o1.float(), (l1 + 100).float(), o2.float(), (l2 + 100).float()]
    out, lse = call_student(fn, *f32, what="merge_partials")
    if not bool(torch.isfinite(out).all() and torch.isfinite(lse).all()):
        raise AssertionError(_("merge_partials overflows: with every score raised by 100 (the softmax does not "
                               "change) in float32, your result holds inf or nan, because exp(lse) = exp(100+) "
                               "overflows float32 (max ~3.4e38 = e^88).\nHint: never exponentiate lse itself; use "
                               "lse = torch.logaddexp(lse1, lse2) and the weights exp(lse1 - lse), exp(lse2 - lse), "
                               "which are <= 1."))
    if _err(out, causal_attention(q, k, v, causal=False)) > 1e-5:
        raise AssertionError(_("merge_partials in float32 with large scores is off by {err:.1e}. Hint: "
                               "{formula}.").format(err=_err(out, causal_attention(q, k, v, causal=False)),
                                                    formula=formula))
    print(_("merge_partials equals full attention for 3 key splits, and stays finite when exp(score) overflows"))


# ---------------------------------------------------------------------- part 2: one ring step
def ring_forward_with(ring_step, q, k, v):
    """The driver of the exercise: P calls of the student's ring_step; returns this rank's output."""
    kv = torch.stack([k, v])                                  # (2, B, nh, c, hd)
    out = lse = None
    for step in range(comm.get_world_size()):
        got = ring_step(q, kv, out, lse, step)
        if not (isinstance(got, (tuple, list)) and len(got) == 3):
            raise TypeError(_("ring_step must return (out, lse, kv), got {kind}").format(kind=type(got).__name__))
        out, lse, kv = got
    return out


def _rank_ring(ring_step, seed):
    P, r = comm.get_world_size(), comm.get_rank()
    q, k, v = (ra.shard_sequence(t, P, r, "contiguous", dim=2) for t in qkv(C * P, seed=seed))
    out = ring_forward_with(ring_step, q, k, v)
    return out.detach().clone() if isinstance(out, torch.Tensor) else out


def _explain_ring(got, r, P, seed) -> str:
    q, k, v = qkv(C * P, seed=seed)
    qr = q[..., r * C:(r + 1) * C, :]
    for m in range(P - 1, 0, -1):
        for srcs in combinations(range(P), m):
            idx = torch.cat([torch.arange(s * C, (s + 1) * C) for s in srcs])
            part = causal_attention(qr, k[..., idx, :], v[..., idx, :], causal=False)  # noqa: keys of srcs only
            if _err(got, part) < 1e-9:
                if srcs == (r,):
                    return _("It is attention over this rank's own K/V block only: the blocks received from the "
                             "ring were never used (return the received buffer as the next kv) or never merged.")
                return _("It is attention over the K/V blocks of ranks {ranks} only; the blocks of ranks {missing} "
                         "are missing (a block overwritten instead of merged, or the wrong buffer passed on).").format(
                    ranks=list(srcs), missing=sorted(set(range(P)) - set(srcs)))
    return _("It is not attention over any subset of the blocks (check the merge and which block you attend to).")


@graded(*RING_REFS)
def check_ring_step(ring_step, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """The ring forward driven by ``ring_step`` gives every rank its rows of full (non-causal) attention."""
    hint = _("at each step: if step < P-1, start comm.isend(kv, (r+1) % P) and comm.irecv(buf, (r-1) % P); attend "
             "q to kv (ra.attention_block(q, kv[0], kv[1])); merge into (out, lse) (at step 0 just take it); wait for "
             "both requests; return (out, lse, buf) (or kv itself on the last step).")
    for P in world_sizes:
        seed = fresh_seed()                                             # drawn now: no rank can rebuild q, k, v
        res = run_student(_rank_ring, P, ring_step, seed, timeout=timeout, what="ring_step")
        q, k, v = qkv(C * P, seed=seed)
        full = causal_attention(q, k, v, causal=False)                  # (B, nh, S, hd)
        for r, got in enumerate(res.results):
            want = full[..., r * C:(r + 1) * C, :]
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise AssertionError(_("ring_step on {P} ranks: rank {r}'s output has shape {shape}, expected "
                                       "{want} (B, nh, c, hd).\nHint: {hint}").format(
                    P=P, r=r, shape=shape, want=tuple(want.shape), hint=hint))
            if _err(got, want) > 1e-10:
                raise AssertionError(_("ring_step on {P} ranks: rank {r}'s output differs from full attention by up "
                                       "to {err:.2e}. {why}\nHint: {hint}").format(
                    P=P, r=r, err=_err(got, want), why=_explain_ring(got, r, P, seed), hint=hint))
    print(_("ring attention built from ring_step equals full attention on {sizes} ranks").format(
        sizes=", ".join(map(str, world_sizes))))


@graded(*RING_REFS)
def check_ring_traffic(ring_step, world_size: int = 4, timeout: float = TIMEOUT) -> None:
    """From the trace: only send/recv, each rank sends only to rank r+1, exactly P-1 messages of one K/V block."""
    P = world_size
    res = run_student(_rank_ring, P, ring_step, fresh_seed(), timeout=timeout, what="ring_step")
    events = res.trace.comm().events
    collectives = sorted({e.op for e in events if e.kind == "collective"})
    if collectives:
        raise AssertionError(_("ring_step called comm.{ops}: ring attention passes K/V blocks point to point. "
                               "Hint: comm.isend / comm.irecv.").format(ops=", comm.".join(collectives)))
    if not events:
        raise AssertionError(_("the trace shows no messages: send with parlab.comm (comm.isend, comm.irecv), not "
                               "torch.distributed directly, so that they are traced."))
    block = 2 * B * NH * C * HD * 8                                   # one K/V block, float64
    for r in range(P):
        sends = [e for e in events if e.rank == r and e.op == "send"]
        peers = sorted({e.peer for e in sends})
        if peers != [(r + 1) % P]:
            raise AssertionError(_("rank {r} sent to ranks {peers}; in the ring each rank sends only to the next "
                                   "one, (r+1) % P = {next}, and receives from (r-1) % P = {prev}.").format(
                r=r, peers=peers, next=(r + 1) % P, prev=(r - 1) % P))
        sizes = sorted({e.nbytes for e in sends})
        if sizes != [block]:
            raise AssertionError(_("rank {r} sent messages of {sizes} bytes; each message is one K/V block, "
                                   "kv = torch.stack([k, v]) of {block} bytes (2 x B x nh x c x hd x 8). Send K and V "
                                   "together in one message, and nothing else.").format(r=r, sizes=sizes, block=block))
        if len(sends) != P - 1:
            extra = (_(" The last step's block has nowhere useful to go: every rank has seen every block after "
                       "P-1 hops, so skip the send and receive when step == P-1.") if len(sends) > P - 1 else
                     _(" Send at every step except the last."))
            raise AssertionError(_("rank {r} sent {n} K/V blocks on {P} ranks; a ring forward needs P-1 = "
                                   "{want}.{extra}").format(r=r, n=len(sends), P=P, want=P - 1, extra=extra))
    print(_("ring_step sends (P-1) = {n} K/V blocks of {block} bytes per rank, only to the next rank").format(
        n=P - 1, block=block))


# ---------------------------------------------------------------------- part 3: zigzag
def _causal_work(chunks: list[int]) -> float:
    """Causal score work of a rank holding these half-chunks, in (half-chunk x half-chunk) blocks:
    query half-chunk i sees the i earlier half-chunks fully and its own diagonal half."""
    return sum(i + 0.5 for i in chunks)


@graded("parlab.parallel.context.ring:chunk_ids", "parlab.parallel.context.ring:shard_positions")
def check_zigzag_chunks(fn, sizes=range(1, 9)) -> None:
    """``fn(rank, P)`` returns the two half-chunks (of 2P) rank `rank` holds: [rank, 2P-1-rank]."""
    hint = _("pair an early half-chunk with the matching late one: rank r holds r and 2P-1-r.")
    for P in sizes:
        got = {}
        for r in range(P):
            ch = call_student(fn, r, P, what="zigzag_chunks")
            try:
                got[r] = sorted(int(i) for i in ch)
            except TypeError:
                raise AssertionError(_("zigzag_chunks({r}, {P}) returned {got!r}; expected a list of two chunk "
                                       "indices.").format(r=r, P=P, got=ch)) from None
        where = _("zigzag_chunks on P={P} ranks ({n} half-chunks)").format(P=P, n=2 * P)
        for r, ch in got.items():
            if len(ch) != 2:
                raise AssertionError(_("{where}: rank {r} holds {chunks}; every rank holds exactly two half-chunks. "
                                       "Hint: {hint}").format(where=where, r=r, chunks=ch, hint=hint))
        seen = sorted(i for ch in got.values() for i in ch)
        if seen != list(range(2 * P)):
            missing = sorted(set(range(2 * P)) - set(seen))
            twice = sorted({i for i in seen if seen.count(i) > 1})
            raise AssertionError(_("{where}: the ranks hold {held}; half-chunks {missing} belong to no rank and "
                                   "{twice} to more than one (or out of range 0..{last}). Every half-chunk must be "
                                   "held exactly once. Hint: {hint}").format(
                where=where, held=dict(got), missing=missing, twice=twice, last=2 * P - 1, hint=hint))
        work = {r: _causal_work(ch) for r, ch in got.items()}
        if len(set(work.values())) > 1:
            lo, hi = min(work, key=work.get), max(work, key=work.get)
            raise AssertionError(_("{where}: the ranks hold {held}, which is not balanced under a causal mask: rank "
                                   "{lo} computes {lo_work:g} and rank {hi} {hi_work:g} half-chunk blocks of scores "
                                   "(half-chunk i sees i + 1/2 blocks). Hint: {hint}").format(
                where=where, held=dict(got), lo=lo, lo_work=work[lo], hi=hi, hi_work=work[hi], hint=hint))
        for r, ch in got.items():
            if ch != ra.chunk_ids(r, P, "zigzag"):
                raise AssertionError(_("{where}: your assignment {held} is balanced, but ring attention's schedule "
                                       "(ra.block_plan) assumes the zigzag convention: rank {r} must hold {want}, got "
                                       "{got}. Hint: {hint}").format(where=where, held=dict(got), r=r,
                                                                    want=ra.chunk_ids(r, P, "zigzag"), got=ch,
                                                                    hint=hint))
    print(_("zigzag_chunks is the balanced zigzag layout for P = {lo}..{hi}").format(lo=min(sizes), hi=max(sizes)))


@graded(*ZIGZAG_REFS)
def check_zigzag_positions(fn, cases=((8, 2), (16, 4), (24, 3), (48, 4), (16, 8))) -> None:
    """``fn(S, P, rank)`` returns the positions rank `rank` holds: a (S/P,) tensor, increasing."""
    for S, P in cases:
        for r in range(P):
            got = call_student(fn, S, P, r, what="zigzag_positions")
            want = ra.shard_positions(S, P, r, "zigzag")
            got_t = torch.as_tensor(got).reshape(-1) if not isinstance(got, torch.Tensor) else got.reshape(-1)
            if got_t.shape == want.shape and torch.equal(got_t.long(), want):
                continue
            where = f"zigzag_positions(S={S}, P={P}, rank={r})"
            size = S // (2 * P)
            if got_t.numel() == want.numel() and torch.equal(torch.sort(got_t.long()).values, want):
                raise AssertionError(_("{where}: right positions, wrong order: {got}; keep them increasing (front "
                                       "half-chunk first) so the local causal mask is a plain lower triangle.").format(
                    where=where, got=got_t.tolist()))
            raise AssertionError(_("{where}: expected {want}, got {got}.\nHint: half-chunk j holds positions "
                                   "j*S/(2P) .. (j+1)*S/(2P) - 1 (here {size} positions each); concatenate those of "
                                   "zigzag_chunks({r}, {P}).").format(where=where, want=want.tolist(),
                                                                      got=got_t.tolist(), size=size, r=r, P=P))
    print(_("zigzag_positions matches parlab.parallel.context.ring.shard_positions for {n} (S, P) cases").format(
        n=len(cases)))


protect(__name__)
