"""parlab.parallel.data.loss: with unevenly padded targets, DDP / ZeRO / FSDP given `global_mean_loss` take the dense
model's step on the whole batch; each rank's own mean loss does not."""
import pytest
import torch

import parlab
from parlab import comm
from parlab.parallel.data import DistributedDataParallel
from parlab.parallel.data import global_mean_loss, global_target_count
from parlab.parallel.zero import FullyShardedDataParallel
from parlab.models import GPT, GPTConfig
from parlab.parallel.zero import ShardedOptimizer

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, n_embd=16)


def _batch():
    """(4, 8) ids and targets; rank 0's rows (0, 1) are mostly padding (-100), rank 1's rows are not."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=g)   # (B, S)
    y = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len), generator=g)   # (B, S)
    y[0, 2:] = -100
    y[1, 5:] = -100                                                        # rank 0: 5 targets, rank 1: 16
    return x, y


def _dense_step():
    model = GPT(CFG, seed=0, dtype=torch.float64)
    x, y = _batch()
    loss = model(x, y)[1]                                                  # mean over the 21 real targets
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return loss.detach(), {n: p.detach() for n, p in model.named_parameters()}


def _dp_step(kind, exact):
    rank = comm.get_rank()
    x, y = (t.chunk(2)[rank] for t in _batch())                            # (2, S) each
    model = GPT(CFG, seed=0, dtype=torch.float64)
    if kind == "ddp":
        wrapped = DistributedDataParallel(model)
        opt = torch.optim.SGD(wrapped.parameters(), lr=1.0)
    elif kind == "zero2":
        wrapped = model
        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=1.0)
    else:
        wrapped = FullyShardedDataParallel(model)
        opt = torch.optim.SGD(wrapped.parameters(), lr=1.0)
    logits = wrapped(x)[0]                                                 # (2, S, V)
    loss = global_mean_loss(logits, y) if exact else GPT.loss(logits, y)   # exact, or this rank's own mean
    loss.backward()
    opt.step()
    logged = loss.detach().clone()
    comm.all_reduce(logged, op=comm.ReduceOp.AVG)                          # what the labs log
    params = wrapped.full_parameters() if kind == "fsdp" else {n: p.detach() for n, p in model.named_parameters()}
    return logged, params


@pytest.mark.parametrize("kind", ["ddp", "zero2", "fsdp"])
def test_global_mean_loss_gives_the_dense_step_with_uneven_padding(kind):
    ref_loss, ref = _dense_step()
    exact = parlab.run(_dp_step, 2, kind, True)
    naive = parlab.run(_dp_step, 2, kind, False)
    init = dict(GPT(CFG, seed=0, dtype=torch.float64).named_parameters())
    # float64; the ranks' sums and the gradient average only reorder additions: 1e-12 is ~1e4 ulps of slack
    torch.testing.assert_close(exact[0][0], ref_loss, rtol=1e-12, atol=1e-12)
    for name in ref:
        torch.testing.assert_close(exact[0][1][name], ref[name], rtol=1e-10, atol=1e-12, msg=name)
    # the mean of the two ranks' means weighs rank 0's 5 targets like rank 1's 16: a different step
    step_gap = max(float((naive[0][1][n] - ref[n]).abs().max()) for n in ref)
    step_size = max(float((ref[n] - init[n].detach()).abs().max()) for n in ref)
    assert step_gap > 0.05 * step_size
    assert abs(float(naive[0][0]) - float(ref_loss)) > 1e-6


def _count_and_all_ignored():
    rank = comm.get_rank()
    y = torch.full((2, 4), -100)
    y[0, : rank + 1] = 1                                                   # rank 0: 1 target, rank 1: 2
    n = global_target_count(y)
    logits = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    loss = global_mean_loss(logits, torch.full((2, 4), -100))             # nobody has a target
    loss.backward()
    return int(n), float(loss), bool(torch.isfinite(logits.grad).all()), float(logits.grad.abs().max())


def test_count_and_no_targets_anywhere():
    for n, loss, finite, gmax in parlab.run(_count_and_all_ignored, 2):
        assert n == 3 and loss == 0.0 and finite and gmax == 0.0


def test_global_mean_loss_names_mismatched_shapes():
    with pytest.raises(ValueError, match=r"logits \(2, 4, 8\) and targets \(2, 5\) disagree"):
        global_mean_loss(torch.zeros(2, 4, 8), torch.zeros(2, 5, dtype=torch.long))


def test_one_process_is_the_plain_mean():
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    y = torch.randint(0, 7, (3, 5))
    y[0] = -100
    torch.testing.assert_close(global_mean_loss(logits, y), GPT.loss(logits, y))
