"""Mixture of experts (parlab.models.moe) and expert parallelism (parlab.parallel.expert) against one process.

The router's arithmetic is checked against its definitions (Switch's load-balancing loss, ST-MoE's z-loss,
GShard's capacity) and the layer against a token-by-token loop; then the tiny GPT with MoE layers run expert
parallel on 2 and 4 ranks against the one process routing the same tokens in one group per rank: loss, input
and parameter gradients, the global gradient norm, and parameters after AdamW steps; including a step where
tokens are dropped and one where a rank receives no token at all.
"""
import math

import pytest
import torch

import parlab
from parlab import comm
from parlab.models import GPT, GPTConfig, MoE, aux_losses, capacity, load_balancing_loss, moe_layers, route
from parlab.parallel.expert import (average_gradients, expert_parallel, grad_norm, is_expert_param,
                                    local_experts, routed_as_ranks)

# float64: expert parallelism changes only the order of sums (the all-to-all moves rows, the reductions over
# ranks add the same terms in another order), ~1e-16 relative, which 2 AdamW steps amplify far below this.
TOL = 1e-10
CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, n_embd=16, mlp_ratio=2, experts=4, top_k=2,
                capacity_factor=1.0, aux_loss_coeff=0.1, z_loss_coeff=1e-3)
B_RANK, STEPS, LR = 2, 2, 1e-2


# ---------------------------------------------------------------------- the router, one process
def test_load_balancing_loss_is_alpha_under_uniform_probabilities_and_grows_when_routing_concentrates():
    T, E, k = 12, 4, 2
    uniform = route(torch.zeros(T, E), k, aux_loss_coeff=0.01)
    assert uniform.aux_loss.item() == pytest.approx(0.01, rel=1e-6)         # E * sum f_i / E = 1, times alpha
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=g)
    probs = logits.softmax(-1)
    _, top = probs.topk(k)
    f = torch.tensor([(top == i).sum().item() / (T * k) for i in range(E)])
    by_hand = E * sum(f[i] * probs[:, i].mean() for i in range(E))          # Switch eq. 4, term by term
    assert load_balancing_loss(probs, top, E).item() == pytest.approx(by_hand.item(), rel=1e-6)
    skewed = logits.clone()
    skewed[:, 0] += 5.0                                                      # everyone prefers expert 0
    assert route(skewed, k, aux_loss_coeff=1.0).aux_loss > route(logits, k, aux_loss_coeff=1.0).aux_loss


def test_z_loss_and_capacity_follow_their_definitions():
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    want = (math.log(4.0) ** 2 + (1 + math.log(2.0)) ** 2) / 2              # mean of logsumexp^2
    assert route(logits, 1, z_loss_coeff=2.0).z_loss.item() == pytest.approx(2 * want, rel=1e-6)
    assert capacity(10, 4, 2, 1.0) == 5 and capacity(10, 4, 2, 1.25) == 7 and capacity(3, 8, 1, 1.0) == 1


def test_over_capacity_the_lowest_probabilities_are_dropped():
    T, E = 8, 4
    logits = torch.zeros(T, E)
    logits[:, 0] = torch.arange(1, T + 1, dtype=torch.float32)              # all want expert 0, later ones more
    r = route(logits, 1, capacity_factor=1.0)                               # capacity ceil(8 / 4) = 2
    assert r.expert[:, 0].tolist() == [0] * T
    assert r.keep[:, 0].tolist() == [False] * 6 + [True] * 2 and r.counts.tolist() == [2, 0, 0, 0]
    with pytest.raises(ValueError, match="7 tokens do not split into 2 equal routing groups"):
        route(torch.zeros(7, E), 1, groups=2)


def test_the_layer_is_the_weighted_sum_of_its_experts_token_by_token():
    torch.manual_seed(0)
    moe = MoE(8, 12, experts=4, top_k=2, capacity_factor=0.75, norm_topk=True).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    y = moe(x)
    r = moe.routing
    assert not r.keep.all()                                                 # the capacity dropped some
    ex = moe.experts
    for t, xt in enumerate(x.reshape(-1, 8)):
        want = torch.zeros(8, dtype=torch.float64)
        for j in range(2):
            if r.keep[t, j]:
                e = int(r.expert[t, j])
                h = torch.nn.functional.gelu(xt @ ex.fc.weight[e].T + ex.fc.bias[e])
                want += r.weight[t, j] * (h @ ex.proj.weight[e].T + ex.proj.bias[e])
        torch.testing.assert_close(y.reshape(-1, 8)[t], want, rtol=0, atol=1e-12)
    assert torch.equal(moe(x), y)                                           # deterministic, bit for bit


def test_the_aux_losses_reach_the_router_without_changing_the_loss():
    cfg = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, n_embd=16, experts=4, aux_loss_coeff=0.5)
    x = torch.randint(16, (2, 8), generator=torch.Generator().manual_seed(1))
    with_aux, without = GPT(cfg, seed=0), GPT(GPTConfig(**{**cfg.__dict__, "aux_loss_coeff": 0.0}), seed=0)
    (l1 := with_aux(x, x)[1]).backward()
    (l0 := without(x, x)[1]).backward()
    assert l1.item() == l0.item() and aux_losses(with_aux) > 0
    r1, r0 = with_aux.blocks[0].mlp.router.weight.grad, without.blocks[0].mlp.router.weight.grad
    assert not torch.equal(r1, r0)                                          # the balancing gradient arrived
    # downstream of the last router, where the aux losses do not reach: the same gradients
    assert torch.equal(with_aux.ln_f.weight.grad, without.ln_f.weight.grad)
    last = with_aux.blocks[-1].mlp.experts, without.blocks[-1].mlp.experts
    assert torch.equal(last[0].proj.weight.grad, last[1].proj.weight.grad)
    assert sum(p.numel() for p in with_aux.parameters()) == cfg.param_count()


@pytest.mark.parametrize("change, words", [
    (dict(experts=1), "experts is 0 .dense MLPs. or the number of experts, at least 2"),
    (dict(experts=4, top_k=5), "top_k=5 must be between 1 and experts=4"),
    (dict(moe_every=0), "moe_every must be a positive integer"),
])
def test_bad_moe_settings_are_refused(change, words):
    with pytest.raises(ValueError, match=words):
        GPTConfig(**change)


# ---------------------------------------------------------------------- expert parallel vs one process
def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, CFG.vocab_size, (world * B_RANK, CFG.seq_len), generator=g)   # (W b, S)
    return x, torch.roll(x, -1, dims=1)


def _starve_last_rank(model, world):
    """Every token routed to the experts of the first EP rank, the others get no row: channel 0 of the router's
    input made positive for every token (the LayerNorm's bias 10 against normalised values within +-4), and
    the router scoring channel 0 up for the first rank's experts, down for the rest."""
    first = CFG.experts // world
    with torch.no_grad():
        for block in model.blocks:
            block.ln_2.bias[0] = 10.0
            w = block.mlp.router.weight                                        # (E, H)
            w.zero_()
            w[:first, 0] = torch.linspace(1.0, 0.5, first, dtype=w.dtype)
            w[first:, 0] = -1.0


def _reference(world: int, starve: bool):
    model = routed_as_ranks(GPT(CFG, seed=0, dtype=torch.float64), world)
    if starve:
        _starve_last_rank(model, world)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for s in range(STEPS):
        _, loss = model(*_batch(s, world))
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        dropped = [int((~m.routing.keep).sum()) for m in moe_layers(model)]
        opt.step()
        opt.zero_grad()
        out.append((loss.item(), norm, grads, dropped))
    return out, {k: v.clone() for k, v in model.state_dict().items()}


def _expert_parallel_rank(world: int, starve: bool):
    model = GPT(CFG, seed=0, dtype=torch.float64)
    if starve:
        _starve_last_rank(model, world)
    expert_parallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    r = comm.get_rank()
    out = []
    for s in range(STEPS):
        x, y = _batch(s, world)
        _, loss = model(x[r * B_RANK:(r + 1) * B_RANK], y[r * B_RANK:(r + 1) * B_RANK])   # this rank's rows
        loss.backward()
        average_gradients(model)                                  # dense over the world, experts / ep
        norm = float(grad_norm(model))
        mean = loss.detach().clone()
        comm.all_reduce(mean, op=comm.ReduceOp.AVG)
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        received = sum(m.experts.fc.weight.grad.abs().sum().item() > 0 for m in moe_layers(model))
        opt.step()
        opt.zero_grad()
        out.append((mean.item(), norm, grads, received))
    return out, {k: v.clone() for k, v in model.state_dict().items()}, list(local_experts(CFG.experts))


@pytest.mark.parametrize("world, starve", [(2, False), (4, False), (2, True)],
                         ids=["ep2", "ep4", "ep2-one-rank-gets-no-token"])
def test_expert_parallel_gpt_matches_one_process(world, starve):
    ref_steps, ref_state = _reference(world, starve)
    assert any(d for *_, dropped in ref_steps for d in dropped)               # capacity 1.0 dropped tokens
    ranks = parlab.run(_expert_parallel_rank, world, world, starve, echo=False)
    for r, (steps, state, mine) in enumerate(ranks):
        for (loss, norm, grads, received), (ref_loss, ref_norm, ref_grads, _) in zip(steps, ref_steps):
            assert loss == pytest.approx(ref_loss, rel=TOL)
            assert norm == pytest.approx(ref_norm, rel=TOL)
            for k, g in grads.items():
                want = ref_grads[k][mine[0]:mine[-1] + 1] if is_expert_param(k) else ref_grads[k]
                torch.testing.assert_close(g, want, rtol=TOL, atol=TOL, msg=f"rank {r} grad {k}")
            if starve and r == world - 1:
                assert received == 0                                      # no token came: zero gradients
        for k, v in state.items():
            want = ref_state[k][mine[0]:mine[-1] + 1] if is_expert_param(k) else ref_state[k]
            torch.testing.assert_close(v, want, rtol=TOL, atol=TOL, msg=f"rank {r} parameter {k}")


def _layer_rank(world):
    torch.manual_seed(0)
    moe = MoE(8, 12, experts=4, top_k=2, aux_loss_coeff=0.0).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(world * 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))  # (W T, H)
    model = expert_parallel(torch.nn.Sequential(moe))
    r = comm.get_rank()
    mine = x[r * 6:(r + 1) * 6].clone().requires_grad_()
    model(mine).square().sum().backward()
    return mine.grad


@pytest.mark.parametrize("world", [2, 4])
def test_input_gradients_come_back_through_the_all_to_all(world):
    torch.manual_seed(0)
    moe = MoE(8, 12, experts=4, top_k=2, aux_loss_coeff=0.0).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(world * 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    moe.groups = world
    moe(x).square().sum().backward()
    got = torch.cat(list(parlab.run(_layer_rank, world, world, echo=False)))
    torch.testing.assert_close(got, x.grad, rtol=TOL, atol=TOL)


def _traced_layer(world):
    torch.manual_seed(0)
    moe = MoE(8, 12, experts=4, top_k=1, aux_loss_coeff=0.0)
    model = expert_parallel(torch.nn.Sequential(moe))
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()


def test_the_trace_shows_counts_dispatch_and_combine_each_way():
    ops = parlab.run(_traced_layer, 2, 2, trace=True, echo=False).trace
    labels = [e.label for e in ops.events if e.op == "all_to_all" and e.rank == 0]
    assert labels == ["ep counts", "ep dispatch", "ep combine", "ep combine backward", "ep dispatch backward"]


def _uneven(world):
    expert_parallel(torch.nn.Sequential(MoE(8, 12, experts=3)))


def _meta_shards():
    from parlab.parallel.meta_init import materialize
    model = materialize(expert_parallel(GPT(CFG, seed=0, device="meta")), "cpu")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, list(local_experts(CFG.experts))


def test_experts_built_on_the_meta_device_draw_their_own_share_of_the_dense_values():
    """A lab builds on the meta device and materialises only what the rank keeps (parlab.parallel.meta_init):
    each EP rank's experts are its rows of the dense (E, ...) weights, the rest of the model the dense one."""
    dense = GPT(CFG, seed=0).state_dict()
    for state, mine in parlab.run(_meta_shards, 2).results:
        for k, v in state.items():
            want = dense[k][mine[0]:mine[-1] + 1] if is_expert_param(k) else dense[k]
            assert torch.equal(v, want), k


def test_experts_that_do_not_split_over_the_group_are_refused():
    with pytest.raises(Exception, match="3 experts do not split over an expert-parallel group of 2 ranks"):
        parlab.run(_uneven, 2, 2, echo=False)


def test_the_trace_records_who_sent_how_many_bytes_to_whom():
    """Event.splits of the dispatch: the bytes for each EP rank (a float32 row of H = 8 is 32 bytes); wire bytes
    leave out the block a rank keeps; the counts exchange is even (E/ep int64 counts to each rank)."""
    tr = parlab.run(_traced_layer, 2, 2, trace=True, echo=False).trace
    for r in (0, 1):
        ev = {e.label: e for e in tr.events if e.op == "all_to_all" and e.rank == r}
        counts, sent = ev["ep counts"], ev["ep dispatch"]
        assert counts.splits == (16, 16)                                      # 2 experts x 8 bytes, each rank
        assert sum(sent.splits) == sent.nbytes and all(b % 32 == 0 for b in sent.splits)
        assert sent.wire_bytes == sent.nbytes - sent.splits[r]
    dispatch = {e.rank: e.splits for e in tr.events if e.label == "ep dispatch"}
    combine = {e.rank: e.splits for e in tr.events if e.label == "ep combine"}
    for r in (0, 1):                                  # combine returns to rank j what rank j dispatched here
        assert combine[r] == tuple(dispatch[j][r] for j in (0, 1))


def _ep_with_replicas_rank():
    """World 4: the dense layers data parallel over all 4 ranks, the experts over EP groups of 2, each expert
    replicated on the 2 ranks of its EDP group (ParallelGrid(4, ep=2): ep [0, 1] [2, 3], edp [0, 2] [1, 3])."""
    from parlab.parallel.groups import build_groups
    from parlab.parallel.topology import ParallelGrid
    pg = build_groups(ParallelGrid(4, ep=2), dims=("ep", "edp"))
    model = expert_parallel(GPT(CFG, seed=0, dtype=torch.float64), group=pg.ep)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    r, out = comm.get_rank(), []
    for s in range(STEPS):
        x, y = _batch(s, 4)
        _, loss = model(x[r * B_RANK:(r + 1) * B_RANK], y[r * B_RANK:(r + 1) * B_RANK])
        loss.backward()
        average_gradients(model, ep_group=pg.ep, edp_group=pg.edp)
        norm = float(grad_norm(model, ep_group=pg.ep))
        mean = loss.detach().clone()
        comm.all_reduce(mean, op=comm.ReduceOp.AVG)
        out.append((mean.item(), norm))
        opt.step()
        opt.zero_grad()
    return out, {k: v.clone() for k, v in model.state_dict().items()}, list(local_experts(CFG.experts, pg.ep))


def test_expert_replicas_average_over_their_edp_group_and_divide_by_ep():
    """Expert data parallel 2: an expert's gradient is averaged over its 2 replicas and divided by ep = 2, and the
    global norm sums the experts over the EP group only (the replicas hold the same values): one process's loss,
    norm and parameters after two AdamW steps."""
    ref_steps, ref_state = _reference(4, False)
    ranks = parlab.run(_ep_with_replicas_rank, 4, echo=False)
    for r, (steps, state, mine) in enumerate(ranks):
        assert mine == ([0, 1] if r in (0, 2) else [2, 3])                  # replicas: ranks 0, 2 and 1, 3
        for (loss, norm), (ref_loss, ref_norm, *_rest) in zip(steps, ref_steps):
            assert loss == pytest.approx(ref_loss, rel=TOL) and norm == pytest.approx(ref_norm, rel=TOL)
        for k, v in state.items():
            want = ref_state[k][mine[0]:mine[-1] + 1] if is_expert_param(k) else ref_state[k]
            torch.testing.assert_close(v, want, rtol=TOL, atol=TOL, msg=f"rank {r} parameter {k}")


# ---------------------------------------------------------------------- 5D: EP composed with DP, PP, CP (hybrid.py)
H_CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, n_embd=16, mlp_ratio=2, experts=4, top_k=2,
                  capacity_factor=1.0, aux_loss_coeff=0.1, z_loss_coeff=1e-3)
H_B = 8                                                  # global batch (rows)
H_LAYOUTS = [  # (pp, cp, ep, microbatches, free routing, ZeRO stage): dp = 4 / (pp cp)
    (2, 1, 2, 2, False, 0),   # PP x DP, EP over the dp ranks: routing groups dp x m = 4
    (1, 1, 2, 1, False, 0),   # DP 4, EP 2 x EDP 2
    (1, 2, 2, 1, False, 0),   # CP x DP, EP over a cp group: each cp rank routes its zigzag positions
    (1, 2, 2, 1, True, 0),    # the same without capacity or aux loss (routing per token)
    (1, 1, 2, 1, False, 1),   # ZeRO-1: dense states over the 4 dp ranks, each expert's over its 2 replicas
    (2, 1, 2, 2, False, 2),   # ZeRO-2 under PP: the experts have no replica (edp = 1)
]


def _h_config(free, layers=None):
    return GPTConfig(**{**H_CFG.__dict__, **({"capacity_factor": None, "aux_loss_coeff": 0.0, "z_loss_coeff": 0.0}
                                             if free else {}), **({"n_layer": layers} if layers else {})})


def _h_batch(step):
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randint(0, H_CFG.vocab_size, (H_B, H_CFG.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _hybrid_rank(pp, cp, ep, m, free, zero=0, schedule="1f1b", layers=None):
    from parlab.parallel.groups import build_groups
    from parlab.parallel.hybrid import build_hybrid
    from parlab.parallel.topology import ParallelGrid
    groups = build_groups(ParallelGrid(4, pp=pp, cp=cp, ep=ep))
    h = build_hybrid(GPT(_h_config(free, layers), seed=0, dtype=torch.float64), groups, microbatches=m, lr=LR,
                     zero_stage=zero, schedule=schedule)
    losses = [h.train_step(*_h_batch(s)).item() for s in range(STEPS)]
    return losses, {k: v.clone() for k, v in h.dense_state_dict().items()}, list(local_experts(H_CFG.experts, groups.ep))


@pytest.mark.parametrize("pp, cp, ep, m, free, zero", H_LAYOUTS,
                         ids=["pp2-dp2-ep2", "dp4-ep2-edp2", "cp2-dp2-ep2", "cp2-dp2-ep2-free", "dp4-ep2-edp2-zero1",
                              "pp2-dp2-ep2-zero2"])
def test_expert_parallel_composes_with_dp_pp_cp_zero_as_one_process(pp, cp, ep, m, free, zero):
    _check_as_one_process(pp, cp, ep, m, free, zero)


@pytest.mark.parametrize("schedule", ["zb-h1", "dualpipe-v"])
def test_zero_bubble_gives_the_expert_layers_their_weight_gradients_as_one_process(schedule):
    """ZB-H1 and DualPipeV split each backward into I and W, and W computes the gradients of the modules the
    executor recorded; the expert layers are put in after the pipeline is built (it recorded the dense MLPs), and
    went without any gradient, silently, until the executor recorded every module again at each step. DualPipeV
    (two stages a rank, V-shaped) needs 4 layers for its 4 stages."""
    from parlab.parallel.pipeline import dualpipe_v
    if schedule == "zb-h1":
        _check_as_one_process(2, 1, 2, 2, False, 0, "zb-h1")
    else:
        _check_as_one_process(2, 1, 2, 4, False, 0, dualpipe_v(2, 4), layers=4)


def _check_as_one_process(pp, cp, ep, m, free, zero, schedule="1f1b", layers=None):
    from parlab.parallel.hybrid import routing_groups
    from parlab.parallel.topology import ParallelGrid
    groups = routing_groups(ParallelGrid(4, pp=pp, cp=cp, ep=ep), H_CFG.seq_len, m)   # each rank's micro-batches
    ref = routed_as_ranks(GPT(_h_config(free, layers), seed=0, dtype=torch.float64), *groups)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    ref_losses = []
    for s in range(STEPS):
        _, loss = ref(*_h_batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    ref_state = ref.state_dict()
    for r, (losses, state, mine) in enumerate(parlab.run(_hybrid_rank, 4, pp, cp, ep, m, free, zero, schedule, layers,
                                                         echo=False)):
        assert losses == pytest.approx(ref_losses, rel=TOL), f"rank {r}"
        assert state and (not pp > 1 or len(state) < len(ref_state))          # a stage holds its part only
        for k, v in state.items():
            want = ref_state[k][mine[0]:mine[-1] + 1] if is_expert_param(k) else ref_state[k]
            torch.testing.assert_close(v, want, rtol=TOL, atol=TOL, msg=f"rank {r} parameter {k}")


def test_hybrid_refuses_what_expert_parallel_does_not_compose_with_yet():
    from parlab.parallel.hybrid import check_layout, make_schedule
    from parlab.parallel.topology import ParallelGrid
    one = make_schedule("1f1b", 1, 1)
    with pytest.raises(ValueError, match="give the model GPTConfig.experts=E. with E a multiple of 2"):
        check_layout(GPTConfig(), ParallelGrid(4, ep=2), one)
    with pytest.raises(ValueError, match=r"tensor parallelism \(tp=2\) needs sequence parallelism.*"
                                         r"pass sequence_parallel=True \(lab: --sp\)"):
        check_layout(GPTConfig(experts=4), ParallelGrid(4, tp=2, ep=2, etp=1), one)
    with pytest.raises(ValueError, match=r"composes here with etp=1 \(experts whole\) or etp=tp on the tp ranks "
                                         r"\(the default order\); got etp=2, tp=1"):
        check_layout(GPTConfig(experts=4), ParallelGrid(4, ep=2, etp=2), one)
    for etp in (1, 2):                                  # experts whole, or split over the tp group
        check_layout(GPTConfig(experts=4), ParallelGrid(4, tp=2, ep=2, etp=etp), one, sequence_parallel=True)
