"""Memory accounting: the ZeRO formulas reproduce the paper's figures, and the bytes each rank really
holds (measured from its tensors) equal them for our model."""
import pytest
import torch

import parlab
from parlab import comm
from parlab.corpus import BatchSampler, load_corpus
from parlab.parallel.zero import FullyShardedDataParallel as FSDP
from parlab.cluster import transformer as T
from parlab.cluster.costs import from_gpt_config
from parlab.parallel.zero import comm_elements, max_params, measure, model_state_bytes
from parlab.models import GPT, GPTConfig
from parlab.parallel.zero import ShardedOptimizer, iter_owned

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)
GB = 1e9


def test_paper_figures():
    # ZeRO paper, figure 1: psi = 7.5B, Nd = 64, K = 12
    got = [model_state_bytes(7.5e9, 64, s)["total"] / GB for s in (0, 1, 2, 3)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)
    assert model_state_bytes(1, 1, 0) == {"params": 2, "grads": 2, "optimizer": 12, "total": 16}
    assert max_params(80e9, 1, 0) == pytest.approx(5.0e9)          # seed 001: an 80 GB GPU holds 5.0B
    assert model_state_bytes(175e9, 1, 0)["params"] / GB == pytest.approx(350)   # GPT-3's 16-bit weights
    # the per-GPU total of ZeRO-3 shrinks exactly as 1/Nd; ZeRO-1 and ZeRO-2 approach 4 psi and 2 psi
    assert model_state_bytes(1e9, 8, 3)["total"] * 8 == model_state_bytes(1e9, 1, 0)["total"]
    assert model_state_bytes(1e9, 10**9, 1)["total"] == pytest.approx(4e9, rel=1e-6)
    assert model_state_bytes(1e9, 10**9, 2)["total"] == pytest.approx(2e9, rel=1e-6)


def test_communication_volume():
    assert [comm_elements(100, s) for s in (0, 1, 2, 3)] == [200, 200, 200, 300]
    assert comm_elements(100, 3, nd=4) / comm_elements(100, 0, nd=4) == pytest.approx(1.5)
    assert comm_elements(100, 0, nd=4) == pytest.approx(150)                # ring: 2 (N-1)/N psi


def test_transformer_parameter_count_matches_the_model():
    for cfg in (CFG, GPTConfig(n_layer=3, n_embd=48, n_head=4, vocab_size=50, seq_len=8)):
        # the one count (Megatron's eq. 2, parlab.cluster.transformer.params) with the final LayerNorm's 2 h
        assert cfg.param_count() == T.params(from_gpt_config(cfg), final_norm=True)
        assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.param_count()


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="stage"):
        model_state_bytes(1, 1, 4)
    with pytest.raises(ValueError, match="nd"):
        model_state_bytes(1, 0, 1)


def test_measure_counts_each_tensor_once():
    model = GPT(CFG)                                    # tied lm_head: counted once
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert measure(model.parameters(), opt) == {"params": 4 * CFG.param_count(), "grads": 0, "optimizer": 0,
                                                "total": 4 * CFG.param_count()}
    x = torch.zeros(2, 8, dtype=torch.long)
    model(x, x)[1].backward()
    opt.step()
    n = len(list(model.parameters()))
    m = measure(model.parameters(), opt)
    # fp32 AdamW: m and v (8 bytes) per parameter, plus one float32 step counter per tensor
    assert m["grads"] == 4 * CFG.param_count() and m["optimizer"] == 8 * CFG.param_count() + 4 * n


def _measure_all_stages():
    """fp32 GPT, AdamW, one step at each stage; bytes measured after the step (before zero_grad)."""
    rank, world = comm.get_rank(), comm.get_world_size()
    x, y = BatchSampler(load_corpus(2000), 8, CFG.seq_len, seed=1).shard(0, rank, world)
    out = {}
    for stage in (0, 1, 2, 3):
        model = GPT(CFG)
        if stage == 3:
            model = FSDP(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        elif stage == 0:                                  # plain DP: every rank holds everything
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3)
        model(x, y)[1].backward()
        if stage == 0:
            for p in model.parameters():
                comm.all_reduce(p.grad, op=comm.ReduceOp.AVG, label="dp grads")
        opt.step()
        held = {0: list(model.parameters()), 3: list(model.parameters())}.get(stage) or list(iter_owned(opt))
        out[stage] = {"measured": measure(model.parameters(), opt), "numel": sum(p.numel() for p in held),
                      "tensors": len(opt.state) if stage in (1, 2) else len(held),   # ZeRO: a step per flat run
                      "unsharded": model.unsharded_bytes() if stage == 3 else 0}
    return out


def test_measured_bytes_match_the_formulas():
    world = 4
    res = parlab.run(_measure_all_stages, world)
    psi = CFG.param_count()
    for r, out in enumerate(res):
        for stage, row in out.items():
            m, n, t = row["measured"], row["numel"], row["tensors"]
            # exact accounting: fp32 weights and grads (4 bytes), AdamW m and v (8) + a step counter per tensor
            held_params = n if stage == 3 else psi        # ZeRO-3 keeps its (padded) shards only
            held_grads = n if stage >= 2 else psi
            assert m == {"params": 4 * held_params, "grads": 4 * held_grads, "optimizer": 8 * n + 4 * t,
                         "total": 4 * held_params + 4 * held_grads + 8 * n + 4 * t}, (r, stage)
            assert row["unsharded"] == 0                  # no gathered weights outlive the step
            formula = model_state_bytes(psi, world, stage, param_bytes=4, grad_bytes=4, k=8)["total"]
            ratio = m["total"] / formula
            if stage in (0, 3):   # step counters (4 bytes per tensor) and ZeRO-3's padding to a multiple of Nd
                assert 1.0 <= ratio < 1.01, (stage, ratio)
            else:                 # whole tensors per rank: balanced up to the size of one tensor
                assert 0.9 < ratio < 1.1, (stage, ratio)
    for stage in (1, 2, 3):       # the shards add up to the whole model, nothing lost or held twice
        total = sum(out[stage]["numel"] for out in res)
        if stage < 3:
            assert total == psi
        else:                     # each flat is padded by fewer than Nd elements
            assert psi <= total < psi + world * res[0][3]["tensors"]


def test_min_dp_size_for_real_models():
    from parlab.parallel.zero import min_dp_size
    gpu = 80e9
    # model states only (16-bit Adam): DP never fits 7B (112 GB); ZeRO-1/2 keep 4 psi / 2 psi whole on every GPU
    assert [min_dp_size(7e9, gpu, s) for s in range(4)] == [None, 2, 2, 2]
    assert [min_dp_size(13e9, gpu, s) for s in range(4)] == [None, 6, 4, 3]
    assert [min_dp_size(70e9, gpu, s) for s in range(4)] == [None, None, None, 14]
    assert [min_dp_size(175e9, gpu, s) for s in range(4)] == [None, None, None, 35]
    assert min_dp_size(1e9, gpu, 0) == 1
    for psi, stage in ((13e9, 1), (13e9, 2), (175e9, 3)):          # the smallest Nd: it fits, Nd - 1 does not
        nd = min_dp_size(psi, gpu, stage)
        assert model_state_bytes(psi, nd, stage)["total"] <= gpu < model_state_bytes(psi, nd - 1, stage)["total"]
