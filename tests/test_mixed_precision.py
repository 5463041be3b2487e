"""Mixed precision: the labs' --dtype bfloat16 keeps fp32 master weights and computes under bf16 autocast;
`LossScaler` rescues float16 gradients from underflow and makes every rank skip an overflowing step together."""
import argparse

import pytest
import torch

import parlab
from parlab import comm
from parlab.corpus import BatchSampler, load_corpus
from parlab.parallel.zero import FullyShardedDataParallel
from parlab.labs import Lab, parser
from parlab.parallel.zero import LossScaler
from parlab.models import GPT, GPTConfig
from parlab.launch import Context

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, n_embd=16)


def _batch(rows=4):
    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g)   # (B, S)
    y = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g)   # (B, S)
    return x, y


# ----------------------------------------------------------------------------- the labs' bf16 mode
def _lab(dtype):
    args = argparse.Namespace(dtype=dtype, seed=0)
    ctx = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="test")
    return Lab("test", args, ctx, CFG, BatchSampler(load_corpus(n_chars=2000), 2, 4))


def _lab_step(lab, lr=1e-2, model=None):
    model = lab.model() if model is None else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    x, y = _batch()
    with lab.autocast():
        logits, loss = model(x, y)
    loss.backward()
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.is_floating_point()]
    return model, logits, state


def test_lab_bfloat16_is_fp32_master_weights_with_bf16_compute():
    model, logits, state = _lab_step(_lab("bfloat16"))
    assert logits.dtype == torch.bfloat16                                  # compute in bf16 (autocast)
    assert {p.dtype for p in model.parameters()} == {torch.float32}        # master weights
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert state and {t.dtype for t in state} == {torch.float32}          # AdamW's m and v


def test_lab_bfloat16_step_is_close_to_fp32():
    m1, _, _ = _lab_step(_lab("bfloat16"))
    m2, _, _ = _lab_step(_lab("float32"))
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        # AdamW's first step moves each weight by ~lr = 1e-2 (times the gradient's sign); bf16 gradients can
        # flip the sign only where the gradient is ~0, so the steps agree within 2.5 lr per element
        assert float((p - q).detach().abs().max()) <= 2.5e-2, n


def test_master_weights_keep_updates_below_bfloat16_resolution():
    """AdamW's first step moves every weight by ~lr = 1e-5; on the N(0, 0.02) weights that is ~1/2000 of the
    weight, below bf16's 2^-8 relative resolution: a pure-bf16 model rounds most of these updates away, the
    fp32 master weights of --dtype bfloat16 keep them all."""
    init = torch.cat([p.detach().flatten() for p in GPT(CFG, seed=0).parameters()])
    mixed, _, _ = _lab_step(_lab("bfloat16"), lr=1e-5)
    kept = float((torch.cat([p.detach().flatten() for p in mixed.parameters()]) != init).float().mean())
    pure, _, _ = _lab_step(_lab("bfloat16"), lr=1e-5, model=GPT(CFG, seed=0, dtype=torch.bfloat16))
    init16 = init.to(torch.bfloat16)
    kept16 = float((torch.cat([p.detach().flatten() for p in pure.parameters()]) != init16).float().mean())
    assert kept > 0.99 and kept16 < 0.5


def test_lab_help_says_what_bfloat16_means():
    text = " ".join(parser("zero", "x").format_help().split())
    assert "bfloat16: mixed precision" in text and "master weights" in text and "autocast" in text


def test_lab_float32_and_float64_are_plain():
    for name, dt in (("float32", torch.float32), ("float64", torch.float64)):
        lab = _lab(name)
        assert lab.dtype == dt and lab.compute_dtype == dt
        model, logits, _ = _lab_step(lab)
        assert logits.dtype == dt and {p.dtype for p in model.parameters()} == {dt}


# ----------------------------------------------------------------------------- loss scaling for float16
TINY = 2.0 ** -20     # scales the loss so that most fp16 gradients fall below 2^-24 (fp16's smallest)


def _fsdp_grads(compute_dtype, scaled):
    rank = comm.get_rank()
    model = FullyShardedDataParallel(GPT(CFG, seed=0), compute_dtype=compute_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = (t.chunk(2)[rank] for t in _batch())
    loss = model(x, y)[1] * TINY
    if scaled:
        scaler = LossScaler(init_scale=2.0 ** 12)    # the fp16 loss's own gradient is S: below 65504
        scaler.scale(loss).backward()
        assert not scaler.unscale_(opt)
    else:
        loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_loss_scaler_rescues_float16_gradients_from_underflow():
    ref = parlab.run(_fsdp_grads, 2, None, False)                         # fp32 compute
    plain = parlab.run(_fsdp_grads, 2, torch.float16, False)
    scaled = parlab.run(_fsdp_grads, 2, torch.float16, True)
    for r in range(2):
        norm = float(ref[r].norm())
        assert norm > 0
        # unscaled: the gradients (~1e-2 x 2^-20 ~ 1e-8) flush to zero in fp16: most of the norm is lost
        assert float((plain[r] - ref[r]).norm()) > 0.5 * norm
        # scaled by 2^12 they sit in fp16's normal range: fp16 rounding only (2^-11 relative per value, a few
        # roundings per gradient along the backward): within 2% of the norm
        assert float((scaled[r] - ref[r]).norm()) < 0.02 * norm


def _overflow_on_one_rank():
    rank = comm.get_rank()
    model = torch.nn.Linear(4, 2, dtype=torch.float32)
    torch.nn.init.constant_(model.weight, 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    history = []
    for step in range(4):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 4)).sum()).backward()
        if step == 0 and rank == 0:
            model.weight.grad[0, 0] = float("inf")                         # only rank 0 overflows
        before = model.weight.detach().clone()
        stepped = scaler.step(opt)
        scaler.update()
        history.append((stepped, scaler.scale_value, not torch.equal(before, model.weight)))
    return history, scaler.skipped


def test_every_rank_skips_a_step_that_overflowed_on_one():
    res = parlab.run(_overflow_on_one_rank, 2)
    # step 0: rank 0's inf makes both skip and halve 8 -> 4; steps 1 and 2 are good: the scale doubles after
    # growth_interval=2 of them; step 3 good again
    expected = [(False, 4.0, False), (True, 4.0, True), (True, 8.0, True), (True, 8.0, True)]
    for history, skipped in res:
        assert history == expected and skipped == 1


def test_loss_scaler_unscales_before_the_step():
    model = torch.nn.Linear(3, 1, bias=False, dtype=torch.float32)
    ref = torch.nn.Linear(3, 1, bias=False, dtype=torch.float32)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(5, 3)
    scaler = LossScaler(init_scale=1024.0)
    scaler.scale(model(x).pow(2).mean()).backward()
    ref(x).pow(2).mean().backward()
    assert scaler.step(torch.optim.SGD(model.parameters(), lr=0.0)) is True
    torch.testing.assert_close(model.weight.grad, ref.weight.grad)        # 1024 is a power of two: exact


@pytest.mark.parametrize("kwargs,match", [
    ({"init_scale": 0}, "init_scale must be a positive finite number"),
    ({"init_scale": float("inf")}, "init_scale must be a positive finite number"),
    ({"growth_factor": 1.0}, "growth_factor must be > 1"),
    ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\)"),
    ({"growth_interval": 0}, "growth_interval must be a positive integer"),
    ({"growth_interval": 2.5}, "growth_interval must be a positive integer"),
])
def test_loss_scaler_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaler(**kwargs)


def test_loss_scaler_update_needs_a_step():
    with pytest.raises(RuntimeError, match="call scaler.step"):
        LossScaler().update()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(opt)
