"""Checks for exercise 10 (mixture of experts: the router's balance and capacity, the expert-parallel dispatch;
Switch Transformer, arXiv:2101.03961, section 2.2; GShard, arXiv:2006.16668, sections 2.2 and 3.2).

The student writes (exercises/solutions/10_expert_dispatch.ipynb)

    load_balancing_loss(probs, expert, E)   E * sum_i f_i P_i of one group of T tokens: probs (T, E) the router's
                                            probabilities, expert (T, k) the experts each token was sent to
    keep_within_capacity(expert, weight, E, cap)
                                            (T, k) bool: each expert keeps its `cap` assignments of highest weight
    dispatch_rows(x_sorted, counts)         this rank's rows sorted by expert (N, H), counts (E,) per expert ->
                                            the rows every rank sent to this rank's experts (M, H), in source-rank
                                            order: one all-to-all of the counts, then one of the rows

and each check compares with parlab's answer on fresh inputs: `check_load_balancing_loss` the value (exactly 1 under
uniform probabilities) and its gradient with respect to the probabilities, float64 to 1e-12 (the same few sums in
another order); `check_capacity` the kept assignments exactly (the weights drawn distinct, so "highest" is
unambiguous); `check_dispatch` the rows each rank receives on 2 and 4 ranks, including an expert and a rank that
receive nothing; `check_dispatch_traffic` the trace: exactly two all-to-alls per rank, the counts first, the rows
with the uneven split sizes the counts imply, and nothing else.
"""
from __future__ import annotations

import torch

from parlab import comm
from parlab.i18n import _
from parlab.models.moe import _keep_within_capacity, load_balancing_loss
from parlab.course.grading.runner import TIMEOUT, call_student, run_student
from parlab.course.grading.guard import fresh_seed, graded, protect

__all__ = ["check_load_balancing_loss", "check_capacity", "check_dispatch", "check_dispatch_traffic", "rank_rows"]

REFS = (   # parlab's own answers: unavailable to the student's code while these checks run
    "parlab.models.moe:load_balancing_loss",
    "parlab.models.moe:_keep_within_capacity",
    "parlab.models.moe:route",
    "parlab.parallel.expert.comm:exchange_counts",
    "parlab.parallel.expert.comm:all_to_all_rows",
    "parlab.parallel.expert.comm:dispatch",
    "parlab.parallel.expert.comm:_AllToAll",
)
TOL = 1e-12                # float64: the same sums over at most a few hundred terms, in another order
H = 3                      # values per row in the dispatch checks
WORLD_SIZES = (2, 4)


def _routing(seed: int, T: int = 24, E: int = 6, k: int = 2, skew: float = 0.0):
    """Router probabilities (T, E) float64 and each token's top-k experts (T, k), drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    logits[:, 0] += skew
    probs = logits.softmax(-1)
    return probs, probs.topk(k, dim=-1).indices


# ---------------------------------------------------------------------- part 1: balance
@graded(*REFS)
def check_load_balancing_loss(fn) -> None:
    """``fn(probs, expert, E)`` equals E * sum_i f_i P_i (1 under uniform probabilities) with its gradient."""
    hint = _("f = torch.bincount(expert.reshape(-1), minlength=E) / (T * k): the fraction of the T k assignments "
             "each expert got (counted: no gradient); P = probs.mean(0): each expert's mean probability; return "
             "E * (f * P).sum().")
    uniform = torch.full((8, 4), 0.25, dtype=torch.float64)
    assigned = torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3], [0, 1], [2, 3], [0, 3], [1, 2]])      # (T, k)
    got = call_student(fn, uniform, assigned, 4, what="load_balancing_loss")
    if not isinstance(got, torch.Tensor) or got.numel() != 1 or abs(float(got) - 1.0) > TOL:
        raise AssertionError(_("load_balancing_loss of uniform probabilities returned {got}; expected exactly 1 "
                               "(f_i = P_i = 1/E, so E sum_i f_i P_i = E x E x 1/E^2).\nHint: {hint}").format(
            got=got if not isinstance(got, torch.Tensor) else got.tolist(), hint=hint))
    for skew in (0.0, 3.0):
        probs, expert = _routing(fresh_seed(), skew=skew)
        E, (T, k) = probs.shape[1], expert.shape
        want = load_balancing_loss(probs, expert, E)
        p = probs.clone().requires_grad_(True)
        got = call_student(fn, p, expert.clone(), E, what="load_balancing_loss")
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            raise AssertionError(_("load_balancing_loss returned {got}; expected a tensor of one element.").format(
                got=type(got).__name__ if not isinstance(got, torch.Tensor) else tuple(got.shape)))
        if abs(float(got) - float(want)) > TOL:
            ratio = float(got) / float(want)
            why = (_(" That is k = {k} times too much: f_i counts the T x k assignments, so divide by T k.").format(k=k)
                   if abs(ratio - k) < 1e-9 else
                   _(" That is E = {E} times too little: the loss is E times the sum.").format(E=E)
                   if abs(ratio - 1 / E) < 1e-9 else "")
            raise AssertionError(_("load_balancing_loss of {T} tokens, {E} experts, top-{k}: got {got:.6f}, expected "
                                   "{want:.6f}.{why}\nHint: {hint}").format(T=T, E=E, k=k, got=float(got),
                                                                             want=float(want), why=why, hint=hint))
        if not got.requires_grad:
            raise AssertionError(_("load_balancing_loss does not depend on probs through autograd: the router would "
                                   "get no balancing gradient. P = probs.mean(0) must stay in the graph (only f "
                                   "is counted).\nHint: {hint}").format(hint=hint))
        got.backward()
        want_grad = E * torch.bincount(expert.reshape(-1), minlength=E).double() / (T * k) / T   # d/dprobs[t, i]
        if p.grad is None or (p.grad - want_grad.expand(T, E)).abs().max() > TOL:
            raise AssertionError(_("load_balancing_loss has the right value but the wrong gradient with respect to "
                                   "probs: expected E f_i / T for every token and expert i (f_i is a count, with "
                                   "no gradient).\nHint: {hint}").format(hint=hint))
    print(_("load_balancing_loss: 1 under uniform probabilities, value and gradient equal E sum f_i P_i"))


# ---------------------------------------------------------------------- part 2: capacity
@graded(*REFS)
def check_capacity(fn) -> None:
    """``fn(expert, weight, E, cap)`` keeps each expert's `cap` assignments of highest weight."""
    hint = _("order the T k assignments by weight, highest first (torch.sort(-weight.reshape(-1))); walk them and "
             "keep an assignment while its expert has kept fewer than cap; return the (T, k) mask.")
    for T, E, k, cap in ((24, 6, 2, 5), (16, 4, 1, 3), (12, 3, 2, 2)):
        probs, expert = _routing(fresh_seed(), T, E, k, skew=2.0)
        weight = probs.gather(1, expert)                                   # (T, k) distinct, as probabilities are
        want = _keep_within_capacity(expert, weight, E, cap)
        got = call_student(fn, expert.clone(), weight.clone(), E, cap, what="keep_within_capacity")
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != torch.bool:
            raise AssertionError(_("keep_within_capacity returned {got}; expected a bool tensor of shape {shape}, "
                                   "True for each kept assignment.").format(
                got=type(got).__name__ if not isinstance(got, torch.Tensor) else f"{got.dtype} {tuple(got.shape)}",
                shape=tuple(want.shape)))
        if not torch.equal(got, want):
            counts = torch.bincount(expert[got], minlength=E).tolist()
            first_come = torch.zeros_like(want)
            seen = [0] * E
            for i, e in enumerate(expert.reshape(-1).tolist()):             # the tokens in order, not by weight
                first_come.view(-1)[i] = seen[e] < cap
                seen[e] += 1
            why = (_(" Your mask keeps the first tokens in order; keep the highest weights instead.")
                   if torch.equal(got, first_come) else
                   _(" Some expert keeps more than cap = {cap}: {counts}.").format(cap=cap, counts=counts)
                   if max(counts) > cap else "")
            raise AssertionError(_("keep_within_capacity ({T} tokens, {E} experts, top-{k}, capacity {cap}): {n} "
                                   "assignments differ from keeping each expert's {cap} highest weights.{why}\n"
                                   "Hint: {hint}").format(T=T, E=E, k=k, cap=cap, n=int((got != want).sum()),
                                                          why=why, hint=hint))
    print(_("keep_within_capacity: each expert keeps its highest-weight assignments up to the capacity"))


# ---------------------------------------------------------------------- part 3: the dispatch
def rank_rows(seed: int, P: int, r: int, local: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's rows sorted by expert (N, H) and its counts per expert (E = local P,): row values say where they
    come from (100 000 src + 1 000 expert + index), so every row is unique; the last expert receives nothing and,
    on 4 ranks, no row is sent to rank 1's experts."""
    g = torch.Generator().manual_seed(seed * 31 + r)
    E = local * P
    counts = torch.randint(0, 4, (E,), generator=g)
    counts[-1] = 0
    if P == 4:
        counts[local:2 * local] = 0                                  # rank 1's experts: no token at all
    rows = [torch.tensor([[1e5 * r + 1e3 * e + i + j / 10 for j in range(H)] for i in range(int(c))],
                         dtype=torch.float64).reshape(-1, H) for e, c in enumerate(counts.tolist())]
    return torch.cat(rows), counts


def _expected(seed: int, P: int, r: int, local: int = 2) -> torch.Tensor:
    out = []
    for src in range(P):
        x, counts = rank_rows(seed, P, src, local)
        start = int(counts[:r * local].sum())
        out.append(x[start:start + int(counts[r * local:(r + 1) * local].sum())])
    return torch.cat(out)


def _rank_dispatch(fn, seed):
    P, r = comm.get_world_size(), comm.get_rank()
    x, counts = rank_rows(seed, P, r)
    out = fn(x, counts)
    return out.detach().clone() if isinstance(out, torch.Tensor) else out


@graded(*REFS)
def check_dispatch(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """Every rank receives, in source-rank order, exactly the rows each rank sent to its experts (2 and 4 ranks)."""
    hint = _("recv_counts = torch.empty_like(counts); comm.all_to_all(recv_counts, counts); send = "
             "counts.view(P, -1).sum(1).tolist() (rows to each rank), recv = recv_counts.view(P, -1).sum(1).tolist() "
             "(rows from each rank); out = x_sorted.new_empty(sum(recv), H); comm.all_to_all(out, x_sorted, recv, "
             "send); return out.")
    for P in world_sizes:
        seed = fresh_seed() % 10_000
        res = run_student(_rank_dispatch, P, fn, seed, timeout=timeout, what="dispatch_rows")
        for r, got in enumerate(res.results):
            want = _expected(seed, P, r)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise AssertionError(_("dispatch_rows on {P} ranks: rank {r} returned {shape}, expected {want}: the "
                                       "rows sent to its experts by every rank.\nHint: {hint}").format(
                    P=P, r=r, shape=shape, want=tuple(want.shape), hint=hint))
            if not torch.equal(got, want):
                srcs = sorted({int(v) // 100_000 for v in got[:, 0].tolist()})
                raise AssertionError(_("dispatch_rows on {P} ranks: rank {r} received the right number of rows but "
                                       "not the right ones (they came from ranks {srcs}); each row's first value is "
                                       "100000 x source rank + 1000 x expert + its index, so rank {r} should hold "
                                       "rows of experts {lo}..{hi} only, ordered by source rank.\nHint: {hint}").format(
                    P=P, r=r, srcs=srcs, lo=2 * r, hi=2 * r + 1, hint=hint))
    print(_("dispatch_rows: every rank receives exactly its experts' rows, in source order, on {sizes} ranks").format(
        sizes=", ".join(map(str, world_sizes))))


@graded(*REFS)
def check_dispatch_traffic(fn, world_size: int = 4, timeout: float = TIMEOUT) -> None:
    """From the trace: two all-to-alls per rank (counts, then the rows with uneven splits), nothing else."""
    P = world_size
    seed = fresh_seed() % 10_000
    res = run_student(_rank_dispatch, P, fn, seed, timeout=timeout, what="dispatch_rows")
    for r in range(P):
        events = res.trace.filter(rank=r).comm().events
        ops = [e.op for e in events]
        if ops != ["all_to_all", "all_to_all"]:
            raise AssertionError(_("rank {r} called {ops}; the dispatch is one all-to-all of the counts, then one "
                                   "of the rows (traced comm.all_to_all), nothing else.").format(r=r, ops=ops))
        counts_call, rows_call = events
        x, counts = rank_rows(seed, P, r)
        if counts_call.nbytes != counts.numel() * counts.element_size():
            raise AssertionError(_("rank {r}'s first all-to-all moved {got} bytes; the counts are {E} int64 values "
                                   "({want} bytes): exchange them before the rows, so every rank knows what it will "
                                   "receive.").format(r=r, got=counts_call.nbytes, E=counts.numel(),
                                                      want=counts.numel() * 8))
        want = tuple(int(n) * H * 8 for n in counts.view(P, -1).sum(1).tolist())
        if rows_call.splits != want:
            raise AssertionError(_("rank {r}'s second all-to-all sent {got} bytes to the ranks; its counts ask for "
                                   "{want} (rows to rank j: the counts of rank j's experts, x {H} float64 values). "
                                   "Give comm.all_to_all the split sizes.").format(r=r, got=list(rows_call.splits),
                                                                                   want=list(want), H=H))
    print(_("dispatch_rows: two all-to-alls per rank, the counts and then the rows with their uneven split sizes"))


protect(__name__)
