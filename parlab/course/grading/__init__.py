"""Checks for the exercises: run the student's code, compare with parlab's reference, explain what is wrong.

Every graded cell of an exercise notebook calls one ``check_*`` function. A
check passes silently (it prints one line saying what passed) or raises
``AssertionError`` with a diagnostic a student can act on: which rank, which
chunk or group, expected vs got, and a hint. nbval turns each graded cell into
one pytest item, so a lecturer gets one pass/fail line per check (see
exercises/README.md).

Code that communicates runs on simulated ranks through ``parlab.run`` on gloo,
under `watchdog` (a deadlock is recognised from the ranks' state within about
3 s; a correct solution on a busy machine is never stopped) and a CPU-time
limit (a runaway loop fails its check). Every check is wrapped by
`guard.graded`: parlab's own implementation of the piece under test is
unavailable to the student's code while it runs, rebinding grading or parlab
internals is reported as tampered, inputs are drawn fresh (`guard.fresh_seed`)
and a failure shows its message only. Inputs are integers stored as float64, so
sums are exact in any order and a wrong result can be explained exactly
("chunk 2 holds the sum of ranks [1, 2] only").

Exercise 00 (ring all-reduce from send/recv; Patarasuk & Yuan 2009):
    check_ring_reduce_scatter, check_ring_all_gather, check_ring_all_reduce, check_ring_all_reduce_traffic
Exercise 01 (process groups of a tp x dp x pp grid; seed 000, Megatron-LM parallel_state):
    check_groups, check_dp_all_reduce

Later exercises keep their checks in a module of this package named after the
technique (``parlab.course.grading.data_parallel``, ``parlab.course.grading.tensor_parallel``,
...); a notebook imports it as ``grading`` so every graded cell reads
``grading.check_...(...)``. The helpers here (`run_student`, `call_student`)
are shared by all of them.
"""
from __future__ import annotations

import shutil
import tempfile
from itertools import combinations

import torch

from parlab import comm
from parlab.i18n import _
from parlab.launch import RankError, RankKilled, RankTimeout, RunResult, run
from parlab.parallel.topology import ParallelGrid
from parlab.trace.wire import wire_bytes
from parlab.course.grading import guard, watchdog
from parlab.course.grading.guard import CheckFailed, graded

__all__ = ["run_student", "call_student", "check_ring_reduce_scatter", "check_ring_all_gather", "check_ring_all_reduce",
           "check_ring_all_reduce_traffic", "check_groups", "check_dp_all_reduce", "GROUP_LAYOUTS"]

TIMEOUT = 300.0                 # wall-clock backstop per run; deadlocks are found by `watchdog` within ~3 s
WORLD_SIZES = (2, 3, 4)
NUMEL = 24                      # divisible by 2, 3 and 4; small enough to print a chunk


# ---------------------------------------------------------------------- running student code
def run_student(fn, world_size: int, *args, timeout: float = TIMEOUT, what: str | None = None) -> RunResult:
    """``parlab.run(fn, world_size, *args)`` on gloo with a trace, under the deadlock watchdog and the CPU-time
    limit, every failure turned into an AssertionError (CheckFailed) that says what happened."""
    what = what or _("your function")
    folder = tempfile.mkdtemp(prefix="parlab-watch-")
    try:
        return run(watchdog.rank_entry, world_size, folder, guard._STATE["cpu_limit"], fn, *args, backend="gloo",
                   trace=True, timeout=timeout)
    except (RankKilled, RankError) as e:
        found = watchdog.verdict(folder)        # a deadlock first: peers then fail on a closed connection
        if found is not None:
            raise AssertionError(watchdog.explain(found, what, world_size)) from None
        if isinstance(e, RankKilled):
            if "SIGXCPU" in str(e):
                on = _("{what} on rank {rank}").format(what=what, rank=e.rank)
                raise CheckFailed(guard.cpu_message(on), "cpu") from None
            raise AssertionError(f"{what}: {e}") from None
        _explain_rank_error(e, what, world_size)
    except RankTimeout as e:
        raise AssertionError(_("{what} did not finish within {timeout:g} s on {world} ranks (ranks {ranks} were "
                               "still running). {hint}").format(what=what, timeout=timeout, world=world_size,
                                                                 ranks=e.unfinished, hint=watchdog.hint())) from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _explain_rank_error(e: RankError, what: str, world_size: int):
    """Raise the AssertionError (or CheckFailed) that explains an exception raised on a rank."""
    on = _("{what} on rank {rank}").format(what=what, rank=e.rank)
    if e.exc_type == "CpuTimeExceeded":
        raise CheckFailed(guard.cpu_message(on), "cpu") from None
    if e.exc_type == "TraceEdited":
        raise CheckFailed(_("tampered: {what} on rank {rank}: {error}; the check reads what parlab.comm recorded, so "
                            "the trace must not be touched. Remove the code that edits it.").format(
            what=what, rank=e.rank, error=e.message), "tampered") from None
    if e.exc_type == "ReferenceUsed":
        raise AssertionError(f"{on}: {e.message}") from None
    if e.exc_type == "NotImplementedError":
        raise AssertionError(_("{what} is not written yet (rank {rank} raised NotImplementedError): replace the "
                               "`raise NotImplementedError` line with your code.").format(what=what,
                                                                                          rank=e.rank)) from None
    tail = "\n".join(e.traceback.strip().splitlines()[-6:])
    raise AssertionError(_("{what} raised {exc} on rank {rank} of {world}: {error}\n--- end of the traceback from "
                           "rank {rank} ---\n{tail}").format(what=what, exc=e.exc_type, rank=e.rank, world=world_size,
                                                             error=e.message, tail=tail)) from None


def call_student(fn, *args, what: str | None = None):
    """Call a student's plain (single-process) function; its exceptions become AssertionErrors that say so."""
    what = what or _("your function")
    try:
        with guard.cpu_limit():
            return fn(*args)
    except guard.CpuTimeExceeded:
        raise CheckFailed(guard.cpu_message(what), "cpu") from None
    except NotImplementedError:
        raise AssertionError(guard.not_written(what)) from None
    except Exception as e:
        raise AssertionError(_("{what}{args} raised {exc}: {error}").format(what=what, args=args,
                                                                           exc=type(e).__name__, error=e)) from e


def rank_input(rank: int, world_size: int, numel: int = NUMEL, seed: int = 0) -> torch.Tensor:
    """The tensor rank `rank` contributes: integers in float64, so every sum is exact whatever the order.
    The checks pass a `seed` drawn at grading time (guard.fresh_seed), so the inputs cannot be precomputed."""
    g = torch.Generator().manual_seed(seed * 7919 + 1000 * world_size + rank)
    return torch.randint(-50, 50, (numel,), generator=g).to(torch.float64)


def _show(t: torch.Tensor, k: int = 6) -> str:
    vals = ", ".join(f"{v:g}" for v in t[:k].tolist())
    return f"[{vals}{', ...' if t.numel() > k else ''}]"


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


# ---------------------------------------------------------------------- exercise 00: ring all-reduce
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


@graded("parlab.course.grading:rank_input")
def check_ring_reduce_scatter(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """After ``fn(chunks)`` on every rank, chunk r of rank r holds the sum of chunk r over all ranks."""
    hint = _("at step s (0 <= s < N-1) rank r sends chunk (r-1-s) % N to rank (r+1) % N and adds the chunk it "
             "receives from rank (r-1) % N into chunk (r-2-s) % N; after the N-1 steps chunk r is complete.")
    for n in world_sizes:
        seed = guard.fresh_seed()
        res = run_student(_rank_reduce_scatter, n, fn, NUMEL, seed, timeout=timeout, what="ring_reduce_scatter")
        _messages_only(res, "ring_reduce_scatter")
        inputs = [rank_input(r, n, NUMEL, seed) for r in range(n)]
        for r, got in enumerate(res.results):
            _compare_chunks(got, inputs, r, [r], hint, "ring_reduce_scatter")
    print(_("ring_reduce_scatter is correct on {sizes} ranks").format(sizes=", ".join(map(str, world_sizes))))


@graded("parlab.course.grading:rank_input")
def check_ring_all_gather(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """Starting with the reduced chunk r on rank r, after ``fn(chunks)`` every rank holds every reduced chunk."""
    hint = _("at step s (0 <= s < N-1) rank r sends chunk (r-s) % N to rank (r+1) % N and stores the chunk it "
             "receives from rank (r-1) % N as chunk (r-1-s) % N (copy it in, do not add).")
    for n in world_sizes:
        seed = guard.fresh_seed()
        res = run_student(_rank_all_gather, n, fn, NUMEL, seed, timeout=timeout, what="ring_all_gather")
        _messages_only(res, "ring_all_gather")
        inputs = [rank_input(r, n, NUMEL, seed) for r in range(n)]
        for r, got in enumerate(res.results):
            _compare_chunks(got, inputs, r, range(n), hint, "ring_all_gather")
    print(_("ring_all_gather is correct on {sizes} ranks").format(sizes=", ".join(map(str, world_sizes))))


@graded("parlab.course.grading:rank_input")
def check_ring_all_reduce(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """``fn(x)`` returns (or leaves in x) the sum of x over all ranks, on every rank."""
    hint = _("ring_all_reduce = ring_reduce_scatter(chunks) then ring_all_gather(chunks) on chunks = "
             "list(x.chunk(N)).")
    for n in world_sizes:
        seed = guard.fresh_seed()
        res = run_student(_rank_all_reduce, n, fn, NUMEL, seed, timeout=timeout, what="ring_all_reduce")
        _messages_only(res, "ring_all_reduce")
        inputs = [rank_input(r, n, NUMEL, seed) for r in range(n)]
        for r, got in enumerate(res.results):
            _compare_chunks(got, inputs, r, range(n), hint, "ring_all_reduce")
    print(_("ring_all_reduce is correct on {sizes} ranks").format(sizes=", ".join(map(str, world_sizes))))


@graded("parlab.course.grading:rank_input")
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


# ---------------------------------------------------------------------- exercise 01: process groups
GROUP_LAYOUTS = ((16, 2, 4), (8, 2, 2), (24, 4, 2))    # (world_size, tp, pp): seed 000's example first
def _group_hint(dim: str) -> str:
    return {"tp": _("tp is the fastest-varying coordinate: a tp group is tp consecutive ranks."),
            "dp": _("rank = tp_rank + tp * (dp_rank + dp * pp_rank): dp neighbours are tp apart, inside one pipeline "
                    "stage."),
            "pp": _("pp is the slowest coordinate: pp neighbours are world_size / pp = tp * dp apart.")}[dim]


def _normalise(groups) -> list[list[int]]:
    try:
        return sorted(sorted(int(r) for r in g) for g in groups)
    except TypeError:
        raise AssertionError(_("expected a list of groups, each a list of ranks, got {groups!r}").format(
            groups=groups)) from None


@graded("parlab.parallel.topology:ParallelGrid")
def check_groups(fn, dim: str, layouts=GROUP_LAYOUTS) -> None:
    """``fn(world_size, tp, pp)`` returns the `dim` groups (any order) equal to ParallelGrid(...).groups(dim)."""
    for world, tp, pp in layouts:
        grid = ParallelGrid(world, tp=tp, pp=pp)
        where = _("{dim} groups for world_size={world}, tp={tp}, pp={pp} (dp={dp})").format(
            dim=dim, world=world, tp=tp, pp=pp, dp=grid.dp)
        got = _normalise(call_student(fn, world, tp, pp, what=f"{dim}_groups"))
        want = grid.groups(dim)
        if got == want:
            continue
        for other in ("tp", "dp", "pp"):
            if other != dim and got == grid.groups(other):
                raise AssertionError(_("{where}: you returned the {other} groups.\nHint: {hint}").format(
                    where=where, other=other, hint=_group_hint(dim)))
        seen = [r for g in got for r in g]
        for r in range(world):
            if seen.count(r) != 1:
                raise AssertionError(_("{where}: rank {r} appears in {count} groups; the groups of one dimension "
                                       "must contain every rank exactly once.\nHint: {hint}").format(
                    where=where, r=r, count=seen.count(r), hint=_group_hint(dim)))
        if set(seen) != set(range(world)):
            raise AssertionError(_("{where}: ranks {ranks} do not exist.").format(
                where=where, ranks=sorted(set(seen) - set(range(world)))))
        for r in range(world):
            mine = next(g for g in got if r in g)
            if mine != grid.group_of(r, dim):
                raise AssertionError(_("{where}: rank {r} should be grouped with {group}, your groups put it in "
                                       "{mine}.\n  expected {want}\n  got      {got}\nHint: {hint}").format(
                    where=where, r=r, group=grid.group_of(r, dim), mine=mine, want=want, got=got,
                    hint=_group_hint(dim)))
    print(_("{dim} groups match parlab.parallel.topology for {n} layouts").format(dim=dim, n=len(layouts)))


def _rank_dp_all_reduce(student_fn, tp, pp):
    x = torch.tensor([float(2 ** comm.get_rank())])     # a sum of powers of two says which ranks took part
    out = student_fn(x, tp, pp)
    return (x if out is None else out).clone()


@graded("parlab.parallel.topology:ParallelGrid")
def check_dp_all_reduce(fn, world_size: int = 8, tp: int = 2, pp: int = 2, timeout: float = TIMEOUT) -> None:
    """``fn(x, tp, pp)``, run on every rank, sums x over this rank's dp group with comm.all_reduce."""
    grid = ParallelGrid(world_size, tp=tp, pp=pp)
    res = run_student(_rank_dp_all_reduce, world_size, fn, tp, pp, timeout=timeout, what="all_reduce_in_dp_group")
    for r, got in enumerate(res.results):
        group = grid.group_of(r, "dp")
        want = float(sum(2 ** k for k in group))
        value = int(got.item()) if got.numel() == 1 else None
        if got.numel() != 1 or float(got.item()) != want:
            who = [k for k in range(world_size) if value is not None and value >> k & 1]
            raise AssertionError(_("rank {r} of grid {grid}: expected the sum over its dp group {group} ({want:g}), "
                                   "got {got}, which is the sum over ranks {who}.\nHint: build every dp group with "
                                   "dist.new_group on every rank, in the same order, and pass this rank's group to "
                                   "comm.all_reduce(x, group=...).").format(r=r, grid=grid, group=group, want=want,
                                                                            got=_show(got), who=who))
    groups = {e.group for e in res.trace.filter(op="all_reduce").events}
    for r in range(world_size):
        mine = {e.group for e in res.trace.filter(op="all_reduce", rank=r).events}
        if tuple(grid.group_of(r, "dp")) not in mine:
            raise AssertionError(_("rank {r} made no comm.all_reduce over its dp group {group} (the trace shows "
                                   "{shown}); the sum must come from an all-reduce with the dp group, not be computed "
                                   "locally.").format(r=r, group=grid.group_of(r, "dp"),
                                                      shown=sorted(mine) or _("none")))
    if not groups <= {tuple(g) for g in grid.groups("dp")}:
        raise AssertionError(_("the trace shows all-reduces over {groups}; use comm.all_reduce with the dp group, so "
                               "that only dp groups {dp} communicate.").format(groups=sorted(groups),
                                                                              dp=grid.groups("dp")))
    print(_("all_reduce_in_dp_group sums over the dp groups {dp}").format(dp=grid.groups("dp")))


guard.protect(__name__)
# the faces students call, and the modules behind them (whose private helpers the public names call)
for _mod in ("parlab.launch", "parlab.launch.ranks", "parlab.launch.child", "parlab.comm", "parlab.comm.traced",
             "parlab.comm.direct", "parlab.trace", "parlab.trace.events", "parlab.trace.wire", "parlab.models",
             "parlab.parallel.pipeline", "parlab.parallel.pipeline.schedules", "parlab.parallel.pipeline.simulation",
             "parlab.parallel.context.ring", "parlab.parallel.context.ring_plan", "parlab.parallel.topology",
             "parlab.parallel.zero.memory", "parlab.cluster.planner", "parlab.parallel.data.buckets"):
    guard.protect(_mod)
# what the checks compare with: torch's functions and the Tensor methods a comparison goes through
guard.protect("torch", ["equal", "allclose", "isclose", "softmax", "logsumexp", "logaddexp", "exp", "cat", "stack",
                        "zeros", "randn", "randint", "count_nonzero", "sort", "as_tensor", "isfinite", "maximum",
                        "Tensor.__eq__", "Tensor.__ne__", "Tensor.__sub__", "Tensor.__gt__", "Tensor.__lt__",
                        "Tensor.__le__", "Tensor.__ge__", "Tensor.__bool__", "Tensor.__mul__", "Tensor.__matmul__",
                        "Tensor.abs", "Tensor.max", "Tensor.min", "Tensor.sum", "Tensor.item", "Tensor.tolist",
                        "Tensor.equal", "Tensor.allclose", "Tensor.all", "Tensor.any", "Tensor.clone",
                        "Tensor.detach", "Tensor.reshape", "Tensor.to", "Tensor.double", "Tensor.float",
                        "Tensor.backward", "Tensor.chunk", "Tensor.numel", "Tensor.argmax"])
guard.protect("torch.nn.functional", ["linear", "cross_entropy", "pad", "gelu", "scaled_dot_product_attention"])
guard.protect("math", ["isclose"])
guard.install_ipython_hooks()
