"""Gradient accumulation: k = 2 backward (or step) calls without zeroing, for every strategy, equal the
one-process model's accumulated gradient (k backward calls of the dense GPT on the same batches).

The synchronisations that sum rather than average are the ones that could count the earlier, already
synchronised part again: PipelineParallel's tied-embedding exchange (first and last stage) and the sequence-
parallel sum of partial gradients (1.5x the right gradient at tp = 2 before the fix). Averaging ones (DDP,
ZeRO, FSDP, CP, the pipeline's dp all-reduce) are checked too. One `parlab.run` per world size runs every
strategy (the machine is small); each strategy's result is checked by its own test."""
import functools

import pytest
import torch

import parlab
from parlab import comm
from parlab.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=4, n_head=4, n_embd=16)   # tied embeddings (GPT-2)
B, K, LR = 8, 2, 1.0
# float64: the runs differ from the one-process model only in summation order (~1e-16 relative); the bugs
# guarded against are O(1) relative errors.
TOL = dict(rtol=1e-10, atol=1e-12)


def _batches():
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(K):
        x = torch.randint(0, CFG.vocab_size, (B, CFG.seq_len), generator=g)   # (B, S)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _gpt():
    return GPT(CFG, seed=0, dtype=torch.float64)


def _rows(t, n, r):
    return t.chunk(n, 0)[r]                                                   # (B/n, S)


# ----------------------------------------------------------------------------- one strategy each, on every rank
def _ddp():
    from parlab.parallel.data import DistributedDataParallel
    n, r = comm.get_world_size(), comm.get_rank()
    model = DistributedDataParallel(_gpt())
    for x, y in _batches():
        model(_rows(x, n, r), _rows(y, n, r))[1].backward()
    return "grads", {k: p.grad.clone() for k, p in model.module.named_parameters()}


def _zero(stage):
    from parlab.parallel.zero import ShardedOptimizer
    n, r = comm.get_world_size(), comm.get_rank()
    model = _gpt()
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=LR)
    for x, y in _batches():
        model(_rows(x, n, r), _rows(y, n, r))[1].backward()
    opt.step()
    return "state", model.state_dict()


def _zero_backward_after_reduce(stage):
    """A backward between reduce_gradients() and step() cannot be accumulated: a clear error, on every rank."""
    from parlab.parallel.zero import ShardedOptimizer
    model = _gpt()
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=LR)
    (x, y), (x2, y2) = _batches()
    model(x, y)[1].backward()
    opt.reduce_gradients()
    model(x2, y2)[1].backward()
    try:
        opt.step()
    except RuntimeError as e:
        return "error", str(e)
    return "error", None


def _fsdp():
    from parlab.parallel.zero import FullyShardedDataParallel
    n, r = comm.get_world_size(), comm.get_rank()
    model = FullyShardedDataParallel(_gpt())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in _batches():
        model(_rows(x, n, r), _rows(y, n, r))[1].backward()
    opt.step()
    return "state", model.full_parameters()


def _tp(sp, pattern):
    """pattern: 'sync each' (backward + sync, k times), 'sync once' (k backwards, one sync), 'zero in place'
    (backward, sync, zero_grad(set_to_none=False), backward, sync: only the last batch's gradient)."""
    from parlab.parallel.tensor import dense_grads, parallelize_gpt, sync_sequence_parallel_grads
    model = parallelize_gpt(_gpt(), sequence_parallel=sp)
    for i, (x, y) in enumerate(_batches()):
        if pattern == "zero in place" and i == K - 1:
            model.zero_grad(set_to_none=False)
        model(x, y)[1].backward()
        if pattern != "sync once":
            sync_sequence_parallel_grads(model)
    if pattern == "sync once":
        sync_sequence_parallel_grads(model)
    return ("last grads" if pattern == "zero in place" else "grads"), dense_grads(model)


def _pipeline(name):
    from parlab.parallel import pipeline as sch
    from parlab.parallel.pipeline import PipelineParallel
    p = comm.get_world_size()
    schedule = {"1f1b": lambda: sch.one_f_one_b(p, p), "interleaved": lambda: sch.interleaved_1f1b(p, 2 * p, 2),
                "zb-h1": lambda: sch.zero_bubble_h1(p, p), "gpipe": lambda: sch.gpipe(p, p)}[name]()
    pp = PipelineParallel(_gpt(), schedule)
    for x, y in _batches():
        pp.step(x, y)
    return "grads", {k: g.clone() for k, g in pp.grads().items()}


def _pipeline_dp():
    from parlab.parallel import pipeline as sch
    from parlab.parallel.groups import build_groups
    from parlab.parallel.pipeline import PipelineParallel
    from parlab.parallel.topology import ParallelGrid
    pg = build_groups(ParallelGrid(4, pp=2, dp=2), dims=("dp", "pp"))
    d = pg.coords["dp"]
    pp = PipelineParallel(_gpt(), sch.one_f_one_b(2, 2), group=pg.pp, dp_group=pg.dp)
    for x, y in _batches():
        pp.step(_rows(x, 2, d), _rows(y, 2, d))
    return "grads", {k: g.clone() for k, g in pp.grads().items()}


def _cp(attention):
    from parlab.parallel.context import ContextParallelGPT
    cp = ContextParallelGPT(_gpt(), attention=attention, layout="zigzag")
    for x, y in _batches():
        cp(cp.shard(x), cp.shard(y))[1].backward()
        cp.average_gradients()
    return "grads", {k: p.grad.clone() for k, p in cp.model.named_parameters()}


def _hybrid(tp, cp, pp, **kw):
    from parlab.parallel.groups import build_groups
    from parlab.parallel.hybrid import build_hybrid
    from parlab.parallel.topology import ParallelGrid
    grid = ParallelGrid(comm.get_world_size(), tp=tp, cp=cp, pp=pp)
    h = build_hybrid(_gpt(), build_groups(grid, dims=("tp", "cp", "pp", "dp-cp")), optimizer_cls=torch.optim.SGD,
                     lr=LR, **kw)
    for x, y in _batches():
        h.forward_backward(x, y)
    h.optimizer.step()
    return "state", h.dense_state_dict()


STRATEGIES = {
    2: {"ddp": _ddp, "zero-1": functools.partial(_zero, 1), "zero-2": functools.partial(_zero, 2),
        "zero-1 backward after reduce": functools.partial(_zero_backward_after_reduce, 1),
        "zero-2 backward after reduce": functools.partial(_zero_backward_after_reduce, 2),
        "fsdp": _fsdp, "tp": functools.partial(_tp, False, "sync each"),
        "tp+sp sync each": functools.partial(_tp, True, "sync each"),
        "tp+sp sync once": functools.partial(_tp, True, "sync once"),
        "tp+sp zero in place": functools.partial(_tp, True, "zero in place"),
        "pipeline 1f1b": functools.partial(_pipeline, "1f1b"),
        "pipeline interleaved": functools.partial(_pipeline, "interleaved"),
        "pipeline zb-h1": functools.partial(_pipeline, "zb-h1"),
        "cp ring": functools.partial(_cp, "ring"), "cp ulysses": functools.partial(_cp, "ulysses"),
        "hybrid tp2 sp": functools.partial(_hybrid, 2, 1, 1, sequence_parallel=True),
        "hybrid pp2 tied": functools.partial(_hybrid, 1, 1, 2)},
    4: {"ddp": _ddp, "zero-2": functools.partial(_zero, 2), "fsdp": _fsdp,
        "tp+sp sync each": functools.partial(_tp, True, "sync each"),
        "pipeline gpipe": functools.partial(_pipeline, "gpipe"),
        "pipeline pp2 x dp2": _pipeline_dp,
        "cp ring": functools.partial(_cp, "ring"),
        "hybrid tp2 pp2": functools.partial(_hybrid, 2, 1, 2),
        "hybrid tp2 sp x dp2 zero-1": functools.partial(_hybrid, 2, 1, 1, sequence_parallel=True, zero_stage=1),
        "hybrid cp2 x pp2 interleaved": functools.partial(_hybrid, 1, 2, 2, schedule="interleaved", chunks=2),
        "hybrid tp2 sp x pp2 zb-h1": functools.partial(_hybrid, 2, 1, 2, sequence_parallel=True,
                                                         schedule="zb-h1")},
}


def _all(world):
    out = {}
    for name, fn in STRATEGIES[world].items():
        try:
            out[name] = fn()
        except Exception as e:   # reported by that strategy's test (raised alike on every rank: no hang)
            out[name] = ("exception", f"{type(e).__name__}: {e}")
    return out


@functools.lru_cache(maxsize=None)
def _run(world):
    return parlab.run(_all, world, world, timeout=420, echo=False).results


@functools.lru_cache(maxsize=None)
def _reference():
    """The one-process model: k backward calls without zeroing; then one SGD step (lr 1) from those grads;
    and the last batch's gradient alone."""
    model = _gpt()
    for x, y in _batches():
        model(x, y)[1].backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    last = _gpt()
    last(*_batches()[-1])[1].backward()
    return dict(grads=grads, state=model.state_dict(),
                last_grads={k: p.grad.clone() for k, p in last.named_parameters()})


CASES = [(w, name) for w in STRATEGIES for name in STRATEGIES[w]]


@pytest.mark.parametrize("world,name", CASES, ids=[f"{w}-{n}" for w, n in CASES])
def test_accumulated_gradient_equals_the_one_process_model(world, name):
    ref = _reference()
    for rank, results in enumerate(_run(world)):
        kind, got = results[name]
        where = f"{name} on {world} ranks, rank {rank}"
        assert kind != "exception", f"{where}: {got}"
        if kind == "error":
            assert got is not None and "reduce_gradients" in got and "step" in got, f"{where}: {got}"
            continue
        want = ref[{"grads": "grads", "last grads": "last_grads", "state": "state"}[kind]]
        assert got, where
        for k, v in got.items():
            torch.testing.assert_close(v, want[k], **TOL, msg=lambda m, k=k: f"{where}, {k}: {m}")
