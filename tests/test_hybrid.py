"""4D hybrid parallelism (parlab.parallel.hybrid) on 8 simulated ranks vs one process on the same global batch."""
import re

import pytest
import torch

import parlab
from parlab.parallel.groups import build_groups
from parlab.parallel.hybrid import build_hybrid, check_layout, group_dim, make_schedule, traffic_by_dim
from parlab.models import GPT, GPTConfig
from parlab.parallel.topology import ParallelGrid

from p2p_order import assert_mirrored_p2p

# 8 heads and vocab 16 so tp=8 works; 4 layers so pp=4 (or pp=2 x 2 chunks) works; S=8 splits into 2*cp=4 chunks.
CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=4, n_head=8, n_embd=16, mlp_ratio=2)
# Two steps: the second runs on the AdamW state (and its ZeRO shards) the first left, where a state kept on the wrong
# rank or shard shows (an optimizer that forgets its state after each step fails here; a third step cost 23% more).
B, STEPS, LR = 8, 2, 1e-2
# float64 everywhere: the only differences from the one-process run are summation orders in the reductions
# (~1e-16 relative), which two AdamW steps amplify by far less than this.
TOL = 1e-10


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, CFG.vocab_size, (B, CFG.seq_len), generator=g)  # (B, S)
    return x, torch.roll(x, -1, dims=1)


def reference():
    model = GPT(CFG, seed=0, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for s in range(STEPS):
        _, loss = model(*batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def train(dp, tp, pp, cp, kw):
    grid = ParallelGrid(8, tp=tp, pp=pp, cp=cp)
    assert grid.dp == dp
    groups = build_groups(grid, dims=("tp", "cp", "pp", "dp-cp"))
    h = build_hybrid(GPT(CFG, seed=0, dtype=torch.float64), groups, lr=LR, **kw)
    losses = [h.train_step(*batch(s)).item() for s in range(STEPS)]
    return losses, h.dense_state_dict()


# (dp, tp, pp, cp, options)
LAYOUTS = [
    (2, 2, 2, 1, {}),                                          # TP + PP + DP (Megatron's PTD-P)
    (1, 2, 4, 1, {}),                                          # TP + PP
    (8, 1, 1, 1, {}),                                          # DP only
    (1, 8, 1, 1, {}),                                          # TP only, 8 heads over 8 ranks
    (2, 1, 4, 1, {"schedule": "gpipe"}),                       # PP + DP
    (2, 2, 1, 2, {}),                                          # DP x CP (ring) x TP
    (2, 1, 2, 2, {}),                                          # DP x CP x PP
    (2, 2, 2, 1, {"zero_stage": 1}),                           # TP + PP + ZeRO-1
    (4, 2, 1, 1, {"sequence_parallel": True, "zero_stage": 2}),  # TP+SP + ZeRO-2
    (2, 2, 2, 1, {"schedule": "interleaved", "chunks": 2}),    # interleaved 1F1B, 2 chunks per rank
    (2, 2, 1, 2, {"cp_attention": "ulysses", "cp_layout": "contiguous"}),
    (4, 1, 2, 1, {"schedule": "zb-h1"}),                       # zero bubble (split backward)
    (1, 2, 2, 2, {"cp_layout": "contiguous"}),                 # TP x CP x PP
    (2, 2, 1, 2, {"sequence_parallel": True, "zero_stage": 1}),  # TP+SP x CP x ZeRO-1 over dp-cp
    (2, 2, 2, 1, {"sequence_parallel": True}),                 # TP+SP x PP: stages exchange (b, S/tp, H)
    (1, 2, 2, 2, {"sequence_parallel": True, "schedule": "interleaved", "chunks": 2}),  # SP x PP x CP
    (2, 2, 2, 1, {"schedule": "zb-h1"}),                       # zero bubble with TP-sharded layers
    (1, 2, 4, 1, {"schedule": "zb-h1", "sequence_parallel": True, "microbatches": 4}),  # ZB-H1 x TP+SP
]


def _expected_group(grid: ParallelGrid, e) -> list[int]:
    """Which group a message must use, from its label."""
    if re.match(r"stage \d+ -> \d+ (act|grad)|tied embedding grad|loss to all stages", e.label):
        return grid.group_of(e.rank, "pp")
    if re.match(r"ring |ulysses ", e.label):
        return grid.group_of(e.rank, "cp")
    if re.match(r"pipeline dp grads|zero (grads|params)|loss average", e.label):
        return grid.group_of(e.rank, "dp-cp")
    return grid.group_of(e.rank, "tp")                          # module paths: TP/SP f, g, gathers, sp grads


@pytest.mark.parametrize("dp,tp,pp,cp,kw", LAYOUTS, ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={x}" for k, x in v.items()) or "-")
def test_layout_matches_one_process(dp, tp, pp, cp, kw):
    ref_losses, ref_state = reference()
    res = parlab.run(train, 8, dp, tp, pp, cp, kw, trace=True, echo=False)
    for rank, (losses, state) in enumerate(res.results):
        assert losses == pytest.approx(ref_losses, abs=TOL), f"rank {rank}"
        for name, value in state.items():                     # this rank's stage(s), gathered over tp
            torch.testing.assert_close(value, ref_state[name], rtol=0, atol=TOL, msg=f"rank {rank} {name}")
    grid = ParallelGrid(8, tp=tp, pp=pp, cp=cp)
    events = res.trace.comm().events
    for e in events:                                           # every message in its dimension's group
        assert list(e.group) == _expected_group(grid, e), (e.rank, e.op, e.label, e.group)
        if e.kind == "p2p" and e.label.startswith("stage"):   # pipeline p2p only between pp neighbours
            pg = grid.group_of(e.rank, "pp")
            i = pg.index(e.rank)
            assert e.peer in (pg[(i + 1) % pp], pg[(i - 1) % pp])
    dims = {group_dim(grid, e) for e in events}                # each dimension of size > 1 talks, no other
    grads_dim = "dp-cp" if dp > 1 and cp > 1 else "dp" if dp > 1 else "cp"  # gradients go over dp-cp
    assert dims == {d for d, n in (("tp", tp), ("pp", pp), ("cp", cp), (grads_dim, dp * cp)) if n > 1}
    grad_sync = sum(e.nbytes for e in events if re.match(r"pipeline dp grads|zero grads", e.label))
    assert (grad_sync > 0) == (dp * cp > 1)
    assert sum(r["messages"] for r in traffic_by_dim(res.trace, grid).values()) == sum(
        e.op not in ("recv", "irecv") for e in events)
    if tp > 1:   # the last stage keeps (b, S, V/tp) logits: vocab-parallel cross-entropy, no logits gather
        assert any(e.label.startswith("cross-entropy") for e in events)
        if not kw.get("sequence_parallel"):                     # (SP gathers lm_head's input, (b, S, H))
            assert not any(e.op == "all_gather" and e.label.startswith("lm_head") for e in events)
    if any(e.kind == "p2p" for e in events):                   # PP and ring messages: safe on NCCL too
        assert_mirrored_p2p(res.trace)
    if pp > 1:   # every pipeline message is one micro-batch's hidden states, a tp-th of them under SP
        b = B // (dp * (kw.get("microbatches") or pp))           # rows per micro-batch
        want = b * (CFG.seq_len // cp // (tp if kw.get("sequence_parallel") else 1)) * CFG.n_embd * 8
        assert {e.nbytes for e in events if e.op == "send" and e.label.startswith("stage")} == {want}


def test_unsupported_combinations_say_what_is_supported():
    grid = ParallelGrid(8, tp=2, pp=2)
    with pytest.raises(ValueError, match="use a seq_len that is a multiple of cp \\* tp = 2"):
        check_layout(CFG, grid, make_schedule("1f1b", 2, 2), sequence_parallel=True, seq_len=7)
    with pytest.raises(ValueError, match="n_head 8 is not divisible by tp 3"):
        check_layout(CFG, ParallelGrid(6, tp=3), make_schedule("1f1b", 1, 1))
    with pytest.raises(ValueError, match="n_layer 4 < 8 pipeline stages"):
        check_layout(CFG, ParallelGrid(8, pp=8), make_schedule("1f1b", 8, 8))
    with pytest.raises(ValueError, match="global batch 6 must split"):
        check_layout(CFG, ParallelGrid(8, tp=2, pp=2), make_schedule("1f1b", 2, 2), batch_size=6)
    with pytest.raises(ValueError, match="ZeRO-3 .* not composed with TP/PP .*FullyShardedDataParallel on its own"):
        check_layout(CFG, grid, make_schedule("1f1b", 2, 2), zero_stage=3)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("pipedream", 2, 2)
