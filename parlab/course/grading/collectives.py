"""Checks for exercise 00: the ring collectives built from point-to-point messages (Patarasuk & Yuan 2009).

The student writes ``ring_reduce_scatter(chunks)``, ``ring_all_gather(chunks)`` and ``ring_all_reduce(x)`` with
comm.send / comm.recv only, and

    check_ring_reduce_scatter       chunk r of rank r holds the sum of chunk r over all ranks
    check_ring_all_gather           from the reduced chunk r on rank r, every rank ends with every reduced chunk
    check_ring_all_reduce           every rank ends with the sum of x over all ranks
    check_ring_all_reduce_traffic   the trace: each rank talks to one neighbour, 2(N-1) messages of size/N

run it on 2, 3 and 4 simulated ranks. Inputs (`rank_input`) are integers stored as float64, so sums are exact in any
order and a wrong chunk can be explained exactly (`_explain_chunk`: "chunk 2 holds the sum of ranks [1, 2] only");
a built-in collective in the trace earns nothing (`_messages_only`).
"""
from __future__ import annotations

from itertools import combinations

import torch

from parlab import comm
from parlab.i18n import _
from parlab.trace.wire import wire_bytes
from parlab.course.grading import guard
from parlab.course.grading.guard import graded
from parlab.course.grading.runner import TIMEOUT, _show, run_student

__all__ = ["check_ring_reduce_scatter", "check_ring_all_gather", "check_ring_all_reduce",
           "check_ring_all_reduce_traffic", "rank_input"]

WORLD_SIZES = (2, 3, 4)
NUMEL = 24                      # divisible by 2, 3 and 4; small enough to print a chunk


# ---------------------------------------------------------------------- inputs, and what a wrong chunk holds
def rank_input(rank: int, world_size: int, numel: int = NUMEL, seed: int = 0) -> torch.Tensor:
    """The tensor rank `rank` contributes: integers in float64, so every sum is exact whatever the order.
    The checks pass a `seed` drawn at grading time (guard.fresh_seed), so the inputs cannot be precomputed."""
    g = torch.Generator().manual_seed(seed * 7919 + 1000 * world_size + rank)
    return torch.randint(-50, 50, (numel,), generator=g).to(torch.float64)


def _explain_chunk(got: torch.Tensor, inputs: list[torch.Tensor], j: int, own: int) -> str:
    """Say what a wrong chunk j holds instead: an average, a partial sum, another chunk, stale data."""
    n = len(inputs)
    size = inputs[0].numel() // n
    part = lambda x, k: x[k * size:(k + 1) * size]       # noqa: E731  chunk k of a whole tensor
    if torch.equal(got, part(sum(inputs), j) / n):
        return _("It is the average over ranks: this all-reduce sums, do not divide by the world size.")
    for k in [j] + [k for k in range(n) if k != j]:      # the right chunk first, then the others
        for m in range(n, 0, -1):
            for ranks in combinations(range(n), m):
                if not torch.equal(got, sum(part(inputs[r], k) for r in ranks)):
                    continue
                what = _("the complete sum") if m == n else _("the sum of ranks {ranks} only").format(ranks=list(ranks))
                if k != j:
                    return _("It holds {what} of chunk {k}: the chunks arrive in the wrong order (slot {j} got chunk "
                             "{k}); check which chunk index you receive into at each step.").format(what=what, k=k, j=j)
                if ranks == (own,):
                    return _("It still holds this rank's own input: nothing was received into it.")
                missing = sorted(set(range(n)) - set(ranks))
                return _("It holds {what}; the contributions of ranks {missing} are missing (too few steps, or a "
                         "chunk index off by one).").format(what=what, missing=missing)
    return _("It is not the sum of any set of ranks' inputs (was a chunk added twice, or overwritten?).")


def _compare_chunks(got: torch.Tensor, inputs: list[torch.Tensor], rank: int, chunk_ids, hint: str,
                    what: str) -> None:
    """Assert that the listed chunks of `got` equal the full sum; explain the first one that does not."""
    n = len(inputs)
    full = sum(inputs)
    size = full.numel() // n
    if not isinstance(got, torch.Tensor) or got.shape != full.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise AssertionError(_("{what} on {n} ranks: rank {rank} returned {shape}, expected a tensor of shape "
                               "{want} (the whole input, with the chunks filled in).").format(
            what=what, n=n, rank=rank, shape=shape, want=tuple(full.shape)))
    got = got.to(full.dtype)
    for j in chunk_ids:
        sl = slice(j * size, (j + 1) * size)
        if not torch.equal(got[sl], full[sl]):
            raise AssertionError(_("{what} is wrong on {n} ranks: rank {rank}, chunk {j} (elements {start}:{stop}):"
                                   "\n  expected {want}\n  got      {got}\n{why}\nHint: {hint}").format(
                what=what, n=n, rank=rank, j=j, start=sl.start, stop=sl.stop, want=_show(full[sl]),
                got=_show(got[sl]), why=_explain_chunk(got[sl], inputs, j, rank), hint=hint))


# ---------------------------------------------------------------------- the checks
def _messages_only(res, what: str) -> None:
    """Exercise 00 builds the collectives from messages: a built-in collective in the trace earns nothing."""
    used = sorted({e.op for e in res.trace.comm().events if e.kind == "collective"})
    if used:
        raise AssertionError(_("{what} called comm.{ops}: this exercise builds it from point-to-point messages only "
                               "(comm.send / comm.recv / comm.isend / comm.irecv).").format(
            what=what, ops=", comm.".join(used)))


def _rank_reduce_scatter(student_fn, numel, seed):
    n, r = comm.get_world_size(), comm.get_rank()
    x = rank_input(r, n, numel, seed)
    chunks = list(x.chunk(n))                            # n views of x, each (numel/n,)
    student_fn(chunks)
    return torch.cat([c.detach().clone() for c in chunks])


def _rank_all_gather(student_fn, numel, seed):
    n, r = comm.get_world_size(), comm.get_rank()
    x = rank_input(r, n, numel, seed)                    # stale partial data in every chunk ...
    full = sum(rank_input(k, n, numel, seed) for k in range(n))
    chunks = list(x.chunk(n))
    chunks[r].copy_(full.chunk(n)[r])                    # ... except chunk r, fully reduced
    student_fn(chunks)
    return torch.cat([c.detach().clone() for c in chunks])


def _rank_all_reduce(student_fn, numel, seed):
    x = rank_input(comm.get_rank(), comm.get_world_size(), numel, seed)
    out = student_fn(x)
    if out is None:                                      # summed in place
        out = x
    return out.detach().clone() if isinstance(out, torch.Tensor) else out


def _check_on_every_size(fn, rank_fn, what: str, chunk_ids, hint: str, world_sizes, timeout: float) -> None:
    """Run `fn` through `rank_fn` on each world size with fresh inputs; every rank's chunks `chunk_ids(r, n)`
    must hold the sums over all ranks."""
    for n in world_sizes:
        seed = guard.fresh_seed()
        res = run_student(rank_fn, n, fn, NUMEL, seed, timeout=timeout, what=what)
        _messages_only(res, what)
        inputs = [rank_input(r, n, NUMEL, seed) for r in range(n)]
        for r, got in enumerate(res.results):
            _compare_chunks(got, inputs, r, chunk_ids(r, n), hint, what)


@graded("parlab.course.grading.collectives:rank_input")
def check_ring_reduce_scatter(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """After ``fn(chunks)`` on every rank, chunk r of rank r holds the sum of chunk r over all ranks."""
    hint = _("at step s (0 <= s < N-1) rank r sends chunk (r-1-s) % N to rank (r+1) % N and adds the chunk it "
             "receives from rank (r-1) % N into chunk (r-2-s) % N; after the N-1 steps chunk r is complete.")
    _check_on_every_size(fn, _rank_reduce_scatter, "ring_reduce_scatter", lambda r, n: [r], hint, world_sizes, timeout)
    print(_("ring_reduce_scatter is correct on {sizes} ranks").format(sizes=", ".join(map(str, world_sizes))))


@graded("parlab.course.grading.collectives:rank_input")
def check_ring_all_gather(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """Starting with the reduced chunk r on rank r, after ``fn(chunks)`` every rank holds every reduced chunk."""
    hint = _("at step s (0 <= s < N-1) rank r sends chunk (r-s) % N to rank (r+1) % N and stores the chunk it "
             "receives from rank (r-1) % N as chunk (r-1-s) % N (copy it in, do not add).")
    _check_on_every_size(fn, _rank_all_gather, "ring_all_gather", lambda r, n: range(n), hint, world_sizes, timeout)
    print(_("ring_all_gather is correct on {sizes} ranks").format(sizes=", ".join(map(str, world_sizes))))


@graded("parlab.course.grading.collectives:rank_input")
def check_ring_all_reduce(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """``fn(x)`` returns (or leaves in x) the sum of x over all ranks, on every rank."""
    hint = _("ring_all_reduce = ring_reduce_scatter(chunks) then ring_all_gather(chunks) on chunks = "
             "list(x.chunk(N)).")
    _check_on_every_size(fn, _rank_all_reduce, "ring_all_reduce", lambda r, n: range(n), hint, world_sizes, timeout)
    print(_("ring_all_reduce is correct on {sizes} ranks").format(sizes=", ".join(map(str, world_sizes))))


@graded("parlab.course.grading.collectives:rank_input")
def check_ring_all_reduce_traffic(fn, world_size: int = 4, numel: int = 1200, timeout: float = TIMEOUT) -> None:
    """From the trace: only send/recv, each rank talks to one ring neighbour and sends exactly
    2(N-1) messages of size/N, i.e. 2(N-1)/N x size bytes."""
    n = world_size
    seed = guard.fresh_seed()
    res = run_student(_rank_all_reduce, n, fn, numel, seed, timeout=timeout, what="ring_all_reduce")
    full = sum(rank_input(r, n, numel, seed) for r in range(n))
    if not all(torch.equal(got, full) for got in res.results):
        raise AssertionError(_("ring_all_reduce gives a wrong result; make check_ring_all_reduce pass first."))
    events = res.trace.comm().events
    _messages_only(res, "ring_all_reduce")
    if not events:
        raise AssertionError(_("the trace shows no messages at all: send with parlab.comm (comm.send, comm.recv, "
                               "comm.isend, comm.irecv), not torch.distributed directly, so that they are traced."))
    size = numel * 8                                     # float64 input
    want = wire_bytes("all_reduce", size, n)             # 2(N-1)/N x size
    for r in range(n):
        sends = [e for e in events if e.rank == r and e.op == "send"]
        peers = sorted({e.peer for e in sends})
        if len(peers) != 1 or peers[0] not in ((r + 1) % n, (r - 1) % n):
            raise AssertionError(_("rank {r} sent to ranks {peers}; in a ring each rank sends only to one "
                                   "neighbour, (r+1) % N = {next}.").format(r=r, peers=peers, next=(r + 1) % n))
        sent = sum(e.nbytes for e in sends)
        if sent != want or len(sends) != 2 * (n - 1):
            raise AssertionError(_(
                "rank {r} sent {sent:.0f} bytes in {count} messages of {sizes} bytes; a ring all-reduce of {size} "
                "bytes on {n} ranks sends 2(N-1)/N x size = {want:.0f} bytes in 2(N-1) = {messages} messages of "
                "size/N = {piece} bytes. Hint: send one chunk per step, never the whole tensor, and run N-1 steps in "
                "each phase.").format(r=r, sent=sent, count=len(sends), sizes=sorted({e.nbytes for e in sends}),
                                      size=size, n=n, want=want, messages=2 * (n - 1), piece=size // n))
    print(_("ring_all_reduce moves 2(N-1)/N x size = {want:.0f} bytes per rank on {n} ranks, in {messages} messages "
            "to its neighbour").format(want=want, n=n, messages=2 * (n - 1)))


guard.protect(__name__)
