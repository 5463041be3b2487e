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
from parlab.parallel.context import ring as ra
from parlab.models import causal_attention
from parlab.course.grading import TIMEOUT, call_student, run_student
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
    return [torch.randn(B, NH, S, HD, generator=g, dtype=dtype) for _ in range(3)]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------------- part 1: the merge
def _explain_merge(out, o1, l1, o2, l2) -> str:
    w1 = torch.exp(l1 - torch.logaddexp(l1, l2)).unsqueeze(-1)
    guesses = {
        "Your out is the plain average (o1 + o2) / 2: each part must be weighted by its share of the softmax "
        "mass, exp(lse1 - lse) and exp(lse2 - lse).": (o1 + o2) / 2,
        "Your out is the sum o1 + o2: the weights exp(lse_i - lse) are missing.": o1 + o2,
        "Your weights are swapped: o1 must be weighted by exp(lse1 - lse), o2 by exp(lse2 - lse).":
            (1 - w1) * o1 + w1 * o2,
        "Your out is o1 unchanged: the second part was not merged in.": o1,
        "Your out is o2 only: the first part was overwritten instead of merged.": o2,
    }
    for text, t in guesses.items():
        if t.shape == out.shape and _err(out, t) < 1e-9:
            return text
    return "Your out is none of the usual mistakes; compare it with the formula term by term."


@graded(*RING_REFS)
def check_merge_partials(fn) -> None:
    """``fn(out1, lse1, out2, lse2) -> (out, lse)``: the attention over the union of the two key sets."""
    formula = "lse = log(exp(lse1) + exp(lse2)) (torch.logaddexp); out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2"
    q, k, v = qkv(16, seed=1)
    for cut in (8, 3, 13):
        o1, l1 = ra.attention_block(q, k[..., :cut, :], v[..., :cut, :])
        o2, l2 = ra.attention_block(q, k[..., cut:, :], v[..., cut:, :])
        where = f"merge_partials, keys 0..{cut - 1} and {cut}..15 of 16 (float64)"
        got = call_student(fn, o1, l1, o2, l2, what="merge_partials")
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise AssertionError(f"{where}: return a pair (out, lse), got {type(got).__name__}.")
        out, lse = got
        want_out = causal_attention(q, k, v, causal=False)                          # (B, nh, 16, hd)
        want_lse = torch.logsumexp(q @ k.transpose(-2, -1) / HD ** 0.5, dim=-1)     # (B, nh, 16)
        for name, g, w in (("out", out, want_out), ("lse", lse, want_lse)):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape:
                shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                raise AssertionError(f"{where}: {name} has shape {shape}, expected {tuple(w.shape)} (the same "
                                     f"shape as {name}1).")
        if _err(lse, want_lse) > 1e-10:
            m = torch.maximum(l1, l2)
            hint = (" It equals max(lse1, lse2): the max is only the stable *shift*; lse adds the two masses."
                    if _err(lse, m) < 1e-12 else "")
            raise AssertionError(f"{where}: lse is wrong (max error {_err(lse, want_lse):.2e}); expected "
                                 f"{want_lse.flatten()[:3].tolist()}, got {lse.flatten()[:3].tolist()}.{hint}\n"
                                 f"Hint: {formula}.")
        if _err(out, want_out) > 1e-10:
            raise AssertionError(f"{where}: out differs from full attention by up to {_err(out, want_out):.2e}. "
                                 f"{_explain_merge(out, o1, l1, o2, l2)}\nHint: {formula}.")
    # scores shifted by 100 leave softmax unchanged; in float32 exp(100) = inf breaks the naive formula
    o1, l1 = ra.attention_block(q, k[..., :8, :], v[..., :8, :])
    o2, l2 = ra.attention_block(q, k[..., 8:, :], v[..., 8:, :])
    f32 = [o1.float(), (l1 + 100).float(), o2.float(), (l2 + 100).float()]
    out, lse = call_student(fn, *f32, what="merge_partials")
    if not bool(torch.isfinite(out).all() and torch.isfinite(lse).all()):
        raise AssertionError("merge_partials overflows: with every score raised by 100 (the softmax does not change) "
                             "in float32, your result holds inf or nan, because exp(lse) = exp(100+) overflows "
                             "float32 (max ~3.4e38 = e^88).\nHint: never exponentiate lse itself; use "
                             "lse = torch.logaddexp(lse1, lse2) and the weights exp(lse1 - lse), exp(lse2 - lse), "
                             "which are <= 1.")
    if _err(out, causal_attention(q, k, v, causal=False)) > 1e-5:
        raise AssertionError(f"merge_partials in float32 with large scores is off by "
                             f"{_err(out, causal_attention(q, k, v, causal=False)):.1e}. Hint: {formula}.")
    print("merge_partials equals full attention for 3 key splits, and stays finite when exp(score) overflows")


# ---------------------------------------------------------------------- part 2: one ring step
def ring_forward_with(ring_step, q, k, v):
    """The driver of the exercise: P calls of the student's ring_step; returns this rank's output."""
    kv = torch.stack([k, v])                                  # (2, B, nh, c, hd)
    out = lse = None
    for step in range(comm.get_world_size()):
        got = ring_step(q, kv, out, lse, step)
        if not (isinstance(got, (tuple, list)) and len(got) == 3):
            raise TypeError(f"ring_step must return (out, lse, kv), got {type(got).__name__}")
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
                    return ("It is attention over this rank's own K/V block only: the blocks received from the "
                            "ring were never used (return the received buffer as the next kv) or never merged.")
                return (f"It is attention over the K/V blocks of ranks {list(srcs)} only; the blocks of ranks "
                        f"{sorted(set(range(P)) - set(srcs))} are missing (a block overwritten instead of merged, "
                        f"or the wrong buffer passed on).")
    return "It is not attention over any subset of the blocks (check the merge and which block you attend to)."


@graded(*RING_REFS)
def check_ring_step(ring_step, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """The ring forward driven by ``ring_step`` gives every rank its rows of full (non-causal) attention."""
    hint = ("at each step: if step < P-1, start comm.isend(kv, (r+1) % P) and comm.irecv(buf, (r-1) % P); attend q "
            "to kv (ra.attention_block(q, kv[0], kv[1])); merge into (out, lse) (at step 0 just take it); wait for "
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
                raise AssertionError(f"ring_step on {P} ranks: rank {r}'s output has shape {shape}, expected "
                                     f"{tuple(want.shape)} (B, nh, c, hd).\nHint: {hint}")
            if _err(got, want) > 1e-10:
                raise AssertionError(f"ring_step on {P} ranks: rank {r}'s output differs from full attention by up "
                                     f"to {_err(got, want):.2e}. {_explain_ring(got, r, P, seed)}\nHint: {hint}")
    print(f"ring attention built from ring_step equals full attention on {', '.join(map(str, world_sizes))} ranks")


@graded(*RING_REFS)
def check_ring_traffic(ring_step, world_size: int = 4, timeout: float = TIMEOUT) -> None:
    """From the trace: only send/recv, each rank sends only to rank r+1, exactly P-1 messages of one K/V block."""
    P = world_size
    res = run_student(_rank_ring, P, ring_step, fresh_seed(), timeout=timeout, what="ring_step")
    events = res.trace.comm().events
    collectives = sorted({e.op for e in events if e.kind == "collective"})
    if collectives:
        raise AssertionError(f"ring_step called comm.{', comm.'.join(collectives)}: ring attention passes K/V "
                             f"blocks point to point. Hint: comm.isend / comm.irecv.")
    if not events:
        raise AssertionError("the trace shows no messages: send with parlab.comm (comm.isend, comm.irecv), not "
                             "torch.distributed directly, so that they are traced.")
    block = 2 * B * NH * C * HD * 8                                   # one K/V block, float64
    for r in range(P):
        sends = [e for e in events if e.rank == r and e.op == "send"]
        peers = sorted({e.peer for e in sends})
        if peers != [(r + 1) % P]:
            raise AssertionError(f"rank {r} sent to ranks {peers}; in the ring each rank sends only to the next "
                                 f"one, (r+1) % P = {(r + 1) % P}, and receives from (r-1) % P = {(r - 1) % P}.")
        sizes = sorted({e.nbytes for e in sends})
        if sizes != [block]:
            raise AssertionError(f"rank {r} sent messages of {sizes} bytes; each message is one K/V block, "
                                 f"kv = torch.stack([k, v]) of {block} bytes (2 x B x nh x c x hd x 8). Send "
                                 f"K and V together in one message, and nothing else.")
        if len(sends) != P - 1:
            extra = (" The last step's block has nowhere useful to go: every rank has seen every block after "
                     "P-1 hops, so skip the send and receive when step == P-1." if len(sends) > P - 1 else
                     " Send at every step except the last.")
            raise AssertionError(f"rank {r} sent {len(sends)} K/V blocks on {P} ranks; a ring forward needs "
                                 f"P-1 = {P - 1}.{extra}")
    print(f"ring_step sends (P-1) = {P - 1} K/V blocks of {block} bytes per rank, only to the next rank")


# ---------------------------------------------------------------------- part 3: zigzag
def _causal_work(chunks: list[int]) -> float:
    """Causal score work of a rank holding these half-chunks, in (half-chunk x half-chunk) blocks:
    query half-chunk i sees the i earlier half-chunks fully and its own diagonal half."""
    return sum(i + 0.5 for i in chunks)


@graded("parlab.parallel.context.ring:chunk_ids", "parlab.parallel.context.ring:shard_positions")
def check_zigzag_chunks(fn, sizes=range(1, 9)) -> None:
    """``fn(rank, P)`` returns the two half-chunks (of 2P) rank `rank` holds: [rank, 2P-1-rank]."""
    hint = "pair an early half-chunk with the matching late one: rank r holds r and 2P-1-r."
    for P in sizes:
        got = {}
        for r in range(P):
            ch = call_student(fn, r, P, what="zigzag_chunks")
            try:
                got[r] = sorted(int(i) for i in ch)
            except TypeError:
                raise AssertionError(f"zigzag_chunks({r}, {P}) returned {ch!r}; expected a list of two chunk "
                                     f"indices.") from None
        where = f"zigzag_chunks on P={P} ranks ({2 * P} half-chunks)"
        for r, ch in got.items():
            if len(ch) != 2:
                raise AssertionError(f"{where}: rank {r} holds {ch}; every rank holds exactly two half-chunks. "
                                     f"Hint: {hint}")
        seen = sorted(i for ch in got.values() for i in ch)
        if seen != list(range(2 * P)):
            missing = sorted(set(range(2 * P)) - set(seen))
            twice = sorted({i for i in seen if seen.count(i) > 1})
            raise AssertionError(f"{where}: the ranks hold {dict(got)}; half-chunks {missing} belong to no rank and "
                                 f"{twice} to more than one (or out of range 0..{2 * P - 1}). Every half-chunk "
                                 f"must be held exactly once. Hint: {hint}")
        work = {r: _causal_work(ch) for r, ch in got.items()}
        if len(set(work.values())) > 1:
            lo, hi = min(work, key=work.get), max(work, key=work.get)
            raise AssertionError(f"{where}: the ranks hold {dict(got)}, which is not balanced under a causal mask: "
                                 f"rank {lo} computes {work[lo]:g} and rank {hi} {work[hi]:g} half-chunk blocks of "
                                 f"scores (half-chunk i sees i + 1/2 blocks). Hint: {hint}")
        for r, ch in got.items():
            if ch != ra.chunk_ids(r, P, "zigzag"):
                raise AssertionError(f"{where}: your assignment {dict(got)} is balanced, but ring attention's "
                                     f"schedule (ra.block_plan) assumes the zigzag convention: rank {r} must hold "
                                     f"{ra.chunk_ids(r, P, 'zigzag')}, got {ch}. Hint: {hint}")
    print(f"zigzag_chunks is the balanced zigzag layout for P = {min(sizes)}..{max(sizes)}")


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
                raise AssertionError(f"{where}: right positions, wrong order: {got_t.tolist()}; keep them "
                                     f"increasing (front half-chunk first) so the local causal mask is a plain "
                                     f"lower triangle.")
            raise AssertionError(f"{where}: expected {want.tolist()}, got {got_t.tolist()}.\nHint: half-chunk j "
                                 f"holds positions j*S/(2P) .. (j+1)*S/(2P) - 1 (here {size} positions each); "
                                 f"concatenate those of zigzag_chunks({r}, {P}).")
    print(f"zigzag_positions matches parlab.parallel.context.ring.shard_positions for {len(cases)} (S, P) cases")


protect(__name__)
