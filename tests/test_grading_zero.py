"""Exercise 03's checks bite: the reference solution passes each one, and the mistakes students make (uneven or
strided shards, no all-gather, summed instead of averaged gradients, local gradients, an all-reduce where a
reduce-scatter does, a full AdamW on every rank, a formula that shards the wrong state) each fail with a message
that names the problem. Also the lesson's figures (parlab.viz.memory)."""
import pytest
import torch

from parlab import comm
from parlab.parallel.zero import memory
from parlab.course.grading import zero as grading
from parlab.viz.memory import fit_curves, gathered_figure, memory_bars


# ---------------------------------------------------------------------- reference solution (as in the notebook)
def flat_of(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@torch.no_grad()
def unflatten_into(flat, params):
    off = 0
    for p in params:
        p.copy_(flat[off:off + p.numel()].view_as(p))
        off += p.numel()


def partition(flat, rank, world_size):
    s = -(-flat.numel() // world_size)
    return torch.nn.functional.pad(flat, (0, world_size * s - flat.numel()))[rank * s:(rank + 1) * s]


class Zero1:
    reduce = "reduce_scatter_avg"       # the variants below change one thing
    gather = True

    def __init__(self, params, **kw):
        self.params = list(params)
        self.rank, self.world_size = comm.get_rank(), comm.get_world_size()
        self.shard = partition(flat_of(self.params), self.rank, self.world_size).clone().requires_grad_(True)
        self.optim = torch.optim.AdamW([self.shard], **kw)

    @torch.no_grad()
    def step(self):
        n, s = self.world_size, self.shard.numel()
        grads = torch.nn.functional.pad(flat_of(p.grad for p in self.params), (0, n * s - self.psi()))
        shard_grad = torch.empty_like(self.shard)
        if self.reduce == "reduce_scatter_avg":
            comm.reduce_scatter(shard_grad, grads, op=comm.ReduceOp.AVG)
        elif self.reduce == "reduce_scatter_sum":
            comm.reduce_scatter(shard_grad, grads)
        elif self.reduce == "all_reduce":
            comm.all_reduce(grads, op=comm.ReduceOp.AVG)
            shard_grad.copy_(grads[self.rank * s:(self.rank + 1) * s])
        else:                                                   # "local": no reduction at all
            shard_grad.copy_(grads[self.rank * s:(self.rank + 1) * s])
        self.shard.grad = shard_grad
        self.optim.step()
        if self.gather:
            flat = torch.empty(n * s, dtype=self.shard.dtype)
            comm.all_gather(flat, self.shard.detach())
        else:                                                   # only this rank's part is written back
            flat = flat_of(self.params)
            flat = torch.nn.functional.pad(flat, (0, n * s - self.psi()))
            flat[self.rank * s:(self.rank + 1) * s] = self.shard.detach()
        unflatten_into(flat, self.params)

    def psi(self):
        return sum(p.numel() for p in self.params)


class SummedGrads(Zero1):
    reduce = "reduce_scatter_sum"


class LocalGrads(Zero1):
    reduce = "local"


class AllReduceGrads(Zero1):
    reduce = "all_reduce"


class NoGather(Zero1):
    gather = False


class FullAdamW:
    """Plain DP: all-reduce the gradients and step AdamW on every parameter: right values, no sharding."""

    def __init__(self, params, **kw):
        self.params = list(params)
        self.optim = torch.optim.AdamW(self.params, **kw)

    def step(self):
        for p in self.params:
            comm.all_reduce(p.grad, op=comm.ReduceOp.AVG)
        self.optim.step()


def zero_memory(psi, nd, stage, param_bytes=2, grad_bytes=2, k=12):
    return {"params": param_bytes * psi / (nd if stage >= 3 else 1),
            "grads": grad_bytes * psi / (nd if stage >= 2 else 1),
            "optimizer": k * psi / (nd if stage >= 1 else 1)}


def grads_sharded_late(psi, nd, stage, param_bytes=2, grad_bytes=2, k=12):
    """A common slip: gradients sharded only from ZeRO-3 on."""
    return {"params": param_bytes * psi / (nd if stage >= 3 else 1),
            "grads": grad_bytes * psi / (nd if stage >= 3 else 1),
            "optimizer": k * psi / (nd if stage >= 1 else 1)}


# ---------------------------------------------------------------------- the reference passes
def test_reference_solution_passes_every_check(capsys):
    grading.check_partition(partition)
    grading.check_zero1_step(Zero1)
    grading.check_zero1_memory_and_traffic(Zero1)
    grading.check_memory_formulas(zero_memory)
    grading.check_memory_measured(zero_memory)
    out = capsys.readouterr().out
    assert "31.4 GB" in out and "2, 3 ranks" in out


def test_calling_the_library_formula_is_rejected():
    with pytest.raises(AssertionError, match="you called parlab's model_state_bytes; write your own"):
        grading.check_memory_formulas(lambda *a: memory.model_state_bytes(*a))
    assert memory.model_state_bytes(1e9, 8, 1)               # restored afterwards


# ---------------------------------------------------------------------- wrong answers are rejected
@pytest.mark.parametrize("wrong, says", [
    (lambda flat, r, n: flat.chunk(n)[r], "equally long"),                  # no padding: 13 over 4 -> 4, 4, 4, 1
    (lambda flat, r, n: torch.nn.functional.pad(flat, (0, n * -(-flat.numel() // n) - flat.numel()))[r::n],
     "every N-th element"),
    (lambda flat, r, n: partition(flat, (r + 1) % n, n), "is wrong"),
    (lambda flat, r, n: None, "returned NoneType"),
])
def test_partition_rejects(wrong, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_partition(wrong)


@pytest.mark.parametrize("cls, says", [
    (NoGather, "ranks hold different parameters"),
    (SummedGrads, "summed over the ranks, not averaged"),
    (LocalGrads, "the update itself is wrong"),
])
def test_zero1_step_rejects(cls, says):
    with pytest.raises(AssertionError, match=says) as e:
        grading.check_zero1_step(cls, world_sizes=(2,))
    assert "Hint" in str(e.value) and "after step 1" in str(e.value)


@pytest.mark.parametrize("cls, says", [
    (AllReduceGrads, "You call all_reduce"),
    (FullAdamW, "steps 28,064 elements"),
])
def test_zero1_memory_and_traffic_rejects(cls, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_zero1_memory_and_traffic(cls)


def test_not_written_yet_is_said_plainly():
    class Stub(Zero1):
        def __init__(self, params, **kw):
            raise NotImplementedError

    with pytest.raises(AssertionError, match="not written yet"):
        grading.check_zero1_step(Stub, world_sizes=(2,))

    def stub(*a):
        raise NotImplementedError

    with pytest.raises(AssertionError, match="not written yet"):
        grading.check_memory_formulas(stub)


@pytest.mark.parametrize("wrong, says", [
    (grads_sharded_late, r"(?s)stage=2\).*grads.*Hint: the gradients are sharded from ZeRO-2 on"),
    (lambda psi, nd, stage, *w: 16 * psi, "return a dict"),
])
def test_memory_formulas_reject(wrong, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_memory_formulas(wrong)


def test_memory_measured_rejects_a_formula_the_ranks_contradict():
    with pytest.raises(AssertionError, match=r"ZeRO-2 on 4 ranks.*grads"):
        grading.check_memory_measured(grads_sharded_late)


# ---------------------------------------------------------------------- the lesson's figures
def test_memory_bars_stack_parts_and_group_by_stage():
    cols = [dict(stage=memory.STAGES[s], source="formula", **memory.model_state_bytes(100, 4, s)) for s in range(4)]
    fig = memory_bars(cols, unit=1, unit_name="B", limit=900, limit_text="GPU")
    assert [t.name for t in fig.data] == ["parameters", "gradients", "optimizer state"]
    assert fig.layout.barmode == "stack" and list(fig.data[0].x[0]) == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert list(fig.data[2].y) == [1200, 300, 300, 300]          # K psi, then K psi / Nd
    assert fig.layout.shapes[0].y0 == 900
    with pytest.raises(ValueError, match="lacks"):
        memory_bars([dict(stage="DP", source="x", params=1)])


def test_gathered_figure_and_fit_curves():
    pts = [dict(t=0.0, bytes=0, label="gathered root"), dict(t=0.001, bytes=2e6, label="gathered blocks.0"),
           dict(t=0.002, bytes=0, label="freed blocks.0")]
    fig = gathered_figure(pts, full_bytes=8e6)
    assert list(fig.data[0].y) == [0, 2, 0] and fig.data[0].line.shape == "hv"
    assert gathered_figure([]).layout.annotations                # an empty trace says why
    fig = fit_curves(175e9, 80e9, mark_nd=64)
    names = [t.name for t in fig.data]
    assert names[:4] == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"] and "one 80 GB GPU" in names
    gpu = fig.data[names.index("one 80 GB GPU")]
    assert list(gpu.y) == [80, 80] and not fig.layout.shapes     # a trace, not a shape, on the log axes
    assert fig.data[3].y[0] == pytest.approx(2800)                # GPT-3: 16 x 175e9 bytes on one GPU
