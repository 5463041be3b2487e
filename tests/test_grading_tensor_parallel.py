"""Exercise 04's checks bite: the reference layers pass, and plausible wrong answers are rejected with a message
that says what is wrong (and `not written yet` for the untouched exercise)."""
import pytest
import torch

from parlab import comm
from parlab.course.grading import tensor_parallel as grading


def _flat(t):
    return t.flatten(0, 1)


# ----------------------------------------------------------------------------- column-parallel
class Column(torch.autograd.Function):
    reduce_grad_x, reduce_grad_w, reduce_in_forward = True, False, False

    @classmethod
    def forward(cls, ctx, x, w, b, group):
        ctx.save_for_backward(x, w)
        ctx.group = group
        y = x @ w.t() + b
        if cls.reduce_in_forward:
            comm.all_reduce(y, group=group)
        return y

    @classmethod
    def backward(cls, ctx, gy):
        x, w = ctx.saved_tensors
        gx, gw = gy @ w, _flat(gy).t() @ _flat(x)
        if cls.reduce_grad_x:
            comm.all_reduce(gx, group=ctx.group)
        if cls.reduce_grad_w:
            comm.all_reduce(gw, group=ctx.group)
        return gx, gw, gy.sum((0, 1)), None


class ColumnNoReduce(Column):
    reduce_grad_x = False


class ColumnReducesWeightGrad(Column):
    reduce_grad_w = True


class ColumnReducesOutput(Column):
    reduce_in_forward = True


class ColumnNoBiasGrad(Column):
    @classmethod
    def backward(cls, ctx, gy):
        gx, gw, _, _ = super().backward(ctx, gy)
        return gx, gw, None, None


# ----------------------------------------------------------------------------- row-parallel
class Row(torch.autograd.Function):
    reduce, bias_before, reduce_grad_b = True, False, False

    @classmethod
    def forward(cls, ctx, x, w, b, group):
        ctx.save_for_backward(x, w)
        ctx.group = group
        y = x @ w.t() + (b if cls.bias_before else 0)
        if cls.reduce:
            comm.all_reduce(y, group=group)
        return y if cls.bias_before else y + b

    @classmethod
    def backward(cls, ctx, gy):
        x, w = ctx.saved_tensors
        gb = gy.sum((0, 1))
        if cls.reduce_grad_b:
            comm.all_reduce(gb, group=ctx.group)
        return gy @ w, _flat(gy).t() @ _flat(x), gb, None


class RowNoReduce(Row):
    reduce = False


class RowBiasOnEveryRank(Row):
    bias_before = True


class RowReducesBiasGrad(Row):
    reduce_grad_b = True


# ----------------------------------------------------------------------------- cross-entropy
class CE(torch.autograd.Function):
    global_max, mask, subtract_one, use_grad, gather = True, True, True, True, False

    @classmethod
    def forward(cls, ctx, logits, targets, group):
        vl = logits.shape[-1]
        start = comm.get_rank(group) * vl
        if cls.gather:                                         # the full logits on every rank: correct but huge
            full = comm.all_gather_dim(logits.contiguous(), -1, group)
            out = torch.nn.functional.cross_entropy(_flat(full), targets.flatten(), reduction="none")
            ctx.save_for_backward(torch.softmax(full, -1).chunk(comm.get_world_size(group), -1)[
                comm.get_rank(group)], (targets - start).clamp(0, vl - 1), (targets < start) | (targets >= start + vl))
            return out.view(targets.shape)
        m = logits.max(-1).values
        if cls.global_max:
            comm.all_reduce(m, op=comm.ReduceOp.MAX, group=group)
        z = logits - m.unsqueeze(-1)
        outside = (targets < start) | (targets >= start + vl)
        local_t = (targets - start).masked_fill(outside, 0)
        z_t = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        if cls.mask:
            z_t = z_t.masked_fill(outside, 0.0)
        comm.all_reduce(z_t, group=group)
        e = z.exp()
        s = e.sum(-1)
        comm.all_reduce(s, group=group)
        ctx.save_for_backward(e / s.unsqueeze(-1), local_t, outside)
        return s.log() - z_t

    @classmethod
    def backward(cls, ctx, grad):
        sm, local_t, outside = ctx.saved_tensors
        g = sm.clone()
        if cls.subtract_one:
            g.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        return (g * grad.unsqueeze(-1) if cls.use_grad else g), None, None


class CENoMax(CE):
    @staticmethod
    def forward(ctx, logits, targets, group):                  # exp of the raw logits: exp(800) = inf
        vl = logits.shape[-1]
        start = comm.get_rank(group) * vl
        outside = (targets < start) | (targets >= start + vl)
        local_t = (targets - start).masked_fill(outside, 0)
        z_t = logits.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(z_t, group=group)
        s = logits.exp().sum(-1)
        comm.all_reduce(s, group=group)
        ctx.save_for_backward(logits, local_t, outside)
        return s.log() - z_t


class CELocalMax(CE):
    global_max = False


class CENoMask(CE):
    mask = False


class CENoMinusOne(CE):
    subtract_one = False


class CEIgnoresGrad(CE):
    use_grad = False


class CEGathers(CE):
    gather = True


class CEExtraAllReduce(CE):
    @classmethod
    def forward(cls, ctx, logits, targets, group):
        out = super().forward(ctx, logits, targets, group)
        comm.all_reduce(torch.zeros(targets.shape, dtype=logits.dtype), group=group)   # a 4th, useless one
        return out


class Todo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError  # your code here


# ----------------------------------------------------------------------------- tests
def test_reference_solutions_pass(capsys):
    grading.check_column_parallel_linear(Column)
    grading.check_row_parallel_linear(Row)
    grading.check_vocab_parallel_cross_entropy(CE)
    grading.check_vocab_parallel_cross_entropy_traffic(CE)
    out = capsys.readouterr().out
    assert out.count("\n") == 4 and "ColumnParallelLinearFn: output and all gradients equal" in out


def test_the_library_cross_entropy_is_refused_as_parlab_s_own():
    """parlab's private autograd Function would pass (it is correct: tests/test_vocab_parallel_cross_entropy.py),
    but while the check runs it is unavailable to the student's class (issue 14)."""
    from parlab.parallel.tensor.loss import _VocabParallelCrossEntropy

    class Lib(torch.autograd.Function):     # same interface, label added
        @staticmethod
        def forward(ctx, logits, targets, group):
            return _VocabParallelCrossEntropy.forward(ctx, logits, targets, group, "ce")

        @staticmethod
        def backward(ctx, grad):
            return _VocabParallelCrossEntropy.backward(ctx, grad)[:3]

    for check in (grading.check_vocab_parallel_cross_entropy, grading.check_vocab_parallel_cross_entropy_traffic):
        with pytest.raises(AssertionError, match="you called parlab's _VocabParallelCrossEntropy; write your own"):
            check(Lib)


WRONG = [
    ("column", ColumnNoReduce, "only this rank's partial sum"),
    ("column", ColumnReducesWeightGrad, "weight gradient is local"),
    ("column", ColumnReducesOutput, "no all-reduce in forward"),
    ("column", ColumnNoBiasGrad, "bias.grad is None"),
    ("row", RowNoReduce, "never summed"),
    ("row", RowBiasOnEveryRank, "counts n times"),
    ("row", RowReducesBiasGrad, "needs no all-reduce"),
    ("ce", CENoMax, "subtract the global max"),
    ("ce", CELocalMax, "per-token loss is wrong"),
    ("ce", CENoMask, "per-token loss is wrong"),
    ("ce", CENoMinusOne, "subtract 1 at the target"),
    ("ce", CEIgnoresGrad, "ignores the incoming gradient"),
    ("traffic", CEGathers, "more than one value per token"),
    ("traffic", CEExtraAllReduce, "expected 3 all-reduces"),
]
CHECKS = {"column": grading.check_column_parallel_linear, "row": grading.check_row_parallel_linear,
          "ce": grading.check_vocab_parallel_cross_entropy, "traffic": grading.check_vocab_parallel_cross_entropy_traffic}


@pytest.mark.parametrize("check, wrong, says", WRONG, ids=[w.__name__ for _, w, _ in WRONG])
def test_wrong_answers_are_rejected_with_a_reason(check, wrong, says):
    with pytest.raises(AssertionError, match=says) as err:
        CHECKS[check](wrong)
    assert "Hint:" in str(err.value)


@pytest.mark.parametrize("check", list(CHECKS))
def test_an_unwritten_function_says_not_written_yet(check):
    with pytest.raises(AssertionError, match="not written yet"):
        CHECKS[check](Todo)


# ----------------------------------------------------------------------------- lesson 04 figures (parlab.viz.tensor_parallel)
def test_split_matmul_draws_every_panel_and_outlines_each_rank():
    from parlab.viz.tensor_parallel import rank_color, split_matmul
    x, w = torch.arange(8.).view(2, 4), torch.ones(4, 4)
    y = x @ w
    col = split_matmul(x, w, list(y.chunk(2, -1)), y, "column")
    row = split_matmul(x, w, [x[:, :2] @ w[:2], x[:, 2:] @ w[2:]], y, "row")
    for fig in (col, row):
        assert len(fig.data) == 2 + 2 + 1                                # X, W, 2 rank outputs, Y
        assert {rank_color(0), rank_color(1)} <= {s.line.color for s in fig.layout.shapes}
    assert tuple(col.data[2].z[0]) == (6.0, 6.0) and tuple(row.data[-1].z[0]) == (6.0,) * 4
    with pytest.raises(ValueError, match="column"):
        split_matmul(x, w, [y], y, "diagonal")


def test_megatron_diagram_memory_and_time_figures():
    from parlab.viz.tensor_parallel import layer_time, megatron_diagram, memory_per_rank
    fig = megatron_diagram("attention", 4, f_note="fn", g_note="gn", heads=["0", "1", "2", "3"])
    assert sum(t.name.startswith("rank") for t in fig.data if t.name) == 4
    assert any("fn" in a.text for a in fig.layout.annotations) and any("gn" in a.text for a in fig.layout.annotations)
    with pytest.raises(ValueError):
        megatron_diagram("conv", 2)
    mem = memory_per_rank([1, 2, 4], [100, 55, 30], 100, [10, 10, 10])
    assert list(mem.data[0].y) == [0.1, 0.05, 0.025]
    assert len(layer_time([dict(name="a", compute_ms=1, intra_ms=2, inter_ms=3)]).data) == 3
