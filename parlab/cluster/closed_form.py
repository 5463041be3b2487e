"""A pipeline step in closed form: the planner's reading of the same costs the replay runs.

`parlab.cluster.scaleup` replays a program step by step; `step_terms(costs, m, schedule)` adds up the same
`parlab.cluster.step_costs.StepCosts` in a few terms, so the planner (`parlab.cluster.planner.enumerate_layouts`)
can rank thousands of layouts in a second and still come close to the replay: within 0.4% on Korthikanti et al.'s
eight runs, 0.1-0.2% for GPipe and ZB-H1 (benchmarks/README.md; tests/test_pipeline_program.py). What it leaves
out is the exact order of each rank's steps in the fill and drain, the waits of a steady state whose ranks differ,
and the receives a rank posts only just before it needs them (the transfer then starts late): on small models
whose last stage (the logits) is far slower than the others, or whose MoE layers alternate slow and fast ranks, it
is off by up to 2.5% (1F1B; 3.2% MoE), 3.8% (GPipe), 6.8% (ZB-H1) and 11% (interleaved, ZeRO-3) at m = p and 2p
(300 random layouts, tests/test_cost_model_property.py). With `simulate` the bubble is instead what the schedule
run action by action leaves (`parlab.cluster.pipeline_time.simulated_step` minus the other terms), and the step is
the replay's to float rounding: what `planner.estimate` gives for one layout.

    [1] D. Narayanan et al., SC 2021, arXiv:2104.04473, section 2.2 (1F1B, interleaved: the bubble (p - 1)/v).
    [2] P. Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:2401.10241, section 3 (ZB-H1).
Pure Python: no torch.
"""
from __future__ import annotations

from parlab.cluster.pipeline_time import simulated_step

__all__ = ["step_terms"]


def step_terms(costs, m: int, schedule: str = "1f1b", simulate: bool = False) -> dict[str, float]:
    """The step of `schedule` over m micro-batches in closed form, from `costs` (a `StepCosts`): rank r holds
    stages r, r + pp, ...; per micro-batch it works W_r = its forwards + backwards.

        compute + tp  m x max_r W_r            the slowest rank sets the steady state (the last, with the logits)
        bubble        1f1b, gpipe: (sum_r W_r - max_r W_r) / v   fill and drain: the first micro-batch's forward
                      through the other ranks, the last one's backward back (a flow shop's makespan, sum of the
                      stages + (m - 1) x the slowest; (pp - 1) / v x W when the ranks are alike)
                      zb-h1: sum_{r != slowest} (F_r + B_input,r) - min(m - 1, pp - 1) mean_r W_r   the weight
                      gradients still owed fill the drain (Qi et al., arXiv:2401.10241, section 3:
                      (p - 1)(T_F + T_B - T_W) when m >= p and the ranks are alike)
        pp            2 (pp v - 1) messages      the first micro-batch's activations through every stage
                                                boundary forward, the last one's gradients backward (+ the tied
                                                embedding's gradient exchange, both ways)
        dp            ZeRO-2/3's exposed traffic per micro-batch (m x, in the slowest rank's work) + max_r the
                      exposed end-of-step sync; Adam of the rank's stages is the "optimizer" term
        ("dp_traffic", not in the step: the data-parallel traffic before any overlap)

    simulate (pp > 1): bubble = `pipeline_time.simulated_step` - every other term, i.e. fill, drain and every
    wait of the schedule as the replay runs it (ZB-H1 then takes any W, also one longer than F + B_input).

    "1f1b" is interleaved when the layout has virtual > 1 (then m must be a multiple of pp and the layers of
    pp x v, as the schedule needs). ZB-H1's work is its F, B_input and W actions, each with what it overlaps. tp, cp
    and ep are the exposed TP, CP and expert-parallel communication inside the slowest rank's work (`comm_part`),
    compute the rest."""
    if schedule not in ("1f1b", "gpipe", "zb-h1"):
        raise ValueError(f"no closed form for schedule {schedule!r}; known: 1f1b (interleaved with virtual > "
                         f"1), gpipe, zb-h1")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m is the number of micro-batches, a positive integer, got {m!r}")
    pp, v = costs.layout.pp, costs.layout.virtual
    if v > 1 and (schedule != "1f1b" or m % pp or costs.model.layers % (pp * v)):
        raise ValueError(f"virtual={v} is interleaved 1F1B, which needs m divisible by pp and the layers by pp x v "
                         f"(here {schedule}, m {m}, pp {pp}, {costs.model.layers} layers); replay the schedule "
                         f"(parlab.cluster.scaleup) for anything else")
    held = [[s for s in range(costs.stages) if s % pp == r] for r in range(pp)]
    ops = ("forward", "backward_input", "backward_weight") if schedule == "zb-h1" else ("forward", "backward")
    per = lambda op, st: sum(costs.action(op, s) for s in st)              # noqa: E731
    work = [sum(per(op, st) for op in ops) for st in held]
    tp = [sum(costs.comm_part(op, s, ("tp",)) for s in st for op in ops) for st in held]
    cp = [sum(costs.comm_part(op, s, ("cp",)) for s in st for op in ops) for st in held]
    ep = [sum(costs.comm_part(op, s, ("ep",)) for s in st for op in ops) for st in held]
    zp = [sum(costs.zero_part(op, s) for s in st for op in ops) for st in held]
    slow = max(range(pp), key=lambda r: work[r])
    if schedule == "zb-h1" and not simulate and any(per("backward_weight", st) > per("forward", st) + per("backward_input", st)
                                   for st in held):
        raise ValueError("ZB-H1's closed form holds while a rank's weight-gradient work W is at most its F + "
                         "B_input; here the ZeRO-2/3 gradient traffic exposed after W makes it longer. Replay the "
                         "schedule instead (parlab.cluster.scaleup), or use 1f1b with this ZeRO stage")
    if schedule == "zb-h1":             # the drain is filled by the weight gradients still owed: min(m - 1, pp - 1)
        fill = (sum(per("forward", st) + per("backward_input", st) for r, st in enumerate(held) if r != slow)
                - min(m - 1, pp - 1) * sum(per("backward_weight", st) for st in held) / pp)
    else:
        fill = (sum(work) - work[slow]) / v
    # the messages: the first micro-batch's activations through every stage boundary, the last one's gradients
    # back; a tied head on another rank than the embedding exchanges its gradient once more (both ways, in turn)
    tied = costs.model.tied and (costs.stages - 1) % pp != 0
    chain = 2 * (costs.stages - 1) * costs.message() + (2 * costs.message(tied=True) if tied else 0.0)
    terms = {"compute": m * (work[slow] - tp[slow] - cp[slow] - ep[slow] - zp[slow]), "tp": m * tp[slow],
             "cp": m * cp[slow], "ep": m * ep[slow],
             "bubble": fill,
             "pp": chain if pp > 1 else 0.0,
             "dp": m * zp[slow] + max(costs.exposed_grad_sync(st, ops[-1]) for st in held),
             "optimizer": max(costs.sync.optimizer(st) for st in held)}
    if simulate and pp > 1:             # the schedule run action by action: the bubble is what the others leave
        terms["bubble"] = simulated_step(costs, m, schedule) - sum(t for k, t in terms.items() if k != "bubble")
    terms["step"] = sum(terms.values())
    # not part of the step: the data-parallel traffic before overlap, of the rank that moves the most
    terms["dp_traffic"] = max(m * sum(costs.sync.zero_traffic(op, s) for s in st for op in ops)
                              + costs.sync.grad_sync(st) for st in held)
    return terms
