"""Tests for the reference GPT (parlab.models) and the shipped data (parlab.corpus)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from parlab.corpus import ALPHABET, BatchSampler, CharTokenizer, load_corpus, make_text, micro_batches
from parlab.models import GPT, CausalSelfAttention, GPTConfig, causal_attention, clone_model


def _unique_numel(model: torch.nn.Module) -> int:
    # model.parameters() already skips a parameter seen twice; count by identity to be explicit.
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return load_corpus(50_000, seed=0)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_embd": 65, "n_head": 4}, "not divisible by n_head"),
        ({"n_layer": 0}, "n_layer must be a positive integer"),
        ({"dropout": 1.0}, "dropout must be in"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_param_count_matches_module(tie: bool, bias: bool) -> None:
    config = GPTConfig(n_layer=3, n_embd=48, n_head=3, tie_embeddings=tie, bias=bias, mlp_ratio=2)
    model = GPT(config)
    assert config.param_count() == _unique_numel(model)
    assert (model.lm_head.weight is model.wte.weight) == tie


# ----------------------------------------------------------------------------- init


def test_same_seed_identical_different_seed_differs() -> None:
    config = GPTConfig()
    a, b, c = GPT(config, seed=0), GPT(config, seed=0), GPT(config, seed=1)
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        if pa.std() > 0:  # LayerNorm weights and biases are constant by design
            assert not torch.equal(pa, pc), name


def test_init_leaves_global_rng_alone_and_float64_is_exact_cast() -> None:
    state = torch.get_rng_state()
    m32 = GPT(GPTConfig(), seed=3)
    m64 = GPT(GPTConfig(), seed=3, dtype=torch.float64)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, p32), (_, p64) in zip(m32.named_parameters(), m64.named_parameters()):
        assert p64.dtype == torch.float64
        assert torch.equal(p32.double(), p64), name


def test_init_statistics() -> None:
    config = GPTConfig(n_layer=4, n_embd=128)
    model = GPT(config)
    assert abs(model.blocks[0].mlp.fc.weight.std().item() - 0.02) < 0.002
    residual = 0.02 / math.sqrt(2 * config.n_layer)
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - residual) < 0.1 * residual
    assert torch.all(model.blocks[0].ln_1.weight == 1) and torch.all(model.blocks[0].attn.q.bias == 0)


def test_clone_model_is_independent_and_keeps_tying() -> None:
    model = GPT(GPTConfig())
    twin = clone_model(model)
    assert twin.lm_head.weight is twin.wte.weight
    with torch.no_grad():
        twin.wte.weight.add_(1.0)
    assert not torch.equal(model.wte.weight, twin.wte.weight)


# ----------------------------------------------------------------------------- forward


def test_float32_and_float64_losses_agree(corpus: torch.Tensor) -> None:
    config = GPTConfig()
    m32 = GPT(config)
    m64 = copy.deepcopy(m32).double()
    x, y = BatchSampler(corpus, batch_size=8, seq_len=config.seq_len).global_batch(0)
    logits32, loss32 = m32(x, y)
    logits64, loss64 = m64(x, y)
    # float32 has eps ~1.2e-7. Each op adds a relative error of about that, sums of K
    # terms (K <= 4H = 256 here) grow it roughly like sqrt(K), and two layers chain some
    # tens of ops, so we expect ~1e-6 at worst; we measure ~2e-7. 1e-5 leaves margin
    # while still catching a real bug (a wrong mask or scale moves the loss by >1e-2).
    assert abs(loss32.item() - loss64.item()) < 1e-5
    torch.testing.assert_close(logits32.double(), logits64, atol=1e-5, rtol=0)


def test_initial_loss_is_about_log_vocab(corpus: torch.Tensor) -> None:
    # Init weights are small (std 0.02), so logits are ~0 and the softmax is ~uniform:
    # loss ~ ln(V) plus half the logit variance (~0.02**2 * H ~ 0.03). Margin 0.1.
    config = GPTConfig()
    x, y = BatchSampler(corpus, batch_size=16, seq_len=config.seq_len).global_batch(0)
    _, loss = GPT(config)(x, y)
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.1


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    config = GPTConfig()
    model = GPT(config, dtype=torch.float64)
    idx = torch.randint(config.vocab_size, (2, config.seq_len), generator=torch.Generator().manual_seed(0))
    t = 10
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % config.vocab_size
    logits, _ = model(idx)
    logits_changed, _ = model(changed)
    torch.testing.assert_close(logits[:, :t], logits_changed[:, :t], atol=1e-12, rtol=0)
    assert not torch.allclose(logits[:, t:], logits_changed[:, t:])  # and the change is seen from t on


def test_forward_equals_pieces(corpus: torch.Tensor) -> None:
    config = GPTConfig()
    model = GPT(config)
    x, y = BatchSampler(corpus, batch_size=4, seq_len=config.seq_len).global_batch(1)
    h = model.embed(x)
    for block in model.blocks[:1]:  # a "pipeline stage" of the first block ...
        h = block(h)
    for block in model.blocks[1:]:  # ... then the rest
        h = block(h)
    logits = model.head(h)
    logits_ref, loss_ref = model(x, y)
    assert torch.equal(logits, logits_ref)
    assert torch.equal(model.loss(logits, y), loss_ref)
    assert model(x)[1] is None


def test_causal_attention_matches_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(causal_attention(q, k, v), ref)
    ref_full = F.scaled_dot_product_attention(q, k, v, is_causal=False)
    torch.testing.assert_close(causal_attention(q, k, v, causal=False), ref_full)


def test_core_attention_can_be_replaced(corpus: torch.Tensor) -> None:
    model = GPT(GPTConfig(), dtype=torch.float64)
    x, y = BatchSampler(corpus, batch_size=2, seq_len=32).global_batch(0)
    _, loss = model(x, y)
    calls = []

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append(q.shape)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    for block in model.blocks:
        block.attn.core_attention = sdpa
    _, loss_sdpa = model(x, y)
    assert len(calls) == 2 and calls[0] == (2, 4, 32, 16)
    torch.testing.assert_close(loss_sdpa, loss)


def test_attention_heads_split_like_tensor_parallel() -> None:
    # Column-split q/k/v by heads and row-split proj: the two half-layers' outputs sum
    # to the full layer's (proj bias added once). The head count comes from the weights.
    torch.manual_seed(0)
    config = GPTConfig()
    full = CausalSelfAttention(config).double()
    x = torch.randn(2, 8, config.n_embd, dtype=torch.float64)
    H, half = config.n_embd, config.n_embd // 2
    out = torch.zeros_like(x)
    for r in range(2):
        cols = slice(r * half, (r + 1) * half)
        shard = copy.deepcopy(full)
        for name in ("q", "k", "v"):
            lin = torch.nn.Linear(H, half, dtype=torch.float64)
            lin.weight.data = getattr(full, name).weight.data[cols].clone()
            lin.bias.data = getattr(full, name).bias.data[cols].clone()
            setattr(shard, name, lin)
        shard.proj = torch.nn.Linear(half, H, dtype=torch.float64)
        shard.proj.weight.data = full.proj.weight.data[:, cols].clone()
        shard.proj.bias.data = full.proj.bias.data.clone() if r == 0 else torch.zeros(H, dtype=torch.float64)
        out += shard(x)
    torch.testing.assert_close(out, full(x))


def test_too_long_sequence_is_rejected() -> None:
    model = GPT(GPTConfig(seq_len=8))
    with pytest.raises(ValueError, match="longer than GPTConfig.seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_adamw_steps_decrease_loss(corpus: torch.Tensor) -> None:
    config = GPTConfig()
    model = GPT(config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = BatchSampler(corpus, batch_size=8, seq_len=config.seq_len, seed=0)
    losses = []
    for step in range(20):  # ~4.16 -> ~2.4 for seeds 0..3; we ask for a drop of 1.0
        _, loss = model(*sampler.global_batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


# ----------------------------------------------------------------------------- data


def test_tokenizer_round_trip_and_vocab() -> None:
    tok = CharTokenizer()
    text = make_text(2_000, seed=1)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.vocab_size == len(ALPHABET) <= GPTConfig().vocab_size
    with pytest.raises(ValueError, match="not in the tokenizer alphabet"):
        tok.encode("A")


def test_corpus_size_vocab_and_determinism() -> None:
    tokens = load_corpus(10_000, seed=0)
    assert tokens.dtype == torch.long and tokens.shape == (10_000,)
    assert 0 <= tokens.min() and tokens.max() < CharTokenizer().vocab_size
    assert torch.equal(tokens, load_corpus(10_000, seed=0))
    assert not torch.equal(tokens, load_corpus(10_000, seed=1))
    assert "+" in make_text(1_000) and "=" in make_text(1_000)


def test_sampler_is_deterministic_and_shifted(corpus: torch.Tensor) -> None:
    sampler = BatchSampler(corpus, batch_size=8, seq_len=16, seed=0)
    x, y = sampler.global_batch(5)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    x2, y2 = BatchSampler(corpus, batch_size=8, seq_len=16, seed=0).global_batch(5)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, sampler.global_batch(6)[0])
    assert not torch.equal(x, BatchSampler(corpus, batch_size=8, seq_len=16, seed=1).global_batch(5)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_dp_shards_partition_the_global_batch(corpus: torch.Tensor, world_size: int) -> None:
    sampler = BatchSampler(corpus, batch_size=8, seq_len=16, seed=0)
    x, y = sampler.global_batch(3)
    shards = [sampler.shard(3, rank, world_size) for rank in range(world_size)]
    assert all(sx.shape == (8 // world_size, 16) for sx, _ in shards)
    assert torch.equal(torch.cat([sx for sx, _ in shards]), x)
    assert torch.equal(torch.cat([sy for _, sy in shards]), y)


def test_non_divisible_batches_raise(corpus: torch.Tensor) -> None:
    sampler = BatchSampler(corpus, batch_size=6, seq_len=16)
    with pytest.raises(ValueError, match="global batch 6 is not divisible by 4 data-parallel ranks"):
        sampler.shard(0, 0, 4)
    x, y = sampler.global_batch(0)
    with pytest.raises(ValueError, match="cannot be split into 4 equal micro-batches"):
        micro_batches(x, y, 4)


def test_micro_batches_partition_the_batch(corpus: torch.Tensor) -> None:
    x, y = BatchSampler(corpus, batch_size=6, seq_len=16).global_batch(0)
    parts = micro_batches(x, y, 3)
    assert len(parts) == 3 and all(mx.shape == (2, 16) for mx, _ in parts)
    assert torch.equal(torch.cat([mx for mx, _ in parts]), x)
    assert torch.equal(torch.cat([my for _, my in parts]), y)
