"""Data parallelism: NaiveDataParallel and DistributedDataParallel take the single-process step, and their
traced traffic is what the theory says.

Reference: the same GPT (same weights, float64) trained in one process on the full global batch.
Tolerance: float64 everywhere. Data-parallel ranks sum their shards' gradients in another order than one
process does (and AVG divides after summing), so results differ by rounding only: measured up to ~6e-17
after SGD and ~1.3e-14 after AdamW (m / sqrt(v) amplifies rounding where v is tiny). rtol 1e-9 / atol 1e-11
leaves three orders of margin and is far below any real bug (a missing 1/N or a lost bucket moves
parameters by ~1e-3).
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import parlab
from parlab.corpus import BatchSampler, load_corpus
from parlab.parallel.data import NAIVE_PHASES, DistributedDataParallel, NaiveDataParallel, traffic_by_phase
from parlab.parallel.data import assign_buckets
from parlab.models import GPT, GPTConfig

TOL = dict(rtol=1e-9, atol=1e-11)   # see the module docstring
B, S, STEPS = 8, 8, 3               # global batch rows (divisible by 1, 2, 4), sequence length, steps
TIED = GPTConfig(vocab_size=64, seq_len=S, n_layer=2, n_head=2, n_embd=16)
UNTIED = GPTConfig(vocab_size=64, seq_len=S, n_layer=2, n_head=2, n_embd=16, tie_embeddings=False)
FROZEN = ("wpe.weight", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias")
CASES = [("tied", "sgd"), ("tied", "adamw"), ("frozen", "sgd"), ("frozen", "adamw")]


# ---------------------------------------------------------------------- shared pieces (run on every rank)
def _sampler():
    return BatchSampler(load_corpus(4000), batch_size=B, seq_len=S, seed=1)


def _model(variant, seed=0):
    model = GPT(TIED if variant == "tied" else UNTIED, seed=seed, dtype=torch.float64)
    if variant == "frozen":
        for name, p in model.named_parameters():
            p.requires_grad_(name not in FROZEN)
    return model


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _reference(variant, opt_name, steps=STEPS):
    """The single-process model trained on the full global batch."""
    model, sampler = _model(variant), _sampler()
    opt = _optimizer(opt_name, model.parameters())
    for step in range(steps):
        x, y = sampler.global_batch(step)
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def _assert_params_equal(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------- DDP against one process
def _train_ddp(variant, opt_name, steps=STEPS, bucket_cap_mb=25.0, explicit_finish=False):
    r, w = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(_model(variant, seed=r), bucket_cap_mb=bucket_cap_mb)  # seeds differ: broadcast
    opt, sampler = _optimizer(opt_name, ddp.parameters()), _sampler()
    for step in range(steps):
        x, y = sampler.shard(step, r, w)                       # (B/w, S) each
        ddp(x, y)[1].backward()
        if explicit_finish:
            ddp.finish_grad_sync()
        opt.step()
        opt.zero_grad()
    return _params(ddp.module), len(ddp.buckets)


def _ddp_cases():
    return {case: _train_ddp(*case, explicit_finish=case[1] == "sgd") for case in CASES}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ddp_matches_single_process(world_size):
    """Tied and frozen GPTs, SGD with momentum and AdamW, ranks starting from different weights."""
    res = parlab.run(_ddp_cases, world_size)
    for case in CASES:
        want = _reference(*case)
        for r in range(world_size):
            _assert_params_equal(res[r][case][0], want)
        if case[0] == "frozen":                                 # frozen parameters never moved
            init = _params(_model("frozen"))
            for name in FROZEN:
                assert torch.equal(res[0][case][0][name], init[name])


def _bucket_sizes(caps):
    return [_train_ddp("frozen", "adamw", steps=2, bucket_cap_mb=cap) for cap in caps]


def test_bucket_sizes_agree():
    """One bucket, two buckets, one bucket per parameter: the same training."""
    trainable = [p for p in _model("frozen").parameters() if p.requires_grad]
    total = sum(p.numel() * p.element_size() for p in trainable)
    caps = [100.0, 0.6 * total / 2**20, 1e-9]
    res = parlab.run(_bucket_sizes, 2, caps, trace=True)
    want = _reference("frozen", "adamw", steps=2)
    assert [n for _, n in res[0]] == [1, 2, len(trainable)]
    for r in range(2):
        for params, _ in res[r]:
            _assert_params_equal(params, want)
    # one all-reduce per bucket per step, on every rank
    assert res.trace.count("all_reduce", rank=1, label="grad bucket") == 2 * (1 + 2 + len(trainable))


def test_assign_buckets_is_greedy_in_order():
    assert assign_buckets([4, 4, 4], ["f"] * 3, 8) == [[0, 1], [2]]
    assert assign_buckets([16, 4, 4], ["f"] * 3, 8) == [[0], [1, 2]]         # too big alone: its own bucket
    assert assign_buckets([4, 4, 4], ["f", "d", "d"], 100) == [[0], [1, 2]]   # one dtype per buffer
    with pytest.raises(ValueError, match="positive"):
        assign_buckets([4], ["f"], 0)


def test_bad_bucket_cap_is_a_clear_error():
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=0)


# ---------------------------------------------------------------------- gradient accumulation
def _accumulate(k):
    r, w = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(_model("tied"), bucket_cap_mb=0.01)
    opt = _optimizer("adamw", ddp.parameters())
    x, y = _sampler().shard(0, r, w)                           # (B/w, S)
    m = x.shape[0] // k
    for i in range(k):                                         # k micro-steps of m rows each
        xi, yi = x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]
        ctx = ddp.no_sync() if i < k - 1 else parlab.trace.region("last micro-step")
        with ctx:
            (ddp(xi, yi)[1] / k).backward()                    # mean over k micro-batches
    opt.step()
    return _params(ddp.module), len(ddp.buckets)


@pytest.mark.parametrize("k", [2, 4])
def test_no_sync_accumulation_equals_one_big_step(k):
    res = parlab.run(_accumulate, 2, k, trace=True)
    want = _reference("tied", "adamw", steps=1)
    for r in range(2):
        _assert_params_equal(res[r][0], want)
    # communication only on the last micro-step: one all-reduce per bucket
    n_buckets = res[0][1]
    assert n_buckets > 1
    for r in range(2):
        assert res.trace.count("all_reduce", rank=r, label="grad bucket") == n_buckets


# ---------------------------------------------------------------------- traffic and overlap
def _traced_steps(steps, bucket_cap_mb):
    r, w = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(_model("tied"), bucket_cap_mb=bucket_cap_mb)
    opt, sampler = _optimizer("sgd", ddp.parameters()), _sampler()
    # the embedding's gradient is the last one backward produces (tied: lm_head's part comes first)
    ddp.module.wte.weight.register_post_accumulate_grad_hook(lambda p: parlab.trace.mark("wte grad ready"))
    for step in range(steps):
        x, y = sampler.shard(step, r, w)
        ddp(x, y)[1].backward()                                # syncs by itself ...
        ddp.finish_grad_sync()                                 # ... so this must not reduce again
        opt.step()
        memory = ddp.memory_report(opt)                        # measured while gradients are held
        opt.zero_grad()
    return ddp.bucket_names, memory


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_all_reduces_each_gradient_byte_once(world_size):
    steps = 2
    res = parlab.run(_traced_steps, world_size, steps, 0.01, trace=True)
    grad_bytes = TIED.param_count() * 8                        # float64; the tied lm_head counted once
    buckets, memory = res[0]
    names = [n for bucket in buckets for n in bucket]
    assert sorted(names) == sorted(n for n, _ in _model("tied").named_parameters())  # each in one bucket
    assert len(buckets) > 1
    # every rank holds the same: parameters, gradients, buckets, SGD momentum, each psi * 8 bytes
    assert all(res[r][1] == memory for r in range(world_size))
    assert memory == {"parameters": grad_bytes, "gradients": grad_bytes, "optimizer state": grad_bytes,
                      "grad buckets": grad_bytes}
    tr = res.trace.filter(label="grad bucket")
    for r in range(world_size):
        assert sum(e.nbytes for e in tr.filter(rank=r)) == steps * grad_bytes
        assert tr.count("all_reduce", rank=r) == steps * len(buckets)
        ring = 2 * (world_size - 1) / world_size * steps * grad_bytes
        assert tr.bytes_per_rank("all_reduce")[r] == pytest.approx(ring)
        assert res.trace.filter(rank=r).comm().events[-1].label.startswith("grad bucket")  # nothing else


def test_bucket_all_reduces_overlap_backward():
    """Bucket 0's all-reduce is in flight before backward has produced its last gradient (ordering, not timing)."""
    res = parlab.run(_traced_steps, 2, 1, 0.01, trace=True)
    buckets = res[0][0]
    n_buckets = len(buckets)
    assert buckets[0][0] == "ln_f.bias" and buckets[-1][-1] == "wte.weight"   # reverse registration order
    for r in range(2):
        tr = res.trace.filter(rank=r)
        launches = tr.filter(op="all_reduce", label="grad bucket").events
        assert [e.label for e in launches] == [f"grad bucket {i}" for i in range(n_buckets)]
        assert all(e.asynchronous for e in launches)
        spans = tr.filter(op="backward", kind="compute").events
        assert len(spans) >= n_buckets + 1                     # compute before each launch, then the rest
        last_grad = tr.filter(op="wte grad ready", kind="mark").events
        assert len(last_grad) == 1 and launches[0].start < last_grad[0].start
        wait = tr.filter(op="grad sync", kind="compute").events
        assert len(wait) == 1 and wait[0].start >= spans[-1].end  # the one wait comes after backward


# ---------------------------------------------------------------------- explicit groups
def _two_groups(steps):
    r = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    group, group_rank = groups[r // 2], r % 2
    ddp = DistributedDataParallel(_model("tied", seed=group_rank), group=group, bucket_cap_mb=0.01)
    opt, sampler = _optimizer("adamw", ddp.parameters()), _sampler()
    for step in range(steps):
        x, y = sampler.shard(step, group_rank, 2)
        ddp(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    model = _model("tied", seed=group_rank)                    # each group's rank 0 starts from seed 0
    naive = NaiveDataParallel(model, _optimizer("adamw", model.parameters()), group=group)
    for step in range(steps):
        naive.step(*(sampler.global_batch(step) if group_rank == 0 else (None, None)))
    naive.replicate()
    return _params(ddp.module), _params(model)


def test_both_wrappers_stay_inside_their_group():
    """Two data-parallel groups {0, 1} and {2, 3} side by side (as in a dp x tp grid)."""
    steps = 2
    res = parlab.run(_two_groups, 4, steps, trace=True)
    want = _reference("tied", "adamw", steps=steps)
    for r in range(4):
        for params in res[r]:
            _assert_params_equal(params, want)
        mine = (0, 1) if r < 2 else (2, 3)
        events = res.trace.filter(rank=r).comm().events
        assert events and all(e.group == mine for e in events)
        assert all(e.peer == mine[0] for e in events if e.op in ("gather", "scatter", "broadcast", "reduce"))


# ---------------------------------------------------------------------- unused parameters and buffers
class _Branchy(nn.Module):
    """`extra` is used only when asked; `never` is never used; `scale` is a buffer."""

    def __init__(self):
        super().__init__()
        self.lin, self.extra, self.never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, use_extra):
        h = self.lin(x) * self.scale                           # (b, 4)
        if use_extra:
            h = h + self.extra(h)
        return h.pow(2).mean()


def _branchy():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return _Branchy().double()


def _branchy_data(step, r):
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(3, 4, generator=g, dtype=torch.float64)  # (b, 4) for rank r


def _train_branchy(find_unused, steps=2):
    r = dist.get_rank()
    model = _branchy()
    if r != 0:                                                 # construction must undo this
        with torch.no_grad():
            [p.add_(1.0) for p in model.parameters()]
            model.scale.fill_(5.0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-5, find_unused_parameters=find_unused)
    opt = _optimizer("adamw", ddp.parameters())
    never_grad = None
    for step in range(steps):
        ddp(_branchy_data(step, r), use_extra=(r == 0)).backward()   # `extra` gets a gradient on rank 0 only
        never_grad = ddp.module.never.weight.grad
        opt.step()
        opt.zero_grad()
    return _params(ddp.module), ddp.module.scale.clone(), never_grad


@pytest.mark.parametrize("find_unused", [True, False])
def test_unused_parameters(find_unused):
    w, steps = 2, 2
    res = parlab.run(_train_branchy, w, find_unused, steps)
    # reference: one process, the same per-shard losses averaged, one backward
    ref = _branchy()
    opt = _optimizer("adamw", ref.parameters())
    for step in range(steps):
        (sum(ref(_branchy_data(step, r), use_extra=(r == 0)) for r in range(w)) / w).backward()
        opt.step()
        opt.zero_grad()
    for r in range(w):
        params, scale, never_grad = res[r]
        assert scale.item() == 2.0                             # rank 0's buffer
        if find_unused:      # no rank used `never`: grad None as in one process, AdamW's decay leaves it alone
            assert never_grad is None
            _assert_params_equal(params, _params(ref))
        else:                # it gets a zero gradient, so weight decay moves it, unlike the reference
            assert torch.equal(never_grad, torch.zeros_like(never_grad))
            assert not torch.allclose(params["never.weight"], ref.never.weight)
            for name in ("lin.weight", "lin.bias", "extra.weight", "extra.bias"):
                torch.testing.assert_close(params[name], ref.get_parameter(name), **TOL)


# ---------------------------------------------------------------------- the naive DataParallel pattern
def _train_naive(variant, opt_name, steps=STEPS):
    r = dist.get_rank()
    model = _model(variant, seed=r)                            # replicas are overwritten at each step
    naive = NaiveDataParallel(model, _optimizer(opt_name, model.parameters()))
    sampler = _sampler()
    for step in range(steps):
        x, y = sampler.global_batch(step) if r == 0 else (None, None)
        naive.step(x, y)
    naive.replicate()                                          # bring the replicas up to date
    return _params(model), naive.memory


def _naive_cases():
    return {case: _train_naive(*case) for case in CASES}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_naive_matches_single_process(world_size):
    res = parlab.run(_naive_cases, world_size)
    for case in CASES:
        for r in range(world_size):
            _assert_params_equal(res[r][case][0], _reference(*case))


def test_naive_phases_traffic_and_memory():
    w, steps = 4, 2
    res = parlab.run(_train_naive, w, "tied", "adamw", steps, trace=True)
    tr = res.trace
    for phase in NAIVE_PHASES:                                 # one call per rank per step (+ final replicate)
        extra = 1 if phase == "replicate model" else 0
        for r in range(w):
            assert tr.count(rank=r, label=phase) == \
                steps * (2 if phase == "scatter inputs" else 1) + extra   # scatter inputs: shape, then data
    # the order of one update on rank 0
    labels = [e.label for e in tr.filter(rank=0).comm().events][: 6]
    assert labels == ["scatter inputs (shape)", "scatter inputs", "replicate model", "gather outputs",
                      "scatter output grads", "reduce grads"]
    traffic = traffic_by_phase(tr)
    logits = (B // w) * S * TIED.vocab_size * 8                # one replica's outputs, float64
    assert traffic["gather outputs"][0] == 0                   # hub and spoke: everyone sends to rank 0
    assert all(traffic["gather outputs"][r] == steps * logits for r in range(1, w))
    assert traffic["scatter output grads"][0] == steps * (w - 1) * logits
    assert all(traffic["scatter output grads"][r] == 0 for r in range(1, w))
    reduced = tr.filter(label="reduce grads", rank=0).events
    assert all(e.nbytes == TIED.param_count() * 8 for e in reduced)
    # memory: rank 0 holds the optimizer state, the full batch, the gathered outputs and their gradients
    mem = [m for _, m in res.results]
    assert mem[0]["optimizer state"] >= 2 * mem[0]["parameters"]      # AdamW: exp_avg and exp_avg_sq
    for r in range(1, w):
        assert mem[r]["optimizer state"] == 0
        assert mem[r] == mem[1]                                # the replicas are alike
        assert mem[r]["activations"] == mem[0]["activations"] > 0
        assert mem[0]["outputs"] == (2 * w + 1) * mem[r]["outputs"]  # own, N gathered, concatenated
        assert sum(mem[0].values()) > 2 * sum(mem[r].values())


def test_a_ranks_slice_holds_its_rows_only():
    # shard() once returned views: lesson 02 then charged every DDP rank the whole global batch's bytes
    from parlab.parallel.data.meters import tensor_bytes
    sampler, w = _sampler(), 4
    x, y = sampler.shard(0, 1, w)                               # (B/w, S) each
    gx, gy = sampler.global_batch(0)                            # (B, S) each
    assert torch.equal(x, gx[B // w:2 * B // w]) and torch.equal(y, gy[B // w:2 * B // w])
    assert tensor_bytes([x, y]) == 2 * (B // w) * S * x.element_size()


def test_naive_batch_must_split_evenly():
    with pytest.raises(parlab.RankError, match="not divisible by 2 ranks"):
        parlab.run(_naive_odd_batch, 2, timeout=30)


def _naive_odd_batch():
    model = nn.Linear(3, 2)
    naive = NaiveDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.zeros(3, 3)
    naive.step(x, torch.zeros(3, dtype=torch.long))
