"""Ring attention: layouts, the causal schedule, the online-softmax merge, and the ring itself against full
attention on one process (output and dQ, dK, dV), with its work per step and bytes read from the trace."""
import pytest
import torch

import parlab
from parlab import comm
from parlab.models import causal_attention
from parlab.parallel.context import (LAYOUTS, RingStats, attention_block, block_plan, check_seq_len, chunk_ids,
                                   merge_partials, ring_attention, ring_bytes_per_rank, shard_positions, shard_sequence,
                                   unshard_sequence, work_matrix)

from p2p_order import assert_mirrored_p2p

B, NH, HD = 2, 3, 4


def _qkv_do(S, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, NH, S, HD, generator=g, dtype=torch.float64).to(dtype) for _ in range(4)]  # (B, nh, S, hd)


def _reference(S, causal, dtype=torch.float64):
    q, k, v, do = _qkv_do(S, dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = causal_attention(q, k, v, causal=causal)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def _limit(P, layout):
    """The shortest sequence a layout can split: one position per chunk."""
    return P if layout == "contiguous" else 2 * P


# ---------------------------------------------------------------------- pure: layouts and schedule
def test_zigzag_gives_rank_r_chunks_r_and_2p_minus_1_minus_r():
    assert [chunk_ids(r, 4, "zigzag") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert shard_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert shard_positions(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_shard_then_unshard_is_the_identity_and_shards_partition_the_sequence(P, layout):
    S = 3 * _limit(P, layout)
    x = torch.arange(2 * S).reshape(2, S)                       # (B, S)
    shards = [shard_sequence(x, P, r, layout) for r in range(P)]
    assert all(s.shape == (2, S // P) for s in shards)
    assert sorted(torch.cat([shard_positions(S, P, r, layout) for r in range(P)]).tolist()) == list(range(S))
    assert torch.equal(unshard_sequence(shards, layout), x)


def test_sequence_lengths_that_do_not_split_raise_clear_errors():
    with pytest.raises(ValueError, match="multiple of 4"):
        check_seq_len(6, 4, "contiguous")
    with pytest.raises(ValueError, match="multiple of 8"):
        check_seq_len(12, 4, "zigzag")                       # 12 = 3 * 4 is fine contiguous, not zigzag
    with pytest.raises(ValueError, match="layout"):
        shard_positions(8, 2, 0, "striped")
    check_seq_len(4, 4, "contiguous")                        # the limits themselves are fine
    check_seq_len(8, 4, "zigzag")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
def test_block_plan_covers_exactly_the_allowed_scores(P, layout):
    """Brute force over positions: every causally allowed (query, key) pair is inside the planned block, and
    the planned block holds only allowed pairs (or, where it asks for the mask, exactly the lower triangle)."""
    S = 2 * P * 2
    c = S // P
    for r in range(P):
        qpos = shard_positions(S, P, r, layout)
        for step in range(P):
            plan = block_plan(r, step, P, causal=True, layout=layout)
            src = (r - step) % P
            allowed = qpos[:, None] >= shard_positions(S, P, src, layout)[None, :]   # (c, c)
            planned = torch.zeros(c, c, dtype=torch.bool)
            if plan is not None:
                assert plan.src == src
                rows = {"all": slice(0, c), "front": slice(0, c // 2), "back": slice(c // 2, c)}
                planned[rows[plan.q], rows[plan.k]] = True
                if plan.mask:
                    planned &= torch.ones(c, c, dtype=torch.bool).tril()
            assert torch.equal(planned, allowed), (r, step, plan)


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_work_matrix_contiguous_is_imbalanced_and_zigzag_balanced(P):
    contiguous = work_matrix(P, causal=True, layout="contiguous")
    zigzag = work_matrix(P, causal=True, layout="zigzag")
    assert [sum(row) for row in contiguous] == [r + 1 for r in range(P)]      # rank r computes r + 1 of P blocks
    assert [sum(row) for row in zigzag] == [(P + 1) / 2] * P                  # same total, spread evenly
    assert all(row[1:] == [0.5] * (P - 1) for row in zigzag)                  # and evenly in every step
    assert work_matrix(P, causal=False, layout="zigzag") == [[1.0] * P] * P


# ---------------------------------------------------------------------- pure: one block and the merge
@pytest.mark.parametrize("scale", [1.0, 1e3])
def test_merge_of_two_key_halves_equals_attention_over_all_keys(scale):
    q, k, v, _ = _qkv_do(6)
    q = q * scale                                   # scale 1e3: scores ~ 1e3, exp() overflows float64
    out1, lse1 = attention_block(q, k[..., :2, :], v[..., :2, :])
    out2, lse2 = attention_block(q, k[..., 2:, :], v[..., 2:, :])
    out, lse = merge_partials(out1, lse1, out2, lse2)
    ref, ref_lse = attention_block(q, k, v)
    # float64, a handful of operations: agreement to a few ulps of the values (|out| <= max|v| ~ 3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-14, atol=0)
    naive = torch.log(torch.exp(lse1) + torch.exp(lse2))
    assert torch.isfinite(out).all() and (scale == 1.0) == bool(torch.isfinite(naive).all())


# ---------------------------------------------------------------------- the ring on P ranks
def _ring(S, causal, layout, dtype):
    P, r = comm.get_world_size(), comm.get_rank()
    q, k, v, do = _qkv_do(S, dtype)
    q, k, v = (shard_sequence(t, P, r, layout, dim=2).requires_grad_() for t in (q, k, v))  # (B, nh, S/P, hd)
    stats = RingStats()
    out = ring_attention(q, k, v, causal=causal, layout=layout, stats=stats)
    out.backward(shard_sequence(do, P, r, layout, dim=2))
    return [out.detach(), q.grad, k.grad, v.grad], stats


def _check_against_full(per_rank, S, causal, layout):
    P = len(per_rank)
    ref = _reference(S, causal)
    got = [unshard_sequence([per_rank[r][0][i] for r in range(P)], layout, dim=2) for i in range(4)]
    for name, g, want in zip(("out", "dq", "dk", "dv"), got, ref):
        # float64: the ring sums the same terms in another order; 1e-12 is ~1e4 ulps of O(1) values
        torch.testing.assert_close(g, want, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")


def _ring_lengths(lengths, causal, layout):
    """One run, several sequence lengths: a traced run per length would cost a process start each."""
    return [_ring(S, causal, layout, torch.float64) for S in lengths]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("P", [2, 4])
def test_ring_attention_equals_full_attention_output_and_grads(P, causal, layout):
    limit = _limit(P, layout)                                   # one position per chunk
    lengths = [limit, 3 * limit]
    res = parlab.run(_ring_lengths, P, lengths, causal, layout, trace=True)
    sends = res.trace.filter(op="send").events
    for i, S in enumerate(lengths):
        per_rank = [res[r][i] for r in range(P)]
        _check_against_full(per_rank, S, causal, layout)

        # work per rank per step, as counted by the kernels, is the schedule's work matrix (c x c score entries)
        c = S // P
        want = [[w * c * c for w in row] for row in work_matrix(P, causal, layout)]
        assert [per_rank[r][1].forward for r in range(P)] == want
        assert [per_rank[r][1].backward for r in range(P)] == want

        # bytes from the trace: forward (P-1) K/V blocks, backward (P-1) K/V blocks + P dK/dV blocks
        block = 2 * B * NH * c * HD * 8                         # K and V of one chunk, float64
        formula = ring_bytes_per_rank(P, B, NH, c, HD, element_size=8)
        assert formula == {"forward": (P - 1) * block, "backward": (2 * P - 1) * block}
        mine = [e for e in sends if e.nbytes == block]          # the two lengths have different block sizes
        for r in range(P):
            sent = lambda label: sum(e.wire_bytes for e in mine if e.rank == r and e.label.startswith(label))
            assert sent("ring fwd kv") == (P - 1) * block == formula["forward"]
            assert sent("ring bwd kv") == (P - 1) * block
            assert sent("ring bwd dkv") == P * block
            assert sent("ring bwd") == formula["backward"]
    assert len(sends) == len(lengths) * P * (3 * P - 2)         # (P-1) + (P-1) + P messages per rank and length
    assert assert_mirrored_p2p(res.trace) == (2 if P == 2 else 2 * P)  # safe on NCCL (tests/p2p_order.py)


def test_ring_attention_float32_is_close_to_the_float64_reference():
    P, S, layout = 4, 16, "zigzag"
    res = parlab.run(_ring, P, S, True, layout, torch.float32)
    ref = _reference(S, True)
    for i in range(4):
        got = unshard_sequence([res[r][0][i] for r in range(P)], layout, dim=2).double()
        # float32 has 24-bit mantissas (eps 1.2e-7); softmax and a few matmuls of length <= 16 stay within 1e-5
        torch.testing.assert_close(got, ref[i], rtol=0, atol=1e-5)


def test_imbalance_shows_in_the_counted_work():
    P, S = 4, 16
    for layout, totals in (("contiguous", [1, 2, 3, 4]), ("zigzag", [2.5] * 4)):
        res = parlab.run(_ring, P, S, True, layout, torch.float64)
        c = S // P
        assert [sum(res[r][1].forward) / (c * c) for r in range(P)] == totals


def test_next_block_transfer_starts_before_the_current_block_is_computed():
    P, S = 4, 8
    res = parlab.run(_ring, P, S, True, "zigzag", torch.float64, trace=True)
    for r in range(P):
        for step in range(P - 1):
            send = res.trace.filter(rank=r, op="send", label=f"ring fwd kv step {step}").events
            recv = res.trace.filter(rank=r, op="recv", label=f"ring fwd kv step {step}").events
            compute = res.trace.filter(rank=r, kind="compute", label=f"fwd step {step} ").events
            assert len(send) == len(recv) == len(compute) == 1
            assert send[0].start <= compute[0].start and recv[0].start <= compute[0].start


def _ring_bad(shape_k):
    q = torch.zeros(1, 1, 3, 2)
    return ring_attention(q, torch.zeros(shape_k), torch.zeros(shape_k), layout="zigzag")


def test_bad_inputs_raise_value_errors_on_the_rank():
    with pytest.raises(parlab.RankError, match="must be even"):
        parlab.run(_ring_bad, 2, (1, 1, 3, 2), echo=False)
    with pytest.raises(parlab.RankError, match="of one shape"):
        parlab.run(_ring_bad, 2, (1, 1, 4, 2), echo=False)


def test_ring_steps_reads_every_transfer_and_block_back_from_the_trace():
    from parlab.parallel.context import ring_steps
    P, S = 4, 8
    res = parlab.run(_ring, P, S, True, "contiguous", torch.float64, trace=True)
    rows = ring_steps(res.trace)
    block = 2 * B * NH * (S // P) * HD * 8
    for r in range(P):
        mine = [x for x in rows if x["rank"] == r]
        fwd_compute = sorted(x["step"] for x in mine if x["phase"] == "fwd" and x["what"] == "compute")
        assert fwd_compute == list(range(r + 1))               # contiguous causal: steps 0..r only
        sends = [x for x in mine if x["what"] == "send kv" and x["phase"] == "fwd"]
        assert sorted(x["step"] for x in sends) == list(range(P - 1))
        assert all(x["peer"] == (r + 1) % P and x["bytes"] == block for x in sends)
        assert sum(x["what"] == "send dkv" for x in mine) == P


def test_ring_steps_compute_rows_name_the_block_and_rows_the_schedule_chose():
    from parlab.parallel.context import ring_steps
    P, S = 4, 16
    res = parlab.run(_ring, P, S, True, "zigzag", torch.float64, trace=True)
    computes = [x for x in ring_steps(res.trace) if x["what"] == "compute"]
    assert len(computes) == 2 * P * P                          # zigzag: every rank computes at every step, fwd + bwd
    for x in computes:
        plan = block_plan(x["rank"], x["step"], P, True, "zigzag")
        assert (x["src"], x["q"], x["k"]) == (plan.src, plan.q, plan.k)


def test_memory_and_overlap_formulas():
    from parlab.parallel.context import attention_memory_per_rank, overlap_threshold
    full = attention_memory_per_rank(1024, 1, 8, 64, method="full", element_size=1)
    assert full == {"tensors": 4 * 1024 * 512, "scores": 8 * 1024 ** 2, "total": 4 * 1024 * 512 + 8 * 1024 ** 2}
    ring = attention_memory_per_rank(1024, 4, 8, 64, method="ring", element_size=1)
    assert ring["tensors"] == 6 * 256 * 512 and ring["scores"] == 8 * 256 ** 2
    uly = attention_memory_per_rank(1024, 4, 8, 64, method="ulysses", element_size=1)
    assert uly["scores"] == full["scores"] / 4 and uly["tensors"] == 2 * full["tensors"] / 4
    with pytest.raises(ValueError, match="method"):
        attention_memory_per_rank(1024, 4, 8, 64, method="zigzag")
    assert overlap_threshold(312e12, 300e9) == pytest.approx(1040)            # 16-bit: c* = F / W
    assert overlap_threshold(1e12, 1e9, element_size=4) == pytest.approx(2000)


def test_context_parallel_figures_draw_from_plain_rows():
    from parlab.viz import context_parallel as cpviz
    P = 2
    rows = [dict(rank=r, phase="fwd", step=s, what="compute", peer=None, bytes=0, start=s, end=s + 1,
                 src=block_plan(r, s, P, True, "zigzag").src, q=block_plan(r, s, P, True, "zigzag").q,
                 k=block_plan(r, s, P, True, "zigzag").k) for r in range(P) for s in range(P)]
    rows += [dict(rank=r, phase="fwd", step=0, what="send kv", peer=(r + 1) % P, bytes=64, start=0, end=0.5)
             for r in range(P)]
    fig = cpviz.ring_animation(rows, P, "zigzag", causal=True)
    assert len(fig.frames) == P
    last = fig.frames[-1].data[3].z                                          # 2P x 2P: causal lower triangle filled
    assert all((last[i][j] is not None) == (j <= i) for i in range(2 * P) for j in range(2 * P))
    # the cells a compute row covers: rank 1 at step 1 (K/V of rank 0, all queries x front key half)
    assert cpviz.block_cells(rows[3], P, "zigzag", True) == [(1, 0), (2, 0)]
    heat = cpviz.work_heatmaps({"zigzag": work_matrix(P, True, "zigzag")})
    assert list(heat.data[0].z[0]) == [1.0, 0.5]
    grid = cpviz.ulysses_grid([[(0, 0), (0, 1)], [(1, 0), (1, 1)]], [[(0, 0), (1, 0)], [(0, 1), (1, 1)]], 2, 2)
    assert [list(row) for row in grid.data[1].z] == [[0, 1], [0, 1]]
    assert len(cpviz.memory_figure([1, 2], {"a": [1, 2]}, limit=3).data) == 1
    assert len(cpviz.overlap_figure([1, 2], [1, 4], [2, 2], threshold=1.5).data) == 3


def _ring_bf16(S):
    (out, dq, dk, dv), _ = _ring(S, True, "zigzag", torch.bfloat16)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == torch.bfloat16   # results in the input dtype
    return [out, dq, dk, dv]


def test_ring_attention_bfloat16_accumulates_in_float32():
    P, S = 4, 64
    res = parlab.run(_ring_bf16, P, S, trace=True)
    q, k, v, do = (t.double().requires_grad_() for t in _qkv_do(S, torch.bfloat16))   # the same bf16 values
    ref_out = causal_attention(q, k, v, causal=True)
    ref_out.backward(do.detach())
    for name, i, want in (("out", 0, ref_out.detach()), ("dq", 1, q.grad), ("dk", 2, k.grad), ("dv", 3, v.grad)):
        got = unshard_sequence([res[r][i] for r in range(P)], "zigzag", dim=2).double()
        # Every result is rounded to bf16 once, at the end: half an ulp, 2^-8 relative, so <= 2^-7 for values
        # below 4 (|out| < 2.1, |dq|, |dk|, |dv| < 3.6 here). Scores, softmax, P.V, dQ and the travelling dK/dV
        # all sum in float32; what else is left are the bf16 probabilities in P.V (as FlashAttention) and
        # delta = rowsum(dO * O) from the bf16 output. Bound 2^-6 (the previous one was 2^-5): measured here
        # out 0.0052, dq 0.0059, dk 0.0094, dv 0.0071. Before (bf16 scores, dK/dV summed in bf16 on the way
        # around): dk 0.020, over this bound; with only the dK/dV sums in bf16: dk 0.0114, dv 0.0106.
        torch.testing.assert_close(got, want, rtol=0, atol=2**-6, msg=lambda m: f"{name}: {m}")
    # what travels: K/V blocks in bf16 (data), the dK/dV partial sums in float32 (twice the bytes)
    c = S // P
    kv_block = 2 * B * NH * c * HD * 2                          # K and V of one chunk, bf16
    formula = ring_bytes_per_rank(P, B, NH, c, HD, element_size=2)
    assert formula == {"forward": (P - 1) * kv_block, "backward": (P - 1) * kv_block + P * 2 * kv_block}
    sends = res.trace.filter(op="send").events
    for r in range(P):
        sent = lambda label: [e.nbytes for e in sends if e.rank == r and e.label.startswith(label)]
        assert sent("ring bwd kv") == [kv_block] * (P - 1)
        assert sent("ring bwd dkv") == [2 * kv_block] * P        # float32: 4 bytes per element
        assert sum(sent("ring fwd kv")) == formula["forward"]
        assert sum(sent("ring bwd")) == formula["backward"]


def _ring_serialised(S):
    from serialised_p2p import serialised_p2p
    with serialised_p2p():
        return _ring(S, True, "zigzag", torch.float64)


@pytest.mark.parametrize("P", [2, 3, 4])
def test_ring_attention_runs_under_nccl_p2p_rules(P):
    # tests/serialised_p2p.py: a send completes only when its receive is at the head of the peer's one queue
    # of p2p operations (NCCL with eager communicators); an order that could hang on GPUs hangs here
    S = 2 * P * 2
    res = parlab.run(_ring_serialised, P, S, timeout=60)
    _check_against_full([res[r] for r in range(P)], S, True, "zigzag")


def test_block_scores_stay_float32_under_autocast():
    from parlab.parallel.context.ring import _attention_block
    q, k, v, _ = _qkv_do(16, torch.bfloat16)                              # bf16 values, (B, nh, 16, hd)
    with torch.autocast("cpu", dtype=torch.bfloat16):                     # the labs' --dtype bfloat16 mode
        out, lse = _attention_block(q, k, v, mask=True)
    assert out.dtype == lse.dtype == torch.float32
    s = (q.double() @ k.double().transpose(-2, -1) / HD**0.5).masked_fill(~torch.ones(16, 16).tril().bool(),
                                                                          float("-inf"))
    # float32 scores of length-4 dot products: ~1e-7 relative of |lse| < 10. Scores rounded to bf16 (what
    # autocast's matmul returns unless cast back) would be off by up to 2^-9 relative: ~1e-2 here.
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=0, atol=1e-5)
