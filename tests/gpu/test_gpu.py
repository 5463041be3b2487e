"""Checks that need CUDA (skipped without it; `python -m parlab.labs.gpu_check` runs them on a GPU node): NCCL
collectives and point-to-point through parlab.comm, ring attention on NCCL against the one-process reference,
the "cuda-events" trace clock on a real device, and meta-device construction materialised on the GPU."""
import pytest
import torch

import parlab
from parlab import comm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU node)")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")


def _all_reduce():
    r = comm.get_rank()
    x = torch.full((1 << 20,), float(r + 1), device=torch.device("cuda", r))   # 4 MB: past NCCL's small buffers
    comm.all_reduce(x)
    return x[:4]


@two_gpus
def test_nccl_all_reduce_through_parlab_comm():
    res = parlab.run(_all_reduce, 2, backend="nccl")
    for out in res.results:
        assert out.device.type == "cpu" and torch.equal(out, torch.full((4,), 3.0))   # 1 + 2; results come home


def _ring_bf16():
    from parlab.parallel.context import ring_attention, shard_sequence
    P, r = comm.get_world_size(), comm.get_rank()
    dev = torch.device("cuda", r)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 256, 32, generator=g, dtype=torch.float64) for _ in range(4))
    parts = [shard_sequence(t, P, r, "zigzag", dim=2).to(dev, torch.bfloat16) for t in (q, k, v, do)]
    q_, k_, v_ = (t.requires_grad_() for t in parts[:3])
    out = ring_attention(q_, k_, v_)
    out.backward(parts[3])
    return [t.float() for t in (out.detach(), q_.grad, k_.grad, v_.grad)]


@two_gpus
def test_ring_attention_bf16_on_nccl_matches_the_reference():
    from parlab.models import causal_attention
    from parlab.parallel.context import unshard_sequence
    res = parlab.run(_ring_bf16, 2, backend="nccl")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 256, 32, generator=g, dtype=torch.float64) for _ in range(4))
    q, k, v, do = (t.to(torch.bfloat16).double().requires_grad_() for t in (q, k, v, do))   # the same bf16 inputs
    ref = causal_attention(q, k, v)
    ref.backward(do.detach())
    for i, want in enumerate((ref.detach(), q.grad, k.grad, v.grad)):
        got = unshard_sequence([res[r][i] for r in range(2)], "zigzag", dim=2).double()
        # one bf16 rounding of the result (2^-8 relative) plus the bf16 probabilities in P.V: scale 2^-6 of the
        # largest magnitude, as in tests/test_ring_attention.py (GPU matmuls may differ from the CPU's in fp32)
        torch.testing.assert_close(got, want, rtol=0, atol=2**-6 * max(1.0, want.abs().max().item()))


def test_cuda_events_clock_times_gpu_work():
    from parlab.trace import recording, region
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    with recording(0, clock="cuda-events") as rec:
        with region("matmuls"):
            for _ in range(20):
                a = a @ a / 2048**0.5                                # queued: the host returns at once
    ev = [e for e in rec.events if e.op == "matmuls"]
    assert len(ev) == 1 and ev[0].clock == "cuda-events" and ev[0].end > ev[0].start


def test_meta_construction_materialises_on_the_gpu_with_the_dense_values():
    from parlab.parallel.meta_init import materialize
    from parlab.models import GPT, GPTConfig
    cfg = GPTConfig(n_layer=2, n_embd=64, n_head=4)
    before = torch.cuda.memory_allocated()
    model = materialize(GPT(cfg, seed=3, device="meta"), torch.device("cuda", 0))
    dense = GPT(cfg, seed=3)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.cuda.memory_allocated() - before >= held
    for (n, p), (_, d) in zip(model.named_parameters(), dense.named_parameters()):
        assert p.device.type == "cuda" and torch.equal(p.cpu(), d), n
