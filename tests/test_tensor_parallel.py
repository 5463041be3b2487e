"""Megatron tensor parallelism (and sequence parallelism) against the dense model built from the same weights:
outputs, input gradients, every weight gradient, the loss, parameters after SGD steps; and the communication
the paper promises, counted from the trace."""
import functools

import pytest
import torch
import torch.nn as nn

import parlab
from parlab import comm
from parlab.models import GPT, GPTConfig
from parlab.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, check_divisible, dense_grads,
                                    dense_state_dict, gpt_plan, parallelize, parallelize_gpt,
                                    sync_sequence_parallel_grads)

# (parlab.run forks ranks with one torch thread each; the timeout turns a deadlock into a failure)
RUN = dict(timeout=60, echo=False)
CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=4, n_embd=16)
B, S, L, H = 2, 8, CFG.n_layer, CFG.n_embd
F64 = dict(rtol=1e-12, atol=1e-12)  # float64: only the order of summation differs (partial sums over ranks)
F32 = dict(rtol=1e-5, atol=1e-6)    # float32 (eps 1.2e-7): the same reordering, amplified through 2 layers


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CFG.vocab_size, (B, S), generator=g), torch.randint(0, CFG.vocab_size, (B, S), generator=g)


# ----------------------------------------------------------------------------- the whole tiny GPT
def _tp_gpt(sp: bool, dtype_name: str):
    model = GPT(CFG, seed=0, dtype=getattr(torch, dtype_name))
    parallelize_gpt(model, sequence_parallel=sp)
    idx, targets = _batch()
    logits, loss = model(idx, targets)          # logits (B, S, V/tp)
    loss.backward()
    synced = sync_sequence_parallel_grads(model)
    return dict(loss=loss.detach(), local_vocab=logits.shape[-1], synced=synced,
                logits=comm.all_gather_dim(logits.detach(), -1, label="check logits"),
                grads=dense_grads(model), state=dense_state_dict(model),
                tied=model.lm_head.weight is model.wte.weight)


@functools.lru_cache(maxsize=None)
def _run_gpt(tp: int, sp: bool, dtype_name: str = "float64"):
    res = parlab.run(_tp_gpt, tp, sp, dtype_name, trace=True, **RUN)
    return res.results, res.trace


@functools.lru_cache(maxsize=None)
def _dense(dtype_name: str = "float64"):
    model = GPT(CFG, seed=0, dtype=getattr(torch, dtype_name))
    idx, targets = _batch()
    logits, loss = model(idx, targets)
    loss.backward()
    return model, logits.detach(), loss.detach()


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_matches_dense(tp, sp):
    results, _ = _run_gpt(tp, sp)
    dense, logits, loss = _dense()
    for out in results:  # every rank
        assert out["local_vocab"] == CFG.vocab_size // tp and out["tied"]
        torch.testing.assert_close(out["loss"], loss, **F64)
        torch.testing.assert_close(out["logits"], logits, **F64)
        assert set(out["grads"]) == {n for n, _ in dense.named_parameters()}
        for name, p in dense.named_parameters():
            torch.testing.assert_close(out["grads"][name], p.grad, **F64, msg=lambda m, n=name: f"{n}: {m}")


def test_gpt_float32_matches_dense_to_stated_tolerance():
    results, _ = _run_gpt(2, True, "float32")
    dense, logits, loss = _dense("float32")
    out = results[1]
    torch.testing.assert_close(out["loss"], loss, **F32)
    torch.testing.assert_close(out["logits"], logits, **F32)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(out["grads"][name], p.grad, **F32, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_gather_to_dense_is_the_inverse_of_sharding(sp):
    results, _ = _run_gpt(4, sp)
    dense = GPT(CFG, seed=0, dtype=torch.float64)
    for out in results:
        assert out["state"].keys() == dense.state_dict().keys()
        for name, t in dense.state_dict().items():
            assert torch.equal(out["state"][name], t), name


@torch.no_grad()
def _sgd_step(model, lr=0.5):
    """Plain SGD, p -= lr * grad (torch.optim would give the same; this avoids its import in every rank)."""
    for p in model.parameters():
        p -= lr * p.grad
        p.grad = None


def _sgd(sp: bool, steps: int):
    model = parallelize_gpt(GPT(CFG, seed=0, dtype=torch.float64), sequence_parallel=sp)
    idx, targets = _batch()
    for _ in range(steps):
        model(idx, targets)[1].backward()
        sync_sequence_parallel_grads(model)
        _sgd_step(model)  # each rank steps its own shards
    return dense_state_dict(model)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_parameters_after_sgd_steps_match_dense(sp):
    steps = 2
    results = parlab.run(_sgd, 2, sp, steps, **RUN).results
    dense = GPT(CFG, seed=0, dtype=torch.float64)
    idx, targets = _batch()
    for _ in range(steps):
        dense(idx, targets)[1].backward()
        _sgd_step(dense)
    for state in results:
        for name, t in dense.state_dict().items():
            torch.testing.assert_close(state[name], t, **F64, msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------------------- communication, from the trace
def _model_events(trace, rank):
    """Collectives of one training step's forward and backward (not the checks that gather results)."""
    return [e for e in trace.filter(rank=rank).comm() if not e.label.startswith(("gather", "check", "sp grads"))]


def _direction(e):
    return e.label.rsplit(" ", 1)[-1]


@pytest.mark.parametrize("tp", [2, 4])
def test_two_all_reduces_forward_and_two_backward_per_layer(tp):
    _, trace = _run_gpt(tp, False)
    for r in range(tp):
        evs = _model_events(trace, r)
        assert {e.op for e in evs} == {"all_reduce"}
        for i in range(L):
            layer = [e for e in evs if e.label.startswith(f"blocks.{i}.")]
            assert sum(_direction(e) == "fwd" for e in layer) == 2   # g after attn.proj and after mlp.proj
            assert sum(_direction(e) == "bwd" for e in layer) == 2   # f before q/k/v and before mlp.fc
            assert all(e.numel == B * S * H for e in layer)          # one activation (B, S, H) each
        # outside the layers: the embedding's g (fwd), lm_head's f (bwd), the loss's 3 per-token all-reduces
        assert sum(_direction(e) == "fwd" for e in evs) == 2 * L + 1 + 3
        assert sum(_direction(e) == "bwd" for e in evs) == 2 * L + 1


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_swaps_each_all_reduce_for_gather_and_reduce_scatter_of_equal_bytes(tp):
    _, sp_trace = _run_gpt(tp, True)
    _, tp_trace = _run_gpt(tp, False)
    for r in range(tp):
        evs = _model_events(sp_trace, r)
        for i in range(L):
            layer = [e for e in evs if e.label.startswith(f"blocks.{i}.")]
            for d in ("fwd", "bwd"):
                ops = sorted(e.op for e in layer if _direction(e) == d)
                assert ops == ["all_gather"] * 2 + ["reduce_scatter"] * 2, (i, d)
        not_loss = [e for e in evs if not e.label.startswith("cross-entropy")]
        assert not any(e.op == "all_reduce" for e in not_loss)
        # same wire bytes: all-reduce 2(N-1)/N X  ==  all-gather (N-1)/N X + reduce-scatter (N-1)/N X
        sp_bytes = sum(e.wire_bytes for e in not_loss)
        tp_bytes = sum(e.wire_bytes for e in _model_events(tp_trace, r) if not e.label.startswith("cross-entropy"))
        X = B * S * H * 8  # one (B, S, H) float64 activation
        assert sp_bytes == pytest.approx(tp_bytes) == pytest.approx((2 * L + 1) * 2 * 2 * (tp - 1) / tp * X)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_cross_entropy_moves_per_token_scalars_only(sp):
    tp = 4
    _, trace = _run_gpt(tp, sp)
    for r in range(tp):
        ce = [e for e in trace.filter(rank=r).comm() if e.label.startswith("cross-entropy")]
        assert [e.label for e in ce] == ["cross-entropy max fwd", "cross-entropy target logit fwd",
                                         "cross-entropy sum exp fwd"]
        assert all(e.op == "all_reduce" and e.numel == B * S for e in ce)  # never the (B, S, V) logits


def test_sequence_parallel_gradients_are_summed_in_one_all_reduce():
    tp = 2
    results, trace = _run_gpt(tp, True)
    # layer norms (ln_1, ln_2 per layer + ln_f, weight and bias), the row-parallel biases, the position table
    numel = (2 * L + 1) * 2 * H + 2 * L * H + CFG.seq_len * H
    for r in range(tp):
        evs = trace.filter(rank=r, label="sp grads").events
        assert len(evs) == 1 and evs[0].op == "all_reduce" and evs[0].numel == numel
        assert results[r]["synced"] == (2 * L + 1) * 2 + 2 * L + 1
    assert _run_gpt(tp, False)[1].count(label="sp grads") == 0


# ----------------------------------------------------------------------------- single layers, input gradients
def _dense_linears(dtype=torch.float64):
    torch.manual_seed(3)
    return nn.Linear(8, 16).to(dtype), nn.Linear(16, 8).to(dtype)


def _x():
    return torch.randn(B, S, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))


def _tp_layers():
    fc, proj = _dense_linears()
    out = {}
    # column-parallel with the output gathered, on its own
    col = ColumnParallelLinear.from_dense(fc, gather_output=True, label="col")
    x = _x().requires_grad_()
    y = col(x)
    y.pow(2).sum().backward()
    out["col"] = (y.detach(), x.grad, dense_grads(nn.ModuleDict({"l": col})))
    # the MLP pair: column then row, GELU in between, nothing communicated between them
    mlp = nn.Sequential(ColumnParallelLinear.from_dense(fc, label="mlp.fc"), nn.GELU(),
                        RowParallelLinear.from_dense(proj, label="mlp.proj"))
    x = _x().requires_grad_()
    y = mlp(x)
    y.pow(2).sum().backward()
    out["mlp"] = (y.detach(), x.grad, dense_grads(mlp))
    # row-parallel on a full input (scattered first)
    row = RowParallelLinear.from_dense(fc, input_is_parallel=False, label="row")
    x = _x().requires_grad_()
    y = row(x)
    y.pow(2).sum().backward()
    out["row"] = (y.detach(), x.grad, dense_grads(nn.ModuleDict({"l": row})))
    # a layer built from scratch holds 1/tp of the weight
    out["fresh"] = (ColumnParallelLinear(8, 16).weight.shape, RowParallelLinear(16, 8).weight.shape)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_linear_layers_from_dense_match_nn_linear(tp):
    res = parlab.run(_tp_layers, tp, trace=True, **RUN)
    fc, proj = _dense_linears()
    refs = {"col": fc, "mlp": nn.Sequential(fc, nn.GELU(), proj), "row": fc}
    wrap = {"col": lambda m: nn.ModuleDict({"l": m}), "mlp": lambda m: m, "row": lambda m: nn.ModuleDict({"l": m})}
    for name, ref in refs.items():
        ref.zero_grad()
        x = _x().requires_grad_()
        y = ref(x)
        y.pow(2).sum().backward()
        for out in res.results:
            got_y, got_gx, got_grads = out[name]
            torch.testing.assert_close(got_y, y.detach(), **F64)
            torch.testing.assert_close(got_gx, x.grad, **F64)
            for pname, p in wrap[name](ref).named_parameters():
                torch.testing.assert_close(got_grads[pname], p.grad, **F64, msg=lambda m, n=pname: f"{n}: {m}")
        assert res.results[0]["fresh"] == (torch.Size([16 // tp, 8]), torch.Size([8, 16 // tp]))
    mlp_evs = [e for e in res.trace.filter(rank=0).comm() if e.label.startswith("mlp.")]
    # the MLP: one all-reduce forward (g after mlp.proj), one backward (f before mlp.fc), nothing in between
    assert sorted((e.label, e.op) for e in mlp_evs) == [("mlp.fc f bwd", "all_reduce"),
                                                        ("mlp.proj g fwd", "all_reduce")]


def _tp_block(sp: bool):
    tp, r = comm.get_world_size(), comm.get_rank()
    block = GPT(CFG, seed=0, dtype=torch.float64).blocks[0]
    plan = {k.removeprefix("blocks.*."): v for k, v in gpt_plan().items() if k.startswith("blocks.*.")}
    parallelize(block, plan, sequence_parallel=sp)
    x = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    if sp:
        x = x.chunk(tp, 1)[r]                                         # (B, S/tp, H): this rank's tokens
    x.requires_grad_()
    y = block(x)
    (y * y.detach().cos()).sum().backward()                           # a loss whose gradient is not just y
    sync_sequence_parallel_grads(block)
    return y.detach(), x.grad, dense_grads(block)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_block_output_input_gradient_and_weight_gradients_match_dense(tp, sp):
    results = parlab.run(_tp_block, tp, sp, **RUN).results
    block = GPT(CFG, seed=0, dtype=torch.float64).blocks[0]
    x = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    y = block(x)
    (y * y.detach().cos()).sum().backward()
    for r, (got_y, got_gx, got_grads) in enumerate(results):
        want_y, want_gx = (y.detach().chunk(tp, 1)[r], x.grad.chunk(tp, 1)[r]) if sp else (y.detach(), x.grad)
        torch.testing.assert_close(got_y, want_y, **F64)
        torch.testing.assert_close(got_gx, want_gx, **F64)
        for name, p in block.named_parameters():
            torch.testing.assert_close(got_grads[name], p.grad, **F64, msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------------------- clear errors
def _errors():
    def message(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    bad_seq = GPTConfig(vocab_size=33, seq_len=8, n_layer=1, n_head=6, n_embd=24)
    model = parallelize_gpt(GPT(bad_seq, dtype=torch.float64), sequence_parallel=True)
    return dict(
        heads=message(lambda: parallelize_gpt(GPT(CFG))),
        vocab=message(lambda: parallelize_gpt(GPT(GPTConfig(vocab_size=32, n_head=6, n_embd=24)))),
        column=message(lambda: ColumnParallelLinear(8, 10)),
        row=message(lambda: RowParallelLinear(10, 8)),
        seq=message(lambda: model(torch.zeros(1, 8, dtype=torch.long))),
        plan=message(lambda: parallelize(GPT(CFG), {"blocks.*.atn.q": "colwise"})),
    )


def test_divisibility_errors_say_what_to_choose():
    msgs = parlab.run(_errors, 3, **RUN).results[0]
    assert msgs["heads"] == "n_head 4 is not divisible by tp 3; choose tp in {1, 2, 4}"
    assert msgs["vocab"] == "vocab_size 32 is not divisible by tp 3; choose tp in {1, 2, 4, 8, 16, 32}"
    assert msgs["column"].startswith("ColumnParallelLinear out_features 10 is not divisible by tp 3")
    assert msgs["row"].startswith("RowParallelLinear in_features 10 is not divisible by tp 3")
    assert "size 8 over 3 ranks; choose a sequence length that is a multiple" in msgs["seq"]
    assert msgs["plan"].startswith("plan entries ['blocks.*.atn.q'] match no module of GPT")
    check_divisible("n_head", 8, 4)  # divisible: no error
