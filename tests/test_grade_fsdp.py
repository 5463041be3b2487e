"""Exercise 09's checks (one ZeRO-3 / FSDP unit) pass the reference answer and reject the usual mistakes: the
gradient summed instead of averaged, the full parameters kept for backward, an all-reduce instead of the
reduce-scatter, and parlab's own FSDP called."""
import pytest
import torch

from parlab import comm
from parlab.parallel.zero import FullyShardedDataParallel
from parlab.course.grading import fsdp as grading


def gather_full(shard):
    full = torch.empty(comm.get_world_size() * shard.numel(), dtype=shard.dtype)
    comm.all_gather(full, shard)
    return full


def _backward(ctx, grad_y, shard, x, average=True, all_reduce=False):
    full = gather_full(shard).requires_grad_(True)
    with torch.enable_grad():
        xx = x.detach().requires_grad_(True)
        dx, dfull = torch.autograd.grad(grading.unit_forward(xx, full), (xx, full), grad_y)
    if all_reduce:
        comm.all_reduce(dfull)
        s = shard.numel()
        dshard = dfull[comm.get_rank() * s:(comm.get_rank() + 1) * s].clone()
    else:
        dshard = torch.empty_like(shard)
        comm.reduce_scatter(dshard, dfull)
    return dx, dshard / (comm.get_world_size() if average else 1)


class Unit(torch.autograd.Function):
    # forward: gather, compute, free; backward: gather, recompute, reduce-scatter / N
    @staticmethod
    def forward(ctx, x, shard):
        ctx.save_for_backward(x, shard)
        return grading.unit_forward(x, gather_full(shard))

    @staticmethod
    def backward(ctx, grad_y):
        x, shard = ctx.saved_tensors
        return _backward(ctx, grad_y, shard, x)


class Summed(Unit):
    @staticmethod
    def backward(ctx, grad_y):
        x, shard = ctx.saved_tensors
        return _backward(ctx, grad_y, shard, x, average=False)


class KeepsFull(Unit):
    @staticmethod
    def forward(ctx, x, shard):
        ctx.full = gather_full(shard)                          # kept until backward: what ZeRO-3 must not do
        ctx.save_for_backward(x, shard)
        return grading.unit_forward(x, ctx.full)


class AllReduce(Unit):
    @staticmethod
    def backward(ctx, grad_y):
        x, shard = ctx.saved_tensors
        return _backward(ctx, grad_y, shard, x, all_reduce=True)


class CallsParlab(Unit):
    @staticmethod
    def forward(ctx, x, shard):
        FullyShardedDataParallel(torch.nn.Linear(2, 2))
        return Unit.forward(ctx, x, shard)


def test_reference_answer_passes_every_check(capsys):
    grading.check_gather_full(gather_full)
    grading.check_fsdp_unit_grads(Unit)
    grading.check_fsdp_unit_trace(Unit)
    assert "1.5x DDP's bytes" in capsys.readouterr().out


@pytest.mark.parametrize("check, wrong, says", [
    (grading.check_fsdp_unit_grads, Summed, "SUM over ranks"),
    (grading.check_fsdp_unit_trace, KeepsFull, "kept a tensor of"),
    (grading.check_fsdp_unit_trace, AllReduce, "all-gathers again and reduce-scatters"),
    (grading.check_fsdp_unit_grads, CallsParlab, "you called parlab's FullyShardedDataParallel; write your own"),
], ids=["summed", "keeps the full parameters", "all-reduce", "calls parlab"])
def test_mistakes_are_rejected(check, wrong, says):
    with pytest.raises(AssertionError, match=says):
        check(wrong)
