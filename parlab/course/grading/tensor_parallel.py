"""Checks for exercise 04: column- and row-parallel linear layers and the vocab-parallel cross-entropy
(Megatron-LM, arXiv:1909.08053, section 3).

The student writes three ``torch.autograd.Function`` classes (forward and backward by hand, communicating
through `parlab.comm`):

    ColumnParallelLinearFn.apply(x, weight_r, bias_r, group)   x (B, S, in) replicated, weight_r (out/tp, in)
                                                               -> (B, S, out/tp); backward all-reduces dL/dx
    RowParallelLinearFn.apply(x_r, weight_r, bias, group)      x_r (B, S, in/tp), weight_r (out, in/tp),
                                                               bias (out,) -> (B, S, out) summed over ranks
    VocabParallelCrossEntropyFn.apply(logits_r, targets, group) logits_r (B, S, V/tp) -> per-token loss (B, S)

Each check runs them on 2 and 4 simulated ranks, compares the output and every gradient with the dense
layer (``nn.functional.linear`` / ``cross_entropy`` on the unsplit tensors), and reads the trace: which
collectives ran in forward and which in backward. Linear-layer inputs are small integers in float64, so
every sum is exact and a wrong answer can be named exactly ("x.grad holds only this rank's partial sum").

    check_column_parallel_linear, check_row_parallel_linear,
    check_vocab_parallel_cross_entropy, check_vocab_parallel_cross_entropy_traffic
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parlab import comm
from parlab.i18n import _
from parlab.trace import mark
from parlab.course.grading.runner import TIMEOUT, _show, run_student
from parlab.course.grading.guard import fresh_seed, graded, protect

LAYER_REFS = (   # parlab's own answers: unavailable to the student's code while these checks run
    "parlab.parallel.tensor.mappings:copy_to_tp",
    "parlab.parallel.tensor.mappings:reduce_from_tp",
    "parlab.parallel.tensor.mappings:gather_from_tp",
    "parlab.parallel.tensor.mappings:scatter_to_tp",
    "parlab.parallel.tensor.layers:ColumnParallelLinear",
    "parlab.parallel.tensor.layers:RowParallelLinear",
    "parlab.parallel.tensor.mappings:_CopyToTP",            # the private autograd Functions behind copy_to_tp ...
    "parlab.parallel.tensor.mappings:_ReduceFromTP",
    "parlab.parallel.tensor.mappings:_GatherFromTP",
    "parlab.parallel.tensor.mappings:_ScatterToTP",
)
CE_REFS = ("parlab.parallel.tensor.loss:vocab_parallel_cross_entropy", "parlab.parallel.tensor.mappings:reduce_from_tp",
           "parlab.parallel.tensor.loss:_VocabParallelCrossEntropy", "parlab.parallel.tensor.mappings:_ReduceFromTP")

__all__ = ["check_column_parallel_linear", "check_row_parallel_linear", "check_vocab_parallel_cross_entropy",
           "check_vocab_parallel_cross_entropy_traffic", "TP_SIZES"]

TP_SIZES = (2, 4)
B, S, IN, OUT, V = 2, 3, 8, 12, 16     # in, out and vocab divisible by 2 and 4


def _ints(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(torch.float64)


def _dense_linear(seed: int = 0):
    """The unsplit problem: x (B, S, IN), W (OUT, IN) as nn.Linear stores it, b (OUT,), dL/dy (B, S, OUT).
    The checks pass a `seed` drawn at grading time, so that no rank can rebuild the full problem locally."""
    return (_ints((B, S, IN), seed + 1), _ints((OUT, IN), seed + 2), _ints((OUT,), seed + 3),
            _ints((B, S, OUT), seed + 4))


def _apply(fn, *args):
    return fn.apply(*args) if hasattr(fn, "apply") else fn(*args)


def _out(t):
    return None if t is None else t.detach().clone()


# ---------------------------------------------------------------------- what each rank runs
def _rank_column(fn, seed):
    n, r = comm.get_world_size(), comm.get_rank()
    x, w, b, gy = _dense_linear(seed)
    x = x.requires_grad_()
    w_r = w.chunk(n, 0)[r].clone().requires_grad_()         # (OUT/tp, IN): this rank's rows of the weight
    b_r = b.chunk(n, 0)[r].clone().requires_grad_()         # (OUT/tp,)
    y = _apply(fn, x, w_r, b_r, None)                       # (B, S, OUT/tp)
    mark("backward")
    if isinstance(y, torch.Tensor) and y.requires_grad and y.shape == (B, S, OUT // n):
        (y * gy.chunk(n, -1)[r]).sum().backward()
    return dict(y=_out(y) if isinstance(y, torch.Tensor) else y, dx=_out(x.grad), dw=_out(w_r.grad),
                db=_out(b_r.grad))


def _rank_row(fn, seed):
    n, r = comm.get_world_size(), comm.get_rank()
    x, w, b, gy = _dense_linear(seed)
    x_r = x.chunk(n, -1)[r].clone().requires_grad_()        # (B, S, IN/tp): this rank's columns of x
    w_r = w.chunk(n, 1)[r].clone().requires_grad_()         # (OUT, IN/tp): this rank's columns of the weight
    b = b.clone().requires_grad_()                          # (OUT,): the whole bias on every rank
    y = _apply(fn, x_r, w_r, b, None)                       # (B, S, OUT)
    mark("backward")
    if isinstance(y, torch.Tensor) and y.requires_grad and y.shape == (B, S, OUT):
        (y * gy).sum().backward()
    return dict(y=_out(y) if isinstance(y, torch.Tensor) else y, dx=_out(x_r.grad), dw=_out(w_r.grad),
                db=_out(b.grad))


def _logits(seed: int = 7):
    """Large logits (about 800 +- 200): exp() of them overflows float64 unless the max is subtracted first."""
    g = torch.Generator().manual_seed(seed)
    logits = 800 + 200 * torch.randn(B, S, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, S), generator=g)
    targets[0, 0], targets[-1, -1] = 0, V - 1               # the first and the last rank own a target
    upstream = torch.rand(B, S, generator=g, dtype=torch.float64) + 0.5   # d total / d loss per token
    return logits, targets, upstream


def _rank_cross_entropy(fn, seed):
    n, r = comm.get_world_size(), comm.get_rank()
    logits, targets, upstream = _logits(seed)
    mine = logits.chunk(n, -1)[r].clone().requires_grad_()  # (B, S, V/tp)
    loss = _apply(fn, mine, targets.clone(), None)            # (B, S)
    mark("backward")
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.shape == (B, S):
        (loss * upstream).sum().backward()
    return dict(loss=_out(loss) if isinstance(loss, torch.Tensor) else loss, grad=_out(mine.grad))


# ---------------------------------------------------------------------- helpers
def _phases(trace, rank):
    """(forward, backward) communication events of one rank, split at its 'backward' mark."""
    t = next((e.start for e in trace.filter(rank=rank, kind="mark").events if e.op == "backward"), float("inf"))
    evs = trace.filter(rank=rank).comm().events
    return [e for e in evs if e.start < t], [e for e in evs if e.start >= t]


def _ops(evs, sep: str = ", ") -> str:
    return sep.join(_("{op}({n} values)").format(op=e.op, n=e.numel) for e in evs) or _("nothing")


def _shape_check(got, want: torch.Tensor, what: str, where: str, hint: str) -> None:
    if got is None:
        raise AssertionError(_("{where}: {what} is None: backward did not produce it (return one gradient per input "
                               "of forward, None only for `group`). Hint: {hint}").format(where=where, what=what,
                                                                                         hint=hint))
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise AssertionError(_("{where}: {what} has shape {shape}, expected {want}. Hint: {hint}").format(
            where=where, what=what, shape=shape, want=tuple(want.shape), hint=hint))


def _mismatch(got, want, what: str, where: str, why: str, hint: str) -> AssertionError:
    bad = (got - want).abs().flatten().argmax().item()
    return AssertionError(_("{where}: {what} is wrong (largest error at flat index {bad}):\n  expected {want}\n"
                            "  got      {got}\n{why}Hint: {hint}").format(where=where, what=what, bad=bad,
                                                                        want=_show(want.flatten()),
                                                                        got=_show(got.flatten()), why=why, hint=hint))


def _compare(got, want, what, where, hint, explain=(), tol: float = 0.0) -> None:
    """Assert got == want (exactly, or to `tol`); `explain` = (tensor, reason) pairs tried when it is not."""
    _shape_check(got, want, what, where, hint)
    if torch.allclose(got, want, rtol=tol, atol=tol):
        return
    why = next((reason + "\n" for t, reason in explain if t.shape == got.shape and torch.allclose(got, t, rtol=tol,
                                                                                                atol=tol)), "")
    raise _mismatch(got, want, what, where, why, hint)


def _traffic(trace, n, name, fwd_want, bwd_want, hint):
    for r in range(n):
        fwd, bwd = _phases(trace, r)
        for phase, got, want in (("forward", fwd, fwd_want), ("backward", bwd, bwd_want)):
            if [(e.op, e.numel) for e in got] != want:
                exp = ", ".join(_("{op}({n} values)").format(op=op, n=k) for op, k in want) or _("nothing")
                raise AssertionError((_("{name} on {n} ranks: rank {r} communicated in forward: {raw}; expected "
                                        "{exp}. Hint: {hint}") if phase == "forward" else
                                      _("{name} on {n} ranks: rank {r} communicated in backward: {raw}; expected "
                                        "{exp}. Hint: {hint}")).format(name=name, n=n, r=r, raw=_ops(got, "; "),
                                                                      exp=exp, hint=hint))


# ---------------------------------------------------------------------- the checks
@graded(*LAYER_REFS)
def check_column_parallel_linear(fn, tp_sizes=TP_SIZES, timeout: float = TIMEOUT) -> None:
    """y_r = x W_r^T + b_r equals the dense output's columns r; x.grad equals the dense input gradient on every
    rank (all-reduced in backward, nothing in forward); weight and bias gradients equal the dense ones' rows r."""
    hint = _("forward: y = x @ weight.t() + bias, no communication (f is the identity); backward: grad_x = "
             "grad_y @ weight is only this rank's share, so comm.all_reduce(grad_x, group=ctx.group); grad_weight = "
             "grad_y^T x and grad_bias = grad_y summed over (B, S), both local.")
    for n in tp_sizes:
        seed = fresh_seed()
        x, w, b, gy = _dense_linear(seed)
        y_full, dx_full = F.linear(x, w, b), gy @ w
        dw_full, db_full = gy.flatten(0, 1).t() @ x.flatten(0, 1), gy.sum((0, 1))
        res = run_student(_rank_column, n, fn, seed, timeout=timeout, what="ColumnParallelLinearFn")
        for r, got in enumerate(res.results):
            where = _("{name} on {n} ranks, rank {r}").format(name="ColumnParallelLinearFn", n=n, r=r)
            w_r, gy_r = w.chunk(n, 0)[r], gy.chunk(n, -1)[r]
            _compare(got["y"], y_full.chunk(n, -1)[r], _("the output y"), where, hint, [
                (F.linear(x, w_r), _("It is x @ weight.t() without the bias.")),
                (sum(y_full.chunk(n, -1)), _("It is the sum of every rank's output slice: the column-parallel forward "
                                             "needs no all-reduce in forward (each rank keeps its own columns)."))])
            _compare(got["dx"], dx_full, "x.grad", where, hint, [
                (gy_r @ w_r, _("It holds only this rank's partial sum grad_y_r @ weight_r: the backward of f is an "
                               "all-reduce of the input gradient over the group.")),
                (dx_full * n, _("It is n times too large: all-reduce once, and do not multiply by the world size."))])
            _compare(got["dw"], dw_full.chunk(n, 0)[r], "weight.grad", where, hint, [
                (sum(dw_full.chunk(n, 0)), _("It is the sum of every rank's weight gradient: the weight gradient is "
                                             "local, do not all-reduce it.")),
                (dw_full.chunk(n, 0)[r].t(), _("It is transposed: weight is (out/tp, in), so grad_y^T @ x."))])
            _compare(got["db"], db_full.chunk(n, 0)[r], "bias.grad", where, hint)
        _traffic(res.trace, n, "ColumnParallelLinearFn", [], [("all_reduce", B * S * IN)], hint)
    print(_("ColumnParallelLinearFn: output and all gradients equal the dense layer on {sizes} ranks; forward "
            "communicates nothing, backward one all-reduce of x.grad").format(sizes=", ".join(map(str, tp_sizes))))


@graded(*LAYER_REFS)
def check_row_parallel_linear(fn, tp_sizes=TP_SIZES, timeout: float = TIMEOUT) -> None:
    """y = sum_r x_r W_r^T + b equals the dense output on every rank (one all-reduce in forward, the bias added
    once); x_r.grad, weight and bias gradients equal the dense ones' slices (nothing communicated in backward)."""
    hint = _("forward: partial = x_r @ weight_r.t(), comm.all_reduce(partial, group=ctx.group), then + bias (once, "
             "after the sum); backward: grad_x_r = grad_y @ weight_r, grad_weight_r = grad_y^T x_r, grad_bias = "
             "grad_y summed over (B, S): no communication (g's backward is the identity).")
    for n in tp_sizes:
        seed = fresh_seed()
        x, w, b, gy = _dense_linear(seed)
        y_full, dx_full = F.linear(x, w, b), gy @ w
        dw_full, db_full = gy.flatten(0, 1).t() @ x.flatten(0, 1), gy.sum((0, 1))
        res = run_student(_rank_row, n, fn, seed, timeout=timeout, what="RowParallelLinearFn")
        for r, got in enumerate(res.results):
            where = _("{name} on {n} ranks, rank {r}").format(name="RowParallelLinearFn", n=n, r=r)
            x_r, w_r = x.chunk(n, -1)[r], w.chunk(n, 1)[r]
            _compare(got["y"], y_full, _("the output y"), where, hint, [
                (F.linear(x_r, w_r, b), _("It is this rank's partial sum x_r @ weight_r.t() + bias: the partial "
                                          "outputs were never summed (all-reduce them, that is g).")),
                (F.linear(x_r, w_r), _("It is this rank's partial sum without the bias, never all-reduced.")),
                (y_full + (n - 1) * b, _("The bias was added on every rank before the all-reduce, so it counts n "
                                         "times: add it once, after the sum.")),
                (F.linear(x, w), _("It is the sum without the bias."))])
            _compare(got["dx"], dx_full.chunk(n, -1)[r], "x_r.grad", where, hint, [
                (sum(dx_full.chunk(n, -1)), _("It is the sum of every rank's x_r.grad: g's backward is the identity, "
                                              "do not all-reduce in backward."))])
            _compare(got["dw"], dw_full.chunk(n, 1)[r], "weight.grad", where, hint, [
                (sum(dw_full.chunk(n, 1)), _("It is the sum of every rank's weight gradient: the weight gradient is "
                                             "local, do not all-reduce it."))])
            _compare(got["db"], db_full, "bias.grad", where, hint, [
                (db_full * n, _("It is n times too large: grad_y is already the same on every rank, so the bias "
                                "gradient needs no all-reduce."))])
        _traffic(res.trace, n, "RowParallelLinearFn", [("all_reduce", B * S * OUT)], [], hint)
    print(_("RowParallelLinearFn: output and all gradients equal the dense layer on {sizes} ranks; forward one "
            "all-reduce of the (B, S, out) partial sums, backward communicates nothing").format(
        sizes=", ".join(map(str, tp_sizes))))


def _ce_hint() -> str:
    return _("m = all-reduce MAX of the per-token max; z = logits_r - m; the target's z only on the rank that owns "
             "it (0 elsewhere), all-reduce SUM; sum of exp(z) over the local slice, all-reduce SUM; loss = "
             "log(sum_exp) - z_target. backward: grad = (softmax_r - one_hot_r) * grad_loss, softmax_r = exp(z) / "
             "sum_exp.")


@graded(*CE_REFS)
def check_vocab_parallel_cross_entropy(fn, tp_sizes=TP_SIZES, timeout: float = TIMEOUT) -> None:
    """The per-token loss equals F.cross_entropy on the full logits (values near 800, so exp needs the max
    subtracted), and logits_r.grad equals the dense gradient's vocabulary slice r, on 2 and 4 ranks."""
    tol = 1e-9                                               # float64, the same sums in another order
    for n in tp_sizes:
        seed = fresh_seed()
        logits, targets, upstream = _logits(seed)
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction="none").view(B, S)
        (want * upstream).sum().backward()
        want = want.detach()
        res = run_student(_rank_cross_entropy, n, fn, seed, timeout=timeout, what="VocabParallelCrossEntropyFn")
        for r, got in enumerate(res.results):
            where = _("{name} on {n} ranks, rank {r}").format(name="VocabParallelCrossEntropyFn", n=n, r=r)
            loss = got["loss"]
            _shape_check(loss, want, _("the per-token loss"), where, _ce_hint())
            if not torch.isfinite(loss).all():
                raise AssertionError(_("{where}: the loss has inf or nan ({values}). The logits are about 800 and "
                                       "exp(800) overflows: subtract the global max first (all-reduce the per-token "
                                       "max with op=comm.ReduceOp.MAX). Hint: {hint}").format(
                    where=where, values=_show(loss.flatten()), hint=_ce_hint()))
            mine = logits.chunk(n, -1)[r]
            start = r * (V // n)
            local_ce = F.cross_entropy(mine.flatten(0, 1), (targets.flatten() - start).clamp(0, V // n - 1),
                                       reduction="none").view(B, S)
            _compare(loss, want, _("the per-token loss"), where, _ce_hint(), [
                (local_ce, _("It is the cross-entropy of this rank's slice alone: the max, the sum of exponentials "
                             "and the target logit must be all-reduced over the group."))], tol=tol)
            g_want = full.grad.chunk(n, -1)[r]
            softmax_only = (torch.softmax(logits, -1) * upstream.unsqueeze(-1)).chunk(n, -1)[r]
            _compare(got["grad"], g_want, "logits_r.grad", where, _ce_hint(), [
                (softmax_only, _("It is softmax * grad: subtract 1 at the target (only on the rank that owns it).")),
                (g_want / upstream.unsqueeze(-1),
                 _("It ignores the incoming gradient: multiply by grad_loss[..., None]."))], tol=tol)
    print(_("VocabParallelCrossEntropyFn: loss and logits gradient equal F.cross_entropy on {sizes} ranks").format(
        sizes=", ".join(map(str, tp_sizes))))


@graded(*CE_REFS)
def check_vocab_parallel_cross_entropy_traffic(fn, tp: int = 4, timeout: float = TIMEOUT) -> None:
    """From the trace: forward = exactly 3 all-reduces of one value per token (B*S each), never the logits;
    backward communicates nothing."""
    res = run_student(_rank_cross_entropy, tp, fn, fresh_seed(), timeout=timeout,
                      what="VocabParallelCrossEntropyFn")
    for r in range(tp):
        fwd, bwd = _phases(res.trace, r)
        big = [e for e in fwd + bwd if e.numel > B * S]
        if big:
            raise AssertionError(_("rank {r} communicated {ops}: more than one value per token, e.g. the (B, S, "
                                   "V/tp) logits. The point of the vocab-parallel loss is never to move them. Hint: "
                                   "{hint}").format(r=r, ops=_ops(big), hint=_ce_hint()))
        if [e.op for e in fwd] != ["all_reduce"] * 3 or bwd:
            raise AssertionError(_("rank {r} communicated {fwd} in forward and {bwd} in backward; expected 3 "
                                   "all-reduces of B*S = {n} values in forward (max, target logit, sum of "
                                   "exponentials) and nothing in backward. Hint: {hint}").format(
                r=r, fwd=_ops(fwd), bwd=_ops(bwd), n=B * S, hint=_ce_hint()))
    print(_("VocabParallelCrossEntropyFn: 3 all-reduces of {n} values (one per token) in forward, nothing in "
            "backward, on {tp} ranks").format(n=B * S, tp=tp))


protect(__name__)
