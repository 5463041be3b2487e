"""Meta-device construction: a rank builds GPT(config, seed, device="meta") (no memory), keeps its part
(pipeline stages, tensor-parallel shards, FSDP flat shards, all of them in the hybrid) and materialises only
that part. The values must equal the same part of the dense GPT(config, seed) exactly (same generator per
(seed, name), same float32 draw, same cast: torch.equal, no tolerance), and no parameter outside the part
may be drawn: every draw goes through parlab.models._initial_value, which the ranks spy on."""
import pytest
import torch

import parlab
from parlab import comm
from parlab.models import gpt as models_mod
from parlab.parallel.zero import FullyShardedDataParallel
from parlab.parallel.groups import build_groups
from parlab.parallel.hybrid import build_hybrid
from parlab.parallel.meta_init import init_value, materialize, meta_parameters
from parlab.models import GPT, GPTConfig
from parlab.parallel.pipeline import PipelineParallel
from parlab.parallel.pipeline import one_f_one_b
from parlab.parallel.tensor import parallelize_gpt
from parlab.parallel.topology import ParallelGrid

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=4, n_embd=32)


class _Spy:
    """Records the dense name and element count of every initial value drawn (parlab.models._initial_value)."""

    def __init__(self, monkeypatch=None):
        self.drawn: list[tuple[str, int]] = []
        original = models_mod._initial_value

        def spy(name, shape, *args):
            out = original(name, shape, *args)
            self.drawn.append((name, out.numel()))
            return out

        if monkeypatch is not None:
            monkeypatch.setattr(models_mod, "_initial_value", spy)
        else:                                               # inside a rank process: patch for its lifetime
            models_mod._initial_value = spy

    @property
    def names(self) -> set[str]:
        return {n for n, _ in self.drawn}


def _named(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ---------------------------------------------------------------------- one process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("tie,bias", [(True, True), (False, False)], ids=["tied", "untied-nobias"])
def test_materialised_model_equals_the_dense_one_exactly(dtype, tie, bias, monkeypatch):
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=4, n_embd=32, tie_embeddings=tie, bias=bias)
    dense = GPT(cfg, seed=7, dtype=dtype)
    spy = _Spy(monkeypatch)
    meta = GPT(cfg, seed=7, dtype=dtype, device="meta")
    assert spy.drawn == [] and all(p.is_meta for p in meta.parameters())     # nothing drawn, nothing allocated
    materialize(meta, "cpu")
    assert meta_parameters(meta) == []
    want, got = _named(dense), _named(meta)
    assert list(want) == list(got)
    for name in want:
        assert got[name].dtype == dtype and torch.equal(got[name], want[name]), name
    assert (meta.lm_head.weight is meta.wte.weight) == tie                  # the tie survives materialising
    assert sorted(n for n, _ in spy.drawn) == sorted(want)                  # each parameter drawn once
    for name in want:                                                        # and init_value is the same draw
        assert torch.equal(init_value(cfg, 7, name).to(dtype), want[name]), name


def test_materialising_only_the_kept_blocks_draws_only_those(monkeypatch):
    meta = GPT(CFG, seed=1, device="meta")
    for i in (0, 1, 3):
        meta.blocks[i] = None                                                # keep block 2 only, and no embeddings
    meta.wte = meta.wpe = None
    spy = _Spy(monkeypatch)
    materialize(meta, "cpu")
    drawn = spy.names
    dense = _named(GPT(CFG, seed=1))
    kept = _named(meta)
    assert set(kept) == {n for n in dense if n.startswith("blocks.2.")} | {"ln_f.weight", "ln_f.bias",
                                                                           "lm_head.weight"}
    assert drawn == (set(kept) - {"lm_head.weight"}) | {"wte.weight"}       # tied: drawn under wte's name
    for name, value in kept.items():
        assert torch.equal(value, dense["wte.weight" if name == "lm_head.weight" else name]), name


def test_bad_inputs_to_materialise_say_what_is_wrong():
    with pytest.raises(TypeError, match="parlab.models.GPT"):
        materialize(torch.nn.Linear(2, 2, device="meta"), "cpu")
    with pytest.raises(KeyError, match="no parameter 'blocks.9.attn.q.weight'"):
        init_value(CFG, 0, "blocks.9.attn.q.weight")
    meta = GPT(CFG, device="meta")
    meta.blocks[0].attn.q.weight = torch.nn.Parameter(torch.empty(8, 32, device="meta"))   # a shard, untagged
    with pytest.raises(ValueError, match="dense_chunk"):
        materialize(meta, "cpu")


def test_fsdp_on_meta_needs_a_device_and_an_initialiser():
    with pytest.raises(parlab.RankError, match="ValueError: the module is on the meta device: pass device="):
        parlab.run(lambda: FullyShardedDataParallel(GPT(CFG, device="meta")), 1)
    with pytest.raises(parlab.RankError, match="ValueError: the Sequential is on the meta device: pass param_init"):
        parlab.run(lambda: FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(2, 2, device="meta"),
                                                                        torch.nn.Linear(2, 2, device="meta")),
                                                    device="cpu"), 1)


# ---------------------------------------------------------------------- pipeline stages
def _pipeline(p, m):
    schedule = one_f_one_b(p, m)
    spy = _Spy()
    pipe = PipelineParallel(GPT(CFG, seed=3, device="meta"), schedule, copy=False, device="cpu")
    drawn = list(spy.drawn)
    ref = PipelineParallel(GPT(CFG, seed=3), schedule, copy=False)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(CFG.vocab_size, (m, CFG.seq_len), generator=g) for _ in range(2))   # (B, S)
    loss, ref_loss = pipe.step(x, y), ref.step(x, y)
    return (_named(pipe.module), _named(ref.module), drawn, meta_parameters(pipe.module), loss, ref_loss,
            {n: q.grad for n, q in pipe.module.named_parameters()},
            {n: q.grad for n, q in ref.module.named_parameters()})


@pytest.mark.parametrize("p", [2, 3])
def test_pipeline_materialises_only_its_stages_with_the_dense_values(p):
    res = parlab.run(_pipeline, p, p, 2 * p)
    dense_numel = sum(q.numel() for q in GPT(CFG).parameters())
    for r, (got, want, drawn, still_meta, loss, ref_loss, grads, ref_grads) in enumerate(res):
        assert still_meta == []
        assert list(got) == list(want)                                       # this rank's stages, named as dense
        for name in want:
            assert torch.equal(got[name], want[name]), (r, name)
        tied = {"lm_head.weight": "wte.weight"}
        assert sorted(n for n, _ in drawn) == sorted(tied.get(n, n) for n in want)   # only its own, once each
        assert sum(k for _, k in drawn) < dense_numel                        # never the whole model
        assert (loss is None) == (ref_loss is None) and (loss is None or torch.equal(loss, ref_loss))
        for name in want:                                                    # and it trains identically
            assert torch.equal(grads[name], ref_grads[name]), (r, name)


def test_pipeline_stages_left_on_meta_refuse_to_run():
    def fn():
        pipe = PipelineParallel(GPT(CFG, device="meta"), one_f_one_b(1, 1), copy=False)
        x = torch.zeros(1, CFG.seq_len, dtype=torch.long)
        pipe.step(x, x)
    with pytest.raises(parlab.RankError, match="ValueError: this rank's stages are still on the meta device"):
        parlab.run(fn, 1)


# ---------------------------------------------------------------------- tensor-parallel shards
def _tensor_parallel(sp):
    spy = _Spy()
    model = materialize(parallelize_gpt(GPT(CFG, seed=5, device="meta"), sequence_parallel=sp), "cpu")
    drawn = list(spy.drawn)
    ref = parallelize_gpt(GPT(CFG, seed=5), sequence_parallel=sp)
    attrs = lambda m: {n: (getattr(q, "tp_dim", "-"), getattr(q, "sequence_parallel", "-"))
                       for n, q in m.named_parameters()}
    # each shard owns just its own bytes (a view of the drawn dense parameter would keep all of it alive)
    owned = all(q.untyped_storage().nbytes() == q.numel() * q.element_size() for q in model.parameters())
    return (_named(model), _named(ref), drawn, attrs(model), attrs(ref),
            model.lm_head.weight is model.wte.weight, meta_parameters(model), owned)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_shards_equal_the_dense_models_shards(sp):
    tp = 2
    res = parlab.run(_tensor_parallel, tp, sp)
    for r, (got, want, drawn, attrs, ref_attrs, tied, still_meta, owned) in enumerate(res):
        assert still_meta == [] and tied and owned
        assert list(got) == list(want) and attrs == ref_attrs               # tp_dim / sequence_parallel kept
        for name in want:
            assert torch.equal(got[name], want[name]), (r, name)
        # each dense parameter drawn once (on the CPU, then sliced): one at a time, never all kept
        assert sorted(n for n, _ in drawn) == sorted(want)
    assert not torch.equal(res[0][0]["blocks.0.attn.q.weight"], res[1][0]["blocks.0.attn.q.weight"])


# ---------------------------------------------------------------------- FSDP flat shards
def _fsdp():
    spy = _Spy()
    model = FullyShardedDataParallel(GPT(CFG, seed=2, device="meta"), device="cpu")
    drawn = list(spy.drawn)
    ref = FullyShardedDataParallel(GPT(CFG, seed=2))
    return [s.detach().clone() for s in model.shards], [s.detach().clone() for s in ref.shards], drawn


def test_fsdp_shards_equal_the_dense_models_shards_and_draw_only_overlapping_parameters():
    N = 4
    res = parlab.run(_fsdp, N)
    dense_numel = sum(q.numel() for q in GPT(CFG).parameters())
    for r, (got, want, drawn) in enumerate(res):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert torch.equal(a, b), r
        assert sum(k for _, k in drawn) < dense_numel                       # only what overlaps its shards
    # every parameter is drawn by the rank(s) whose slice it overlaps, so by one rank at least
    assert set().union(*({n for n, _ in d} for _, _, d in res)) == {n for n, _ in GPT(CFG).named_parameters()}


# ---------------------------------------------------------------------- hybrid: PP x TP (x DP)
def _hybrid(tp, pp):
    grid = ParallelGrid(comm.get_world_size(), tp=tp, pp=pp)
    groups = build_groups(grid, dims=("tp", "cp", "pp", "dp-cp"))
    spy = _Spy()
    h = build_hybrid(GPT(CFG, seed=4, device="meta"), groups, copy=False, device="cpu", lr=1e-3)
    drawn = list(spy.drawn)
    ref = build_hybrid(GPT(CFG, seed=4), groups, copy=False, lr=1e-3)
    return _named(h.module), _named(ref.module), drawn, meta_parameters(h.module)


def test_hybrid_materialises_only_its_stage_shards():
    res = parlab.run(_hybrid, 4, 2, 2)
    dense_numel = sum(q.numel() for q in GPT(CFG).parameters())
    for r, (got, want, drawn, still_meta) in enumerate(res):
        assert still_meta == [] and list(got) == list(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (r, name)
        tied = {"lm_head.weight": "wte.weight"}
        assert {n for n, _ in drawn} == {tied.get(n, n) for n in want}      # its stage's parameters only
        assert sum(k for _, k in drawn) < dense_numel


MOE = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32, experts=4, top_k=2)


def _hybrid_experts(etp):
    groups = build_groups(ParallelGrid(4, tp=2, ep=2, etp=etp))
    kw = dict(copy=False, lr=1e-3, sequence_parallel=True)
    h = build_hybrid(GPT(MOE, seed=4, device="meta"), groups, device="cpu", **kw)
    ref = build_hybrid(GPT(MOE, seed=4), groups, **kw)
    return _named(h.module), _named(ref.module), meta_parameters(h.module)


@pytest.mark.parametrize("etp", [1, 2])
def test_experts_split_by_ep_and_etp_materialise_as_the_dense_models_shards(etp):
    """An expert of the meta-built model takes two chunks of the dense stacked weight: its ep rank's experts, then
    (etp = tp) its etp rank's part of each: `dense_chunk` as a list, applied in order."""
    for r, (got, want, still_meta) in enumerate(parlab.run(_hybrid_experts, 4, etp)):
        assert still_meta == [] and list(got) == list(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (r, name)
        assert got["blocks.0.mlp.experts.fc.weight"].shape[:2] == (2, 4 * 32 // etp)      # (E/ep, F/etp, H)
