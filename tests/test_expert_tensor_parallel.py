"""Expert parallelism composed with tensor parallelism (parlab.parallel.hybrid, issue 41): 5D layouts on 8 ranks
against one process.

As in Megatron-Core, MoE with TP needs sequence parallelism: each tp rank's MoE layer routes its own
(b, S/(cp tp), H) tokens and dispatches them over the expert grid's ep group (which, with MoE folding, may be
its tp group); the experts are whole on their ep ranks (etp = 1) or split over the tp group (etp = tp: rows
gathered over etp after dispatch, partial outputs reduce-scattered before combine). The one-process model routes the same token
groups (`routing_groups`: dp x m row blocks x each cp rank's zigzag positions cut in tp chunks), so capacity,
dropping and the load-balancing loss are per rank on both sides. Compared over two AdamW steps: the loss, every
parameter's gradient (gathered over tp; a rank's experts against their slice) and the parameters after the
steps; with a capacity factor below 1 (tokens dropped) and, in one layout, an ep rank that receives no token.
The gradient scale is the point: the router's gradient summed over tp like the layer norms', the experts'
averaged over their edp replicas and divided by ep etp / tp, the aux losses' gradient weighed 1/(m tp).
"""
import pytest
import torch

import parlab
from parlab.models import GPT, GPTConfig, moe_layers
from parlab.parallel.expert import is_expert_param, local_experts, routed_as_ranks

from test_expert_parallel import _starve_last_rank

# float64: the layouts change only the order of sums (all-to-all and gathers move rows, the reductions add the
# same terms in another order), ~1e-16 relative, which two AdamW steps amplify far below this
TOL = 1e-10
CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, n_embd=16, mlp_ratio=2, experts=4, top_k=2,
                capacity_factor=0.75, aux_loss_coeff=0.1, z_loss_coeff=1e-3)
B, STEPS, LR = 8, 2, 1e-2
LAYOUTS = {  # id: (tp, cp, pp, ep, etp, microbatches, ZeRO stage, starve): dp = 8 / (tp cp pp),
    # edp = 8 / (etp ep pp)
    "tp2-pp2-dp2-ep2-starved": (2, 1, 2, 2, 1, 2, 0, True),   # ep group = tp group; ep rank 1 gets no token
    "tp2-cp2-pp2-ep4": (2, 2, 2, 4, 1, 2, 0, False),          # ep group spans tp x cp, zigzag positions
    "tp2-cp2-dp2-ep4-zero1": (2, 2, 1, 4, 1, 1, 1, False),    # edp 2; ZeRO-1 over dp-cp and over edp
    "tp2-dp4-no-ep": (2, 1, 1, 1, 1, 1, 0, False),            # experts whole on every rank: summed over tp as SP
    "tp2-pp2-dp2-ep2-etp2": (2, 1, 2, 2, 2, 2, 0, False),     # experts split over the tp group, edp 1
    "tp2-cp2-dp2-ep2-etp2-zero1-starved": (2, 2, 1, 2, 2, 1, 1, True),   # etp x ep over dp, cp; edp 2
}


def _grid(tp, cp, pp, ep, etp):
    from parlab.parallel.topology import ParallelGrid
    return ParallelGrid(8, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)


def _batch(step):
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(0, CFG.vocab_size, (B, CFG.seq_len), generator=g)   # (B, S)
    return x, torch.roll(x, -1, dims=1)


def _model(starve):
    model = GPT(CFG, seed=0, dtype=torch.float64)
    if starve:
        _starve_last_rank(model, 2)                 # every token to experts 0, 1: ep rank 0 of ep = 2
    return model


def _rank(tp, cp, pp, ep, etp, m, zero, starve):
    from parlab.parallel.groups import build_groups
    from parlab.parallel.hybrid import build_hybrid
    from parlab.parallel.tensor import dense_grads
    groups = build_groups(_grid(tp, cp, pp, ep, etp))
    h = build_hybrid(_model(starve), groups, microbatches=m, sequence_parallel=True, zero_stage=zero, lr=LR)
    steps = []
    for s in range(STEPS):                          # train_step, with the gradients looked at before the step
        h.optimizer.zero_grad(set_to_none=True)
        loss = h.forward_backward(*_batch(s))
        grads = {} if zero else dense_grads(h.module, groups.tp)   # (ZeRO reduces them inside its step)
        h.optimizer.step()
        steps.append((loss.item(), grads))
    if ep == 1:                                     # every expert on every rank
        return steps, h.dense_state_dict(), list(range(CFG.experts)), 0
    return steps, h.dense_state_dict(), list(local_experts(CFG.experts, groups.ep)), groups.local_rank("ep")


def _reference(grid, m, starve):
    from parlab.parallel.hybrid import routing_groups
    model = routed_as_ranks(_model(starve), *routing_groups(grid, CFG.seq_len, m, sequence_parallel=True))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    steps, dropped = [], 0
    for s in range(STEPS):
        _, loss = model(*_batch(s))
        loss.backward()
        steps.append((loss.item(), {k: p.grad.clone() for k, p in model.named_parameters(remove_duplicate=False)}))
        dropped += sum(int((~moe.routing.keep).sum()) for moe in moe_layers(model))
        opt.step()
        opt.zero_grad()
    return steps, model.state_dict(), dropped


def _mine(k, v, experts):
    return v[experts[0]:experts[-1] + 1] if is_expert_param(k) else v


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_and_tensor_parallel_5d_layout_matches_one_process(layout):
    tp, cp, pp, ep, etp, m, zero, starve = LAYOUTS[layout]
    ref_steps, ref_state, dropped = _reference(_grid(tp, cp, pp, ep, etp), m, starve)
    assert dropped > 0                                                      # capacity 0.75 dropped tokens
    for r, (steps, state, experts, ep_rank) in enumerate(parlab.run(_rank, 8, *LAYOUTS[layout], echo=False)):
        for s, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(steps, ref_steps)):
            assert loss == pytest.approx(ref_loss, rel=TOL), f"rank {r} step {s}"
            assert bool(grads) != bool(zero)
            for k, g in grads.items():
                torch.testing.assert_close(g, _mine(k, ref_grads[k], experts), rtol=TOL, atol=TOL,
                                           msg=f"rank {r} step {s} grad {k}")
                if starve and is_expert_param(k) and ep_rank == 1:
                    assert not g.any(), f"rank {r} {k}: its experts got no token"
        assert state and (pp == 1 or len(state) < len(ref_state))           # a stage holds its part only
        for k, v in state.items():
            torch.testing.assert_close(v, _mine(k, ref_state[k], experts), rtol=TOL, atol=TOL,
                                       msg=f"rank {r} parameter {k}")
