"""vocab_parallel_cross_entropy against F.cross_entropy on the full logits: every reduction, ignore_index
(padding), fp32 and bf16 logits, 1, 2 and 4 ranks; bad targets and bad arguments give a ValueError; the
statistics travel in fp32 (issue 18, item 7). Then every caller of the loss with padded targets against the
dense GPT: the TP GPT, ContextParallelGPT, PipelineParallel (with dp) and parlab.parallel.hybrid, whose mean must
divide by the global number of non-ignored tokens."""
import functools

import pytest
import torch
import torch.nn.functional as F

import parlab
from parlab import comm
from parlab.parallel.tensor import vocab_parallel_cross_entropy
from parlab.parallel.tensor.loss import check_targets

RUN = dict(timeout=90, echo=False)
B, S, V = 3, 5, 12                     # V divisible by every tp tested
REDUCTIONS = ("none", "sum", "mean")
DTYPES = ("float32", "bfloat16")
IGNORES = (-100, 3)                    # the default, and an id inside the vocabulary (torch allows both)


def _case(ignore_index: int):
    """Logits about 50 +- 4 (exp overflows fp32 without the max), targets with padding in rows 0 and 2."""
    g = torch.Generator().manual_seed(11)
    logits = 50 + 4 * torch.randn(B, S, V, generator=g)
    targets = torch.randint(0, V, (B, S), generator=g)
    targets[0, 0], targets[1, 1] = 0, V - 1          # the first and the last rank own a target
    targets[0, 3:] = ignore_index                    # padding
    targets[2, 2] = ignore_index
    upstream = torch.rand(B, S, generator=g) + 0.5    # d total / d per-token loss
    return logits, targets, upstream


def _total(loss, upstream):
    return (loss.float() * upstream).sum() if loss.dim() else loss.float() * 1.7


def _rank():
    n, r = comm.get_world_size(), comm.get_rank()
    out = {}
    for dtype in DTYPES:
        for ignore in IGNORES:
            logits, targets, upstream = _case(ignore)
            for red in REDUCTIONS:
                mine = logits.to(getattr(torch, dtype)).chunk(n, -1)[r].clone().requires_grad_()  # (B, S, V/n)
                loss = vocab_parallel_cross_entropy(mine, targets, ignore_index=ignore, reduction=red)
                _total(loss, upstream).backward()
                out[(dtype, ignore, red)] = (loss.detach(), mine.grad)
    # every target ignored: "mean" is nan like torch's, "sum" 0
    mine = logits.chunk(n, -1)[r].clone().requires_grad_()
    pad = torch.full((B, S), -100)
    out["all ignored"] = [vocab_parallel_cross_entropy(mine, pad, reduction=red).detach() for red in REDUCTIONS]
    # bad targets name the value; bad reduction names itself
    errors = []
    for bad in (V, -1, -7, 10 ** 6):
        t = targets.clone()
        t[2, 1] = bad
        try:
            vocab_parallel_cross_entropy(mine, t)
        except ValueError as e:
            errors.append(str(e))
    for kwargs in (dict(reduction="avg"),):
        try:
            vocab_parallel_cross_entropy(mine, targets, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@functools.lru_cache(maxsize=None)
def _run(tp: int):
    res = parlab.run(_rank, tp, trace=True, **RUN)
    return res.results, res.trace


# tolerances: fp32 statistics summed in another order over the ranks: a few ulps of fp32 on losses ~10.
# bf16: the loss and the gradient are computed in fp32 and rounded once to bf16 (8 bits of mantissa): within
# 2 bf16 ulps (2 * 2^-8 relative) of the fp32 reference on the same bf16-rounded logits.
TOL = {"float32": dict(rtol=2e-6, atol=2e-6), "bfloat16": dict(rtol=8e-3, atol=2e-3)}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_matches_f_cross_entropy(tp):
    results, _ = _run(tp)
    for dtype in DTYPES:
        for ignore in IGNORES:
            logits, targets, upstream = _case(ignore)
            for red in REDUCTIONS:
                full = logits.to(getattr(torch, dtype)).float().clone().requires_grad_()   # the same values, fp32
                want = F.cross_entropy(full.flatten(0, 1), targets.flatten(), ignore_index=ignore,
                                       reduction=red)
                want = want.view(B, S) if red == "none" else want
                _total(want, upstream).backward()
                dense_dtype = F.cross_entropy(full.to(getattr(torch, dtype)).flatten(0, 1), targets.flatten(),
                                              ignore_index=ignore, reduction=red).dtype
                for r, out in enumerate(results):
                    loss, grad = out[(dtype, ignore, red)]
                    msg = f"tp={tp} rank {r} {dtype} ignore_index={ignore} reduction={red}"
                    assert loss.dtype == dense_dtype == getattr(torch, dtype), msg
                    assert grad.dtype == getattr(torch, dtype), msg
                    torch.testing.assert_close(loss.float(), want.detach(), **TOL[dtype], msg=msg)
                    torch.testing.assert_close(grad.float(), full.grad.chunk(tp, -1)[r], **TOL[dtype], msg=msg)
                    if red == "none":   # ignored positions: exactly 0 loss and 0 gradient, as torch
                        pad = targets == ignore
                        assert (loss[pad] == 0).all() and (grad[pad] == 0).all(), msg


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_all_targets_ignored_gives_torchs_nan_mean_and_zero_sum(tp):
    logits = _case(-100)[0]
    pad = torch.full((B, S), -100)
    want = [F.cross_entropy(logits.flatten(0, 1), pad.flatten(), reduction=r) for r in REDUCTIONS]
    for out in _run(tp)[0]:
        none, total, mean = out["all ignored"]
        assert (none == 0).all() and none.shape == (B, S) and want[0].eq(0).all()
        assert total.item() == want[1].item() == 0
        assert mean.isnan() and want[2].isnan()


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bad_targets_and_reduction_are_named(tp):
    for out in _run(tp)[0]:
        errors = out["errors"]
        assert len(errors) == 5, errors
        for bad, msg in zip((V, -1, -7, 10 ** 6), errors):
            assert f"target {bad} at position (2, 1)" in msg and f"[0, {V})" in msg and "ignore_index=-100" in msg
        assert "'avg'" in errors[4] and "mean" in errors[4]


def test_check_targets_needs_integer_ids_and_matching_shapes():
    with pytest.raises(ValueError, match="integer class ids"):
        check_targets(torch.zeros(2, 3), 10)
    check_targets(torch.tensor([0, 9, -100]), 10)     # fine
    with pytest.raises(ValueError, match="target 10 at position"):
        check_targets(torch.tensor([0, 10, -100]), 10)


@pytest.mark.parametrize("tp", [2, 4])
def test_statistics_are_all_reduced_in_fp32_for_bf16_logits(tp):
    """Megatron computes the loss on logits.float(): the three per-token all-reduces carry fp32 numbers."""
    _, trace = _run(tp)
    for r in range(tp):
        evs = [e for e in trace.filter(rank=r).comm() if e.label.startswith("cross-entropy")]
        assert evs and all(e.op == "all_reduce" and e.numel == B * S for e in evs)
        assert {e.nbytes for e in evs} == {B * S * 4}   # 4 bytes per value, also for the bf16 cases


# ----------------------------------------------------------------------------- callers, with padded targets
# float64 models: the distributed runs differ from the one-process model only in summation order (~1e-16
# relative), far below this; the padding bug this guards against changed the loss in the first digit.
F64 = dict(rtol=1e-10, atol=1e-12)


def _cfg():
    from parlab.models import GPTConfig
    return GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=4, n_embd=16)


def _padded_batch():
    """(8, 8) ids and targets whose padding (-100) is spread unevenly over rows (dp replicas, micro-batches)
    and positions (cp shards): rank shares of the non-ignored targets differ everywhere."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 16, (8, 8), generator=g)
    y = torch.roll(x, -1, dims=1)
    y[0, 5:] = -100
    y[1, 1:] = -100
    y[2, 0] = -100
    y[5, 3:7] = -100
    y[6, 6:] = -100
    return x, y


def _dense_padded():
    from parlab.models import GPT
    model = GPT(_cfg(), seed=0, dtype=torch.float64)
    _, loss = model(*_padded_batch())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_padding_changes_the_dense_loss():
    """The reference the callers are held to really differs from a mean over all positions."""
    from parlab.models import GPT
    x, y = _padded_batch()
    logits, loss = GPT(_cfg(), seed=0, dtype=torch.float64)(x, y)
    every = F.cross_entropy(logits.flatten(0, 1), y.clamp(min=0).flatten())
    assert (y == -100).sum() == 17 and abs(loss.item() - every.item()) > 1e-3


def _tp_gpt_padded(sp):
    from parlab.models import GPT
    from parlab.parallel.tensor import dense_grads, parallelize_gpt, sync_sequence_parallel_grads
    model = parallelize_gpt(GPT(_cfg(), seed=0, dtype=torch.float64), sequence_parallel=sp)
    _, loss = model(*_padded_batch())
    loss.backward()
    sync_sequence_parallel_grads(model)
    return loss.detach(), dense_grads(model)


@pytest.mark.parametrize("tp,sp", [(2, False), (4, True)])
def test_tensor_parallel_gpt_loss_ignores_padding_like_the_dense_gpt(tp, sp):
    want_loss, want = _dense_padded()
    for loss, grads in parlab.run(_tp_gpt_padded, tp, sp, **RUN).results:
        torch.testing.assert_close(loss, want_loss, **F64)
        for n, g in want.items():
            torch.testing.assert_close(grads[n], g, **F64, msg=n)


def _cp_gpt_padded():
    from parlab.models import GPT
    from parlab.parallel.context import ContextParallelGPT
    out = []
    for attention, layout in (("ring", "zigzag"), ("ulysses", "contiguous")):
        cp = ContextParallelGPT(GPT(_cfg(), seed=0, dtype=torch.float64), attention=attention, layout=layout)
        x, y = _padded_batch()
        _, loss = cp(cp.shard(x), cp.shard(y))
        loss.backward()
        cp.average_gradients()
        out.append((cp.global_loss(loss), {n: p.grad.clone() for n, p in cp.model.named_parameters()}))
    return out


def test_context_parallel_gpt_divides_by_the_global_count_of_targets():
    want_loss, want = _dense_padded()
    for per_rank in parlab.run(_cp_gpt_padded, 2, **RUN).results:
        for loss, grads in per_rank:
            torch.testing.assert_close(loss, want_loss, **F64)
            for n, g in want.items():
                torch.testing.assert_close(grads[n], g, **F64, msg=n)


def _pp_dp_padded():
    from parlab.parallel import pipeline as sch
    from parlab.parallel.groups import build_groups
    from parlab.models import GPT
    from parlab.parallel.pipeline import PipelineParallel
    from parlab.parallel.topology import ParallelGrid
    pg = build_groups(ParallelGrid(4, pp=2, dp=2), dims=("dp", "pp"))
    x, y = _padded_batch()
    d = pg.coords["dp"]
    pp = PipelineParallel(GPT(_cfg(), seed=0, dtype=torch.float64), sch.one_f_one_b(2, 2), group=pg.pp,
                          dp_group=pg.dp)
    loss = pp.step(x[4 * d:4 * d + 4], y[4 * d:4 * d + 4])   # replica d: rows 4d..4d+3, 2 micro-batches
    return loss, {k: g.clone() for k, g in pp.grads().items()}


def test_pipeline_with_data_parallel_divides_by_the_global_count_of_targets():
    want_loss, want = _dense_padded()
    res = parlab.run(_pp_dp_padded, 4, **RUN).results
    # pp groups [0, 2] and [1, 3]: the last stage is on ranks 2 and 3; their shares average to the global mean
    torch.testing.assert_close((res[2][0] + res[3][0]) / 2, want_loss, **F64)
    for r, (_, grads) in enumerate(res):
        assert grads
        for n, g in grads.items():
            torch.testing.assert_close(g, want[n], **F64, msg=f"rank {r} {n}")


HYBRID = [dict(tp=2, cp=1, pp=1),                                   # dp 2 x tp 2
          dict(tp=1, cp=2, pp=2, schedule="gpipe"),                 # cp 2 x pp 2
          dict(tp=1, cp=2, pp=1, zero_stage=1),                     # dp 2 x cp 2, ZeRO-1 over dp-cp
          dict(tp=2, cp=1, pp=2, sequence_parallel=True)]           # tp 2 (SP) x pp 2


def _hybrid_padded():
    from parlab.parallel.groups import build_groups
    from parlab.parallel.hybrid import build_hybrid
    from parlab.models import GPT
    from parlab.parallel.topology import ParallelGrid
    out = []
    for kw in HYBRID:
        kw = dict(kw)
        grid = ParallelGrid(4, tp=kw.pop("tp"), cp=kw.pop("cp"), pp=kw.pop("pp"))
        groups = build_groups(grid, dims=("tp", "cp", "pp", "dp-cp"))
        h = build_hybrid(GPT(_cfg(), seed=0, dtype=torch.float64), groups, optimizer_cls=torch.optim.SGD, lr=1.0,
                         **kw)
        out.append((h.train_step(*_padded_batch()), h.dense_state_dict()))
    return out


def test_hybrid_divides_by_the_global_count_of_targets():
    from parlab.models import GPT
    model = GPT(_cfg(), seed=0, dtype=torch.float64)
    _, want_loss = model(*_padded_batch())
    want_loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()                # the same one step, lr 1: param - grad
    want = model.state_dict()
    for rank, per_layout in enumerate(parlab.run(_hybrid_padded, 4, timeout=180, echo=False).results):
        for kw, (loss, state) in zip(HYBRID, per_layout):
            torch.testing.assert_close(loss, want_loss.detach(), **F64, msg=f"rank {rank} {kw}")
            for n, v in state.items():
                torch.testing.assert_close(v, want[n], **F64, msg=f"rank {rank} {kw} {n}")


def test_mismatched_shapes_and_unknown_reduction_are_named_before_any_communication():
    logits = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"logits \(2, 3, 4\) and targets \(2, 4\) disagree"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction must be one of .* got 'batchmean'"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.long), reduction="batchmean")
