"""Construction memory: a rank keeps only its part of the model (no deep copy of the dense model), the results
still match the one-process model, and the labs report the peak of construction, not only of training."""
import argparse

import pytest
import torch

import parlab
from parlab import comm
from parlab.parallel import pipeline as sch
from parlab.corpus import BatchSampler, load_corpus
from parlab.parallel.zero import FullyShardedDataParallel
from parlab.parallel.groups import build_groups
from parlab.parallel.hybrid import build_hybrid
from parlab.models import GPT, GPTConfig
from parlab.parallel.pipeline import PipelineParallel, split_layers
from parlab.parallel.topology import ParallelGrid
from parlab.launch import Context

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=4, n_head=2, n_embd=16)


def _batch(rows=8):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g)   # (B, S)
    y = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g)   # (B, S)
    return x, y


def _stage_bytes(cfg, stages, n_stages):
    """Bytes of the dense model's parameters that belong to `stages` (names as in the full model)."""
    dense = GPT(cfg, seed=0, dtype=torch.float64)
    layers = split_layers(cfg.n_layer, n_stages)
    keep = {f"blocks.{i}." for s in stages for i in layers[s]}
    total = 0
    for name, p in dense.named_parameters(remove_duplicate=False):
        first = name.startswith(("wte.", "wpe.")) and 0 in stages
        last = name.startswith(("ln_f.", "lm_head.")) and n_stages - 1 in stages
        if name == "lm_head.weight" and cfg.tie_embeddings and 0 in stages:
            continue                                                       # the same tensor as wte.weight
        if first or last or any(name.startswith(k) for k in keep):
            total += p.nbytes
    return total


def _handed_over(schedule):
    rank = comm.get_rank()
    model = GPT(CFG, seed=0, dtype=torch.float64)
    before = {id(p) for p in model.parameters()}
    pipe = PipelineParallel(model, schedule, copy=False, device="cpu")
    held = list(pipe.parameters())
    loss = pipe.step(*_batch())
    return {"rank": rank, "module_is_model": pipe.module is model, "same_tensors": all(id(p) in before for p in held),
            "bytes": sum(p.nbytes for p in held), "stages": pipe.my_stages, "loss": loss,
            "grads": {k: g.clone() for k, g in pipe.grads().items()}}


@pytest.mark.parametrize("schedule", [sch.one_f_one_b(2, 4), sch.interleaved_1f1b(2, 4, 2)],
                         ids=["1f1b", "interleaved"])
def test_pipeline_takes_the_model_over_and_keeps_only_its_stages(schedule):
    res = parlab.run(_handed_over, 2, schedule)
    dense = GPT(CFG, seed=0, dtype=torch.float64)
    _, ref_loss = dense(*_batch())
    ref_loss.backward()
    ref = {n: p.grad for n, p in dense.named_parameters()}
    for r in res:
        assert r["module_is_model"] and r["same_tensors"]                  # no copy: the caller's tensors
        assert r["bytes"] == _stage_bytes(CFG, r["stages"], schedule.stages)  # only its stages' parameters
        assert r["bytes"] < sum(p.nbytes for p in dense.parameters())
    # float64, the same operations split over ranks: only the summation order differs
    last = next(r for r in res if r["loss"] is not None)
    torch.testing.assert_close(last["loss"], ref_loss.detach(), rtol=1e-12, atol=1e-12)
    grads = {}
    for r in res:
        grads.update(r["grads"])            # the tied wte: first and last stage each hold the exchanged sum
    assert grads.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(grads[k], ref[k], rtol=1e-10, atol=1e-12, msg=k)


def test_copy_true_leaves_the_callers_model_whole():
    def body():
        model = GPT(CFG, seed=0, dtype=torch.float64)
        pipe = PipelineParallel(model, sch.one_f_one_b(2, 2))
        return all(b is not None for b in model.blocks), pipe.module is model
    for whole, same in parlab.run(body, 2):
        assert whole and not same


def _hybrid_part():
    grid = ParallelGrid(4, tp=2, pp=2)
    model = GPT(CFG, seed=0, dtype=torch.float64)
    hyb = build_hybrid(model, build_groups(grid), schedule="1f1b", copy=False, device="cpu", lr=1e-3)
    stages = hyb.pipeline.my_stages
    return {"bytes": sum(p.nbytes for p in hyb.parameters()), "stages": stages,
            "module_is_model": hyb.module is model}


def test_hybrid_rank_holds_its_stage_sharded_over_tp():
    res = parlab.run(_hybrid_part, 4)
    dense_bytes = sum(p.nbytes for p in GPT(CFG, seed=0, dtype=torch.float64).parameters())
    for r in res:
        assert r["module_is_model"]
        # TP splits every weight but the layer norms (and row-parallel biases) over 2 ranks: between a half
        # and all of the stage's bytes, and well under the dense model's
        stage = _stage_bytes(CFG, r["stages"], 2)
        assert stage / 2 <= r["bytes"] < stage < dense_bytes


def _fsdp_on_device():
    model = GPT(CFG, seed=0, dtype=torch.float64)
    f = FullyShardedDataParallel(model, device=torch.device("cpu"))
    x, y = _batch()
    loss = f(*[t.chunk(2)[comm.get_rank()] for t in (x, y)])[1]
    return {"devices": {p.device.type for p in f.parameters()}, "loss": loss.detach(),
            "full": f.full_parameters(), "bytes": sum(p.nbytes for p in f.parameters())}


def test_fsdp_device_option_places_the_shards():
    res = parlab.run(_fsdp_on_device, 2)
    dense = GPT(CFG, seed=0, dtype=torch.float64)
    total = sum(p.nbytes for p in dense.parameters())
    for r in res:
        assert r["devices"] == {"cpu"}
        assert r["bytes"] <= total / 2 + 8 * 2 * (CFG.n_layer + 1)       # half, up to padding per unit
        for name, p in dense.named_parameters():
            torch.testing.assert_close(r["full"][name], p.detach(), rtol=0, atol=0)


# ----------------------------------------------------------------------------- the labs' memory report
def _lab(device, monkeypatch):
    import parlab.labs as labs
    import parlab.labs.loop
    args = argparse.Namespace(steps=2, batch=2, seq_len=4, quiet=True, no_trace=True, dtype="float32")
    ctx = Context(rank=0, world_size=1, local_rank=0, device=torch.device(device), backend="test")
    lab = labs.Lab("test", args, ctx, CFG, BatchSampler(load_corpus(n_chars=2000), 2, 4))
    monkeypatch.setattr(parlab.labs.loop, "gather_to_main", lambda obj: [obj])
    return lab


def test_lab_reports_the_construction_peak_on_cuda(monkeypatch, capsys):
    """With a mocked allocator: 300 MB at the peak of construction, 100 MB during training. The report must
    show both, labelled, and max_mem/rank must be the construction peak (resetting the counter before
    training, and reporting only that, would hide it)."""
    lab = _lab("cuda", monkeypatch)
    peak = {"value": 300_000_000}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak["value"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: peak.update(value=0))
    monkeypatch.setattr(torch.cuda, "synchronize",                 # a training step allocates 100 MB
                        lambda device=None: peak.update(value=max(peak["value"], 100_000_000)))
    summary = lab.train(lambda i: torch.tensor(1.0), lambda: [])
    out = capsys.readouterr().out
    assert "construction_peak 300.00 MB, training_peak 100.00 MB, max_allocated 300.00 MB" in out
    assert summary["max_mem_per_rank"] == 300_000_000
    assert "peak of construction" in out and "max_mem/rank=300.00 MB" in out


def test_lab_reports_construction_on_cpu(monkeypatch, capsys):
    lab = _lab("cpu", monkeypatch)
    model = GPT(CFG, seed=0)
    lab.train(lambda i: torch.tensor(1.0), model.parameters)
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("  rank"))
    after = float(line.split("rss_peak_after_construction ")[1].split(" MB")[0])
    end = float(line.split("rss_peak_at_end ")[1].split(" MB")[0])
    assert 0 < after <= end                                                # a peak never falls
