"""Ulysses all-to-all attention and the context-parallel tiny GPT (ring or Ulysses) against one process:
attention output and dQ, dK, dV; the GPT's loss, every parameter gradient and the parameters after optimizer
steps; all-to-all bytes from the trace against 4 B S H / P per layer."""
import pytest
import torch

import parlab
from parlab import comm
from parlab.models import GPT, GPTConfig, causal_attention
from parlab.parallel.context import LAYOUTS, RingStats, shard_sequence, unshard_sequence, work_matrix
from parlab.parallel.context import (ContextParallelGPT, head_to_seq, seq_to_head, ulysses_attention,
                                      ulysses_bytes_per_layer)

B, NH, HD = 2, 4, 3


def _qkv_do(S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, NH, S, HD, generator=g, dtype=torch.float64) for _ in range(4)]  # (B, nh, S, hd)


# ---------------------------------------------------------------------- the all-to-all pair
def _reshard(S):
    P, r = comm.get_world_size(), comm.get_rank()
    x = _qkv_do(S)[0]
    mine = shard_sequence(x, P, r, "contiguous", dim=2)         # (B, nh, S/P, hd)
    heads = seq_to_head(mine)                                    # (B, nh/P, S, hd)
    return heads, head_to_seq(heads)


@pytest.mark.parametrize("P", [2, 4])
def test_seq_to_head_gives_all_positions_of_this_ranks_heads(P):
    S = 2 * P
    res = parlab.run(_reshard, P, S)
    x = _qkv_do(S)[0]
    for r, (heads, back) in enumerate(res.results):
        h = NH // P
        assert torch.equal(heads, x[:, r * h:(r + 1) * h])
        assert torch.equal(back, shard_sequence(x, P, r, "contiguous", dim=2))


# ---------------------------------------------------------------------- Ulysses attention
def _ulysses(S, causal, layout):
    P, r = comm.get_world_size(), comm.get_rank()
    q, k, v, do = _qkv_do(S)
    q, k, v = (shard_sequence(t, P, r, layout, dim=2).requires_grad_() for t in (q, k, v))  # (B, nh, S/P, hd)
    out = ulysses_attention(q, k, v, causal=causal, layout=layout)
    out.backward(shard_sequence(do, P, r, layout, dim=2))
    return [out.detach(), q.grad, k.grad, v.grad]


def _ulysses_lengths(lengths, causal, layout):
    return [_ulysses(S, causal, layout) for S in lengths]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("P", [2, 4])
def test_ulysses_equals_full_attention_output_and_grads(P, causal, layout):
    limit = P if layout == "contiguous" else 2 * P               # the divisibility limit: one position per chunk
    lengths = [limit, 2 * limit]                                  # payload sizes {1, 3} x and {2, 6} x: distinct
    res = parlab.run(_ulysses_lengths, P, lengths, causal, layout, trace=True)
    a2a = res.trace.filter(op="all_to_all").events
    for i, S in enumerate(lengths):
        q, k, v, do = _qkv_do(S)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = causal_attention(q, k, v, causal=causal)
        out.backward(do)
        for j, want in enumerate([out.detach(), q.grad, k.grad, v.grad]):
            got = unshard_sequence([res[r][i][j] for r in range(P)], layout, dim=2)
            # float64; the same per-head attention, only moved between ranks: rounding-level agreement
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        # bytes: q, k, v and out, each (B, S/P, H) per rank, all-to-all'ed forward, their grads backward:
        # a payload of 4 B S H / P each way, of which (P-1)/P leaves the rank
        payload = 4 * B * S * NH * HD // P * 8
        assert ulysses_bytes_per_layer(B, S, NH * HD, P, element_size=8) == {"payload": payload,
                                                                            "sent": payload * (P - 1) / P}
        qkv, o = 3 * payload // 4, payload // 4                    # the sizes tell the two lengths apart
        for r in range(P):
            mine = [e for e in a2a if e.rank == r and e.nbytes in (qkv, o)]
            assert sorted(e.nbytes for e in mine) == [o, o, qkv, qkv]          # forward + backward, 2 calls each
            assert sum(e.nbytes for e in mine) == 2 * payload
            assert sum(e.wire_bytes for e in mine) == 2 * payload * (P - 1) / P


def _ulysses_six_heads():
    x = torch.zeros(1, 6, 2, 3)                                    # 6 heads
    return ulysses_attention(x, x, x)


def test_ulysses_with_heads_not_divisible_by_p_raises_a_clear_error():
    with pytest.raises(parlab.RankError, match=r"n_head 6 is not divisible by P 4; choose P in \[1, 2, 3, 6\]"):
        parlab.run(_ulysses_six_heads, 4, echo=False)


# ---------------------------------------------------------------------- the context-parallel GPT
CFG = GPTConfig(vocab_size=16, seq_len=16, n_layer=2, n_head=4, n_embd=16)   # hd = 4
S_GPT, B_GPT, STEPS = 16, 2, 2


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(CFG.vocab_size, (B_GPT, S_GPT), generator=g)
    return x, torch.randint(CFG.vocab_size, (B_GPT, S_GPT), generator=g)  # (B, S), (B, S)


def _train(model, step_fn):
    """STEPS of AdamW; returns the first step's loss and grads and the final parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for step in range(STEPS):
        opt.zero_grad()
        loss = step_fn(step)
        if first is None:
            first = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return first[0], first[1], {n: p.detach().clone() for n, p in model.named_parameters()}


def _cp_train(attention, layout):
    model = GPT(CFG, seed=0, dtype=torch.float64)
    stats = RingStats()
    cp = ContextParallelGPT(model, attention=attention, layout=layout, stats=stats)

    def step_fn(step):
        x, y = _batch(step)
        _, loss = cp(cp.shard(x), cp.shard(y))                     # this rank's mean loss over B x S/P tokens
        loss.backward()
        cp.average_gradients()
        return cp.global_loss(loss)

    return _train(model, step_fn), stats


def _dense_train():
    model = GPT(CFG, seed=0, dtype=torch.float64)

    def step_fn(step):
        _, loss = model(*_batch(step))
        loss.backward()
        return loss.detach()

    return _train(model, step_fn)


@pytest.mark.parametrize("attention,layout,P", [("ring", "zigzag", 2), ("ring", "contiguous", 4),
                                                ("ulysses", "contiguous", 2), ("ulysses", "zigzag", 4)])
def test_context_parallel_gpt_equals_the_dense_model(attention, layout, P):
    res = parlab.run(_cp_train, P, attention, layout, trace=True)
    loss, grads, params = _dense_train()
    names = list(grads)
    for r in range(P):
        (cp_loss, cp_grads, cp_params), stats = res[r]
        # float64: the same sums in another order (ring merge, gradient average): 1e-12 absolute
        torch.testing.assert_close(cp_loss, loss, rtol=0, atol=1e-12)
        assert list(cp_grads) == names                           # every parameter, tied wte counted once
        for n in names:
            torch.testing.assert_close(cp_grads[n], grads[n], rtol=0, atol=1e-12, msg=lambda m: f"grad {n}: {m}")
        for n in names:                                          # AdamW divides by sqrt(v): looser than grads
            torch.testing.assert_close(cp_params[n], params[n], rtol=0, atol=1e-9, msg=lambda m: f"param {n}: {m}")
        if attention == "ring":                                  # every layer's work went through the schedule
            c = S_GPT // P
            want = [STEPS * CFG.n_layer * w * c * c for w in work_matrix(P, True, layout)[r]]
            assert stats.forward == want and stats.backward == want
    assert res.trace.count("all_reduce", label="cp grad average") == STEPS * P  # one bucket per step per rank


def test_context_parallel_gpt_rejects_bad_settings():
    model = GPT(CFG, seed=0)
    with pytest.raises(ValueError, match="'ring' or 'ulysses'"):
        ContextParallelGPT(model, attention="megatron")
    with pytest.raises(ValueError, match="layout"):
        ContextParallelGPT(model, layout="striped")


def _cp_on_subgroup(attention):
    from parlab.parallel.groups import build_groups
    from parlab.parallel.topology import ParallelGrid
    pg = build_groups(ParallelGrid(4, cp=2, order="dp-cp-tp-pp"), dims=("cp",))   # cp groups [0, 2], [1, 3]
    model = GPT(CFG, seed=0, dtype=torch.float64)
    cp = ContextParallelGPT(model, group=pg.cp, attention=attention, layout="zigzag")
    x, y = _batch(0)
    _, loss = cp(cp.shard(x), cp.shard(y))
    loss.backward()
    cp.average_gradients()
    return pg.ranks("cp"), cp.global_loss(loss), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_context_parallel_gpt_on_a_cp_subgroup_of_non_adjacent_ranks(attention):
    res = parlab.run(_cp_on_subgroup, 4, attention, trace=True)
    model = GPT(CFG, seed=0, dtype=torch.float64)
    _, loss = model(*_batch(0))
    loss.backward()
    for r, (ranks, cp_loss, grads) in enumerate(res.results):
        assert ranks == ([0, 2] if r % 2 == 0 else [1, 3])
        torch.testing.assert_close(cp_loss, loss.detach(), rtol=0, atol=1e-12)   # float64, reordered sums
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=0, atol=1e-12)
    for e in res.trace.comm():                                  # nothing crossed between the two CP groups
        assert e.group in ((0, 2), (1, 3)) and (e.peer is None or e.peer % 2 == e.rank % 2)
