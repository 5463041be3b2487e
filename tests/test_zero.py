"""ZeRO-1/2 ShardedOptimizer: lockstep with single-process training on the full batch."""
import contextlib

import pytest
import torch

import parlab
from parlab import comm
from parlab.corpus import BatchSampler, load_corpus
from parlab.models import GPT, GPTConfig
from parlab.parallel.zero import ShardedOptimizer, iter_owned, partition_parameters
from parlab.parallel.zero.flat import (chunk_bounds, join_chunks, make_layouts, merge_state, owned_runs, split_chunks,
                              split_state)
from toy_models import Toy

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)
BATCH, STEPS = 8, 3
# float64 everywhere: the only difference from the reference is the order of additions (the mean of
# per-rank mean losses vs one mean; an averaging reduce-scatter), ~1e-16 relative per step, which
# AdamW's division by sqrt(v) can amplify a little over a few steps; 1e-10 leaves room for that only.
TOL = dict(rtol=0, atol=1e-10)
OPTIMS = {"sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
          "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))}


def sampler():
    return BatchSampler(load_corpus(4000), batch_size=BATCH, seq_len=CFG.seq_len, seed=1)


def param_groups(model):
    """Two groups, as in GPT training recipes: weight decay on matrices, none on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def make(model_name):
    return GPT(CFG, seed=0, dtype=torch.float64) if model_name == "gpt" else Toy()


def reference(model_name, optim, steps):
    """Single-process training on the full global batch; returns the model and optimizer."""
    model = make(model_name)
    cls, kw = OPTIMS[optim]
    opt = cls(param_groups(model), **kw)
    s = sampler()
    for t in range(steps):
        x, y = s.global_batch(t)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _train(model_name, optim, stage, steps, load=None, flat_step=None, bucket_numel=1 << 22):
    """One rank's training; with `load` = (params, optimizer state dict), start from there."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make(model_name)
    cls, kw = OPTIMS[optim]
    opt = ShardedOptimizer(param_groups(model), cls, stage=stage, flat_step=flat_step, bucket_numel=bucket_numel,
                           **kw)
    start = 0
    if load is not None:
        params, state, start = load
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
        opt.load_state_dict(state)
    s = sampler()
    grads0 = None
    for t in range(start, start + steps):
        x, y = s.shard(t, rank, world)
        model(x, y)[1].backward()
        opt.reduce_gradients()
        if grads0 is None:  # after the reduction: which gradients does this rank still hold?
            grads0 = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    owned = {id(p) for p in iter_owned(opt)}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "owned": [n for n, p in model.named_parameters() if id(p) in owned],
            "grads0": grads0, "state": opt.state_dict(), "tied": model.lm_head.weight is model.wte.weight
            if model_name == "gpt" else model.out.weight is model.embed.weight}


def test_partition_is_balanced_and_deterministic():
    sizes = [4096, 4096, 1024, 1024, 1024, 1024, 512, 32, 32, 32]
    owners = partition_parameters(sizes, 4)
    assert owners == partition_parameters(sizes, 4)
    loads = [sum(n for n, o in zip(sizes, owners) if o == r) for r in range(4)]
    assert sum(loads) == sum(sizes) and max(loads) - min(loads) <= max(sizes)
    assert partition_parameters([4, 3, 2, 1], 2) == [0, 1, 1, 0]


def _train_both_stages(model_name, optim, steps):
    return [_train(model_name, optim, stage, steps) for stage in (1, 2)]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("model_name", ["gpt", "toy"])
def test_matches_single_process(model_name, optim, world_size):
    """Parameters after 3 steps, the step-0 gradients each rank keeps, and the gathered optimizer state
    all equal single-process training on the full batch (toy: 3 trainable tensors, so at 4 ranks one
    rank owns nothing)."""
    runs = parlab.run(_train_both_stages, world_size, model_name, optim, STEPS).results
    ref, ref_opt = reference(model_name, optim, STEPS)
    for stage in (1, 2):
        _check(model_name, stage, [per_stage[stage - 1] for per_stage in runs], ref, ref_opt)


def _check(model_name, stage, res, ref, ref_opt):
    ref_params = dict(ref.named_parameters())
    ref0 = make(model_name)                                 # full-batch gradients of step 0
    x, y = sampler().global_batch(0)
    ref0(x, y)[1].backward()
    ref_grads0 = dict(ref0.named_parameters())
    owners = {}
    for r, out in enumerate(res):
        assert out["tied"]
        for n, p in ref_params.items():
            torch.testing.assert_close(out["params"][n], p.detach(), **TOL)
        for n in out["owned"]:
            owners[n] = r
            torch.testing.assert_close(out["grads0"][n], ref_grads0[n].grad, **TOL)
        for n, g in out["grads0"].items():
            if n not in out["owned"] and ref_params[n].requires_grad:
                assert (g is None) == (stage == 2), f"stage {stage}: gradient of {n} on rank {r}"
    trainable = {n for n, p in ref_params.items() if p.requires_grad}
    assert set(owners) == trainable                        # every trainable parameter has one owner
    full = res[0]["state"]                                 # the gathered state is the single-process state
    expect = ref_opt.state_dict()
    assert full["param_groups"] == expect["param_groups"] and full["state"].keys() == expect["state"].keys()
    for i, st in expect["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(full["state"][i][k], v, **TOL)
    if model_name == "toy":                                # frozen weights never move
        torch.testing.assert_close(res[0]["params"]["frozen.weight"], make("toy").frozen.weight.detach(), rtol=0,
                                   atol=0)


def test_per_parameter_inner_step_matches_single_process():
    """flat_step=False, the path for optimizers that are not element-wise (each owned parameter stepped
    on its own), gives the same result as the flat path and the single-process reference."""
    res = parlab.run(_train, 2, "gpt", "adamw", 2, STEPS, flat_step=False).results
    ref, ref_opt = reference("gpt", "adamw", STEPS)
    _check("gpt", 2, res, ref, ref_opt)


def test_flat_layout_and_state_round_trip():
    """Pure bookkeeping: every parameter has one slot, segments do not overlap, runs cover a rank's
    segment group by group, and splitting a run's state then merging it gives the run's state back."""
    numels = [12, 7, 5, 5, 3, 1]
    owners = dict(enumerate(partition_parameters(numels, 3)))
    lay = make_layouts(numels, [torch.float32] * 6, owners, 3)[0]
    slots = sorted((lay.offset[i], lay.offset[i] + numels[i]) for i in range(6))
    assert all(b <= c for (_, b), (c, _) in zip(slots, slots[1:])) and lay.seg == max(
        sum(numels[i] for i in s) for s in lay.segs)
    group_of = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    for r in range(3):
        runs = owned_runs(lay, r, group_of)
        assert sorted(i for *_, ids in runs for i in ids) == sorted(lay.segs[r])
        for g, a, b, ids in runs:
            assert {group_of[i] for i in ids} == {g} and b - a == sum(numels[i] for i in ids)
    members = [(0, 0, torch.Size([3, 4])), (1, 12, torch.Size([7]))]
    state = {"step": torch.tensor(3.0), "exp_avg": torch.arange(19.0)}
    per = split_state(state, members, 19)
    assert per[1]["exp_avg"].shape == (7,) and per[0]["exp_avg"].shape == (3, 4)
    back = merge_state(per, members, 19)
    assert torch.equal(back["exp_avg"], state["exp_avg"]) and torch.equal(back["step"], state["step"])


def test_state_dict_reloads_at_another_world_size():
    first = parlab.run(_train, 2, "gpt", "adamw", 2, 2)[0]
    again = parlab.run(_train, 4, "gpt", "adamw", 1, 1, load=(first["params"], first["state"], 2))
    ref, _ = reference("gpt", "adamw", 3)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(again[3]["params"][n], p.detach(), **TOL)
    # the same checkpoint also loads into a plain AdamW on one process
    model = make("gpt")
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(first["params"][n])
    opt = torch.optim.AdamW(param_groups(model), **OPTIMS["adamw"][1])
    opt.load_state_dict(first["state"])
    x, y = sampler().global_batch(2)
    model(x, y)[1].backward()
    opt.step()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[n], p, **TOL)


def _train_small_chunks(*args, **kw):
    """`_train` with the inner optimizer stepping 32-element (256-byte float64) chunks, so runs span many
    chunks and chunks cut through parameters."""
    import parlab.parallel.zero.optimizer
    parlab.parallel.zero.optimizer.STEP_CHUNK_BYTES = 256
    return _train(*args, **kw)


@pytest.mark.parametrize("stage", [1, 2])
def test_chunked_inner_step_matches_single_process_and_reloads(stage):
    """The flat step in chunks smaller than one parameter: parameters, kept gradients and the gathered
    (joined) state equal one process; that state reloads (split back into chunks) and training goes on
    exactly as one process would."""
    first = parlab.run(_train_small_chunks, 2, "gpt", "adamw", stage, 2).results
    ref, ref_opt = reference("gpt", "adamw", 2)
    _check("gpt", stage, first, ref, ref_opt)
    again = parlab.run(_train_small_chunks, 2, "gpt", "adamw", stage, 1, load=(first[0]["params"],
                                                                               first[0]["state"], 2))
    ref, ref_opt = reference("gpt", "adamw", 3)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(again[1]["params"][n], p.detach(), **TOL)
    expect = ref_opt.state_dict()["state"]
    for i, st in expect.items():
        for k, v in st.items():
            torch.testing.assert_close(again[0]["state"]["state"][i][k], v, **TOL)


def test_chunk_state_join_and_split_round_trip():
    bounds = chunk_bounds(10, 4)
    assert bounds == [(0, 4), (4, 8), (8, 10)]
    run = {"step": torch.tensor(5.0), "exp_avg": torch.arange(10.0)}
    parts = split_chunks(run, bounds, 10)
    assert [p["exp_avg"].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len({id(p["step"]) for p in parts}) == 3          # each chunk counts its own steps
    back = join_chunks(parts, bounds)
    assert torch.equal(back["exp_avg"], run["exp_avg"]) and torch.equal(back["step"], run["step"])
    assert join_chunks([{}, {}, {}], bounds) == {} and split_chunks({}, bounds, 10) == [{}, {}, {}]


def _one_step_traffic(stage):
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make("gpt")
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1)
    x, y = sampler().shard(0, rank, world)
    model(x, y)[1].backward()
    opt.step()
    return opt.layouts[0].seg


@pytest.mark.parametrize("stage", [1, 2])
def test_traffic_is_a_reduce_scatter_and_an_all_gather(stage):
    """ZeRO-1/2 move what DDP's all-reduce moves, 2 (N-1)/N psi elements per rank, up to segment padding."""
    n = 4
    res = parlab.run(_one_step_traffic, n, stage, trace=True)
    psi, seg = CFG.param_count(), res[0]
    for r in range(n):
        assert res.trace.count("reduce_scatter", rank=r) == 1 and res.trace.count("all_gather", rank=r) == 1
        sent = res.trace.bytes_per_rank()[r]
        assert sent == pytest.approx(2 * (n - 1) / n * n * seg * 8)          # float64: 8 bytes
        ratio = sent / (2 * (n - 1) / n * psi * 8)                          # vs an all-reduce of psi elements
        assert 1.0 <= ratio < 1.05, ratio


def _bad(kind):
    model = make("gpt")
    if kind == "stage":
        ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=3, lr=0.1)
    else:
        ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1).add_param_group({"params": []})


def _both_errors():
    out = []
    for kind in ("stage", "add"):
        try:
            _bad(kind)
        except (ValueError, NotImplementedError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_clear_errors():
    msgs = parlab.run(_both_errors, 2)[0]
    assert len(msgs) == 2 and msgs[0].startswith("ValueError") and "stage 3" in msgs[0]
    assert msgs[1].startswith("NotImplementedError")


@pytest.mark.parametrize("stage", [1, 2])
def test_small_buckets_match_single_process(stage):
    """bucket_numel=1000 cuts each segment into many chunks (and caps the flat runs): still one
    reduce-scatter and one all-gather per bucket, and the same result as one process."""
    res = parlab.run(_train, 2, "gpt", "adamw", stage, STEPS, bucket_numel=1000, trace=True)
    ref, ref_opt = reference("gpt", "adamw", STEPS)
    _check("gpt", stage, res.results, ref, ref_opt)
    seg = -(-CFG.param_count() // 2)                        # at least half the parameters per segment
    for r in range(2):
        n_rs = len(res.trace.filter(rank=r, op="reduce_scatter", label="zero grads").events)
        n_ag = len(res.trace.filter(rank=r, op="all_gather", label="zero params").events)
        assert n_rs == n_ag and n_rs >= STEPS * -(-seg // 500), (n_rs, n_ag)   # 1000 // 2 ranks per chunk


def test_bad_bucket_size_is_a_clear_error():
    for bad in (0, -5, 2.5, True):                          # checked before any communication
        with pytest.raises(ValueError, match="bucket_numel must be a positive int"):
            ShardedOptimizer(make("gpt").parameters(), torch.optim.SGD, lr=0.1, bucket_numel=bad)


# ----------------------------------------------------------------------------- overlap with backward
def _train_overlap(stage, steps, pattern, overlap=True, bucket_numel=1000, rebuild=False):
    """`steps` optimizer steps, each over K = 2 batches accumulated as `pattern` says: 'one' (one backward per
    step, batch t), 'plain' (K backwards), 'no_sync' (the first K - 1 inside no_sync()), 'no_sync last' (the
    last inside no_sync: its gradients change after the round that reduced the others)."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model = make("gpt")
    if rebuild:                      # an optimizer built first and kept: its hooks must stay quiet
        stale = ShardedOptimizer(param_groups(model), torch.optim.SGD, stage=stage, bucket_numel=bucket_numel,
                                 lr=1.0)
    opt = ShardedOptimizer(param_groups(model), torch.optim.AdamW, stage=stage, bucket_numel=bucket_numel,
                           overlap=overlap, **OPTIMS["adamw"][1])
    s = sampler()
    for t in range(steps):
        batches = [t] if pattern == "one" else [2 * t, 2 * t + 1]
        for j, b in enumerate(batches):
            x, y = s.shard(b, rank, world)
            quiet = (pattern == "no_sync" and j < len(batches) - 1) or (pattern == "no_sync last" and j > 0)
            with (opt.no_sync() if quiet else contextlib.nullcontext()):
                with parlab.region("backward"):
                    model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    if rebuild:
        assert stale.zero_comm.rounds == 0                          # never reduced anything
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buckets": len(opt.zero_comm.order)}


def _reference_accumulated(steps, pattern):
    model = make("gpt")
    opt = torch.optim.AdamW(param_groups(model), **OPTIMS["adamw"][1])
    s = sampler()
    for t in range(steps):
        for b in ([t] if pattern == "one" else [2 * t, 2 * t + 1]):
            model(*s.global_batch(b))[1].backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_overlap_matches_single_process_and_starts_during_backward(stage, world_size):
    """Small buckets (1000 elements) so that several reduce-scatters start from the hooks while backward
    still runs: parameters after 3 AdamW steps equal one process on the full batch, and (from the trace)
    at least one reduce-scatter was started inside the backward region, every rank the same number."""
    res = parlab.run(_train_overlap, world_size, stage, STEPS, "one", trace=True)
    ref = _reference_accumulated(STEPS, "one")
    for out in res.results:
        for n, p in ref.items():
            torch.testing.assert_close(out["params"][n], p.detach(), **TOL)
    for r in range(world_size):
        backward = res.trace.filter(rank=r, op="backward", kind="compute").events
        rs = res.trace.filter(rank=r, op="reduce_scatter", label="zero grads").events
        inside = [e for e in rs if any(b.start <= e.start <= b.end for b in backward)]
        assert len(backward) == STEPS and inside, f"rank {r}: no reduce-scatter started during backward"
        assert len(rs) == STEPS * res[r]["buckets"] and res[r]["buckets"] > 2   # one round per step


def _train_overlap_mixed_messages(*args, **kw):
    """`_train_overlap` with gloo's message rule moved down to 512 bytes (64 float64 elements): the weight
    matrices go as messages straight from .grad, the 32-element norms and biases are staged together."""
    import parlab.parallel.zero.bucket_sync
    parlab.parallel.zero.bucket_sync.DIRECT_MIN_BYTES = 512
    return _train_overlap(*args, **kw)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("pattern", ["one", "plain", "no_sync last"])
def test_gradients_sent_from_grad_match_single_process(pattern, world_size):
    """Gradient pieces sent from .grad itself and small ones staged, in one bucket: one process's result,
    also when k backward calls accumulate into .grad while earlier rounds' messages were sent from it."""
    for stage in (1, 2):
        res = parlab.run(_train_overlap_mixed_messages, world_size, stage, 2, pattern, bucket_numel=4000)
        ref = _reference_accumulated(2, pattern)
        for out in res.results:
            for n, p in ref.items():
                torch.testing.assert_close(out["params"][n], p.detach(), **TOL)


@pytest.mark.parametrize("pattern", ["plain", "no_sync", "no_sync last"])
def test_overlap_accumulation_matches_single_process(pattern):
    """Two backward calls per step without zero_grad, with and without no_sync(), at ZeRO-2: the same
    parameters as one process accumulating the two global batches; 'no_sync last' changes gradients after
    the round that reduced them, which the step must notice and reduce again."""
    res = parlab.run(_train_overlap, 2, 2, 2, pattern, trace=True)
    ref = _reference_accumulated(2, pattern)
    for out in res.results:
        for n, p in ref.items():
            torch.testing.assert_close(out["params"][n], p.detach(), **TOL)
    # rounds of reduce-scatters in 2 steps: one per backward outside no_sync, plus the step's own round
    # when gradients changed after the last one ('no_sync last')
    rounds = {"plain": 4, "no_sync": 2, "no_sync last": 4}[pattern]
    for r in range(2):
        n_rs = len(res.trace.filter(rank=r, op="reduce_scatter", label="zero grads").events)
        assert n_rs == rounds * res[r]["buckets"], (pattern, n_rs)


def test_overlap_off_matches_overlap_on():
    """overlap=False reduces at the step instead: the same parameters, bit for bit (same reductions)."""
    on = parlab.run(_train_overlap, 2, 1, 2, "plain")[0]["params"]
    off = parlab.run(_train_overlap, 2, 1, 2, "plain", overlap=False)[0]["params"]
    for n in on:
        torch.testing.assert_close(on[n], off[n], rtol=0, atol=0)


# ----------------------------------------------------------------------------- collectives built from messages
def _direct_collectives():
    """comm.reduce_scatter_direct / all_gather_direct against the native collectives, and their traced bytes."""
    r, n = comm.get_rank(), comm.get_world_size()
    x = torch.arange(n * 5, dtype=torch.float64) * (r + 1) + r                     # (N*5,) different per rank
    out = {}
    for op in (comm.ReduceOp.SUM, comm.ReduceOp.AVG):
        want, got = torch.empty(5, dtype=torch.float64), torch.empty(5, dtype=torch.float64)
        comm.reduce_scatter(want, x.clone(), op=op)
        comm.reduce_scatter_direct(got, x.clone(), op=op, label="direct rs")
        out[str(op)] = (want, got)
        got = torch.empty(5, dtype=torch.float64)           # the same, sent as pieces of 2 + 3 elements per chunk
        comm.reduce_scatter_pieces(got, [[x[j * 5:j * 5 + 2], x[j * 5 + 2:j * 5 + 5]] for j in range(n)], op=op,
                                   label="pieces rs")
        out[f"pieces {op}"] = (want, got)
    work = comm.reduce_scatter_direct(got := torch.empty(5, dtype=torch.float64), x.clone(), async_op=True)
    work.wait()
    out["async"] = (out[str(comm.ReduceOp.SUM)][0], got)
    flat = torch.zeros(n * 4, dtype=torch.float64)
    flat[r * 4:(r + 1) * 4] = r + 1.0
    comm.all_gather_direct(list(flat.view(n, 4)), flat[r * 4:(r + 1) * 4], label="direct ag")   # in place
    out["all_gather"] = (torch.arange(1.0, n + 1, dtype=torch.float64).repeat_interleave(4), flat)
    errors = []
    for bad in (lambda: comm.reduce_scatter_direct(torch.empty(5), torch.empty(n * 5), op=comm.ReduceOp.MAX),
                lambda: comm.reduce_scatter_direct(torch.empty(5), torch.empty(n * 5 + 1)),
                lambda: comm.all_gather_direct([torch.empty(3)] * n, torch.empty(4)),
                lambda: comm.reduce_scatter_pieces(torch.empty(5), [[torch.empty(5)]] * (n - 1) + [[torch.empty(4)]])):
        try:
            bad()
        except ValueError as e:
            errors.append(str(e))
    return out, errors


def _direct_collectives_serialised():
    from serialised_p2p import serialised_p2p
    with serialised_p2p():                      # NCCL's p2p rules: an order that could deadlock there hangs here
        return _direct_collectives()


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_direct_collectives_post_in_an_order_safe_for_nccl(world_size):
    """Under the serialised-p2p shim (a send waits for its receive; each rank's messages run in post order)
    the direct collectives finish and give the same results. Every rank posting "send, then receive" waits in a
    cycle here (the hybrid lab with --zero 1 hung so); 6 ranks have rounds of several cycles (gcd(6, 2) = 2,
    gcd(6, 3) = 3)."""
    for out, errors in parlab.run(_direct_collectives_serialised, world_size, timeout=60).results:
        for want, got in out.values():
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_direct_collectives_equal_the_native_ones(world_size):
    """Exact equality (float64 sums of a few small integers; at N > 2 the order of the additions differs
    but every partial sum is an exact integer), the wire bytes of a ring reduce-scatter / all-gather in the
    trace, and a clear error for a reduction that is not a sum, or mismatched sizes."""
    res = parlab.run(_direct_collectives, world_size, trace=True)
    for out, errors in res.results:
        for want, got in out.values():
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert len(errors) == 4 and "ReduceOp.SUM or ReduceOp.AVG" in errors[0]
        assert "expected the group size" in errors[1] and "outputs (one per group rank)" in errors[2]
        assert "each adding up to the output's 5 elements" in errors[3]
    n = world_size
    for r in range(n):
        rs = res.trace.filter(rank=r, op="reduce_scatter", label="direct rs")
        ag = res.trace.filter(rank=r, op="all_gather", label="direct ag")
        assert len(rs.events) == 2 and len(ag.events) == 1
        assert rs.bytes_per_rank()[r] == pytest.approx(2 * (n - 1) / n * n * 5 * 8)
        pieces = res.trace.filter(rank=r, op="reduce_scatter", label="pieces rs")
        assert len(pieces.events) == 2 and pieces.bytes_per_rank()[r] == rs.bytes_per_rank()[r]
        assert ag.bytes_per_rank()[r] == pytest.approx((n - 1) / n * n * 4 * 8)


def test_a_replaced_optimizer_stays_quiet():
    """Two ShardedOptimizers built over one model (the first kept alive): only the newer one's hooks reduce,
    so the reduce-scatters are one round per step and training matches one process."""
    res = parlab.run(_train_overlap, 2, 1, 2, "one", rebuild=True, trace=True)
    ref = _reference_accumulated(2, "one")
    for r, out in enumerate(res.results):
        for n, p in ref.items():
            torch.testing.assert_close(out["params"][n], p.detach(), **TOL)
        assert len(res.trace.filter(rank=r, op="reduce_scatter", label="zero grads").events) == 2 * out["buckets"]


class _Branchy(torch.nn.Module):
    """Two layers; `b` is used only when asked (on some ranks), so its gradient is ready on some ranks only."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(6, 6, dtype=torch.float64)
        self.b = torch.nn.Linear(6, 6, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))

    def forward(self, x, use_b):
        h = torch.tanh(self.a(x))                                            # (B, 6)
        return (self.b(h) if use_b else h).square().mean()


def _branchy_batches(r):
    return [torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * t + r), dtype=torch.float64)
            for t in range(3)]


def _train_branchy(stage):
    r = comm.get_rank()
    model = _Branchy()
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1, bucket_numel=16)
    for x in _branchy_batches(r):
        model(x, use_b=(r == 0)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2])
def test_overlap_with_a_parameter_used_on_one_rank_only(stage):
    """Layer b gets gradients on rank 0 only: its buckets are complete during backward on rank 0 but only at
    the end-of-backward callback on rank 1. Every rank still starts every bucket once per backward in the same
    order (no hang, no mismatched collective), and the result equals one process minimising the mean of the
    two ranks' losses (rank 1 contributes zeros to b's average, as it should)."""
    res = parlab.run(_train_branchy, 2, stage, timeout=120)
    ref = _Branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x0, x1 in zip(_branchy_batches(0), _branchy_batches(1)):
        ((ref(x0, True) + ref(x1, False)) / 2).backward()
        opt.step()
        opt.zero_grad()
    for out in res.results:
        for n, p in ref.named_parameters():
            torch.testing.assert_close(out[n], p.detach(), **TOL)
