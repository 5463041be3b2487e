"""A pipeline step in closed form: the planner's reading of the same costs the replay runs.

`parlab.cluster.scaleup` replays a program step by step; `step_terms(costs, m, schedule)` adds up the same
`parlab.cluster.step_costs.StepCosts` in a few terms, so the planner (`parlab.cluster.planner.estimate(...,
hardware=...)`) can rank thousands of layouts in a second and still agree with the replay: within 0.4% on
Korthikanti et al.'s eight runs, 0.1-0.2% for GPipe and ZB-H1 (benchmarks/README.md; tests/test_pipeline_program.py).
What it leaves out is the exact order of each rank's steps in the fill and drain.

    [1] D. Narayanan et al., SC 2021, arXiv:2104.04473, section 2.2 (1F1B, interleaved: the bubble (p - 1)/v).
    [2] P. Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:2401.10241, section 3 (ZB-H1).
Pure Python: no torch.
"""
from __future__ import annotations

__all__ = ["step_terms"]


def step_terms(costs, m: int, schedule: str = "1f1b") -> dict[str, float]:
    """The step of `schedule` over m micro-batches in closed form, from `costs` (a `StepCosts`): rank r holds
    stages r, r + pp, ...; per micro-batch it works W_r = its forwards + backwards.

        compute + tp  m x max_r W_r            the slowest rank sets the steady state (the last, with the logits)
        bubble        1f1b, gpipe: (pp - 1) / v x mean_r W_r   fill and drain, pp - 1 chunk-times of F + B
                      zb-h1: (pp - 1) x mean_r (F_r + B_input,r - W_r)   the weight gradients fill the drain
                      (Qi et al., arXiv:2401.10241, section 3: (p - 1)(T_F + T_B - T_W))
        pp            2 (pp v - 1) messages      the first micro-batch's activations through every stage
                                                boundary forward, the last one's gradients backward
        dp            ZeRO-2/3's exposed traffic per micro-batch (m x, in the slowest rank's work) + max_r the
                      exposed end-of-step sync; Adam of the rank's stages is the "optimizer" term
        ("dp_traffic", not in the step: the data-parallel traffic before any overlap)

    "1f1b" is interleaved when the layout has virtual > 1. tp and cp are the exposed TP and CP communication
    inside the slowest rank's work (`comm_part`), compute the rest."""
    if schedule not in ("1f1b", "gpipe", "zb-h1"):
        raise ValueError(f"no closed form for schedule {schedule!r}; known: 1f1b (interleaved with virtual > "
                         f"1), gpipe, zb-h1")
    pp, v = costs.layout.pp, costs.layout.virtual
    held = [[s for s in range(costs.stages) if s % pp == r] for r in range(pp)]
    per = lambda op, st: sum(costs.action(op, s) for s in st)              # noqa: E731
    work = [per("forward", st) + per("backward", st) for st in held]
    tp = [sum(costs.comm_part(op, s, ("tp",)) for s in st for op in ("forward", "backward")) for st in held]
    cp = [sum(costs.comm_part(op, s, ("cp",)) for s in st for op in ("forward", "backward")) for st in held]
    zp = [sum(costs.zero_part(op, s) for s in st for op in ("forward", "backward")) for st in held]
    slow = max(range(pp), key=lambda r: work[r])
    if schedule == "zb-h1":
        fill = sum(per("forward", st) + per("backward_input", st) - per("backward_weight", st)
                   for st in held) / pp * (pp - 1)
    else:
        fill = (pp - 1) / v * sum(work) / pp
    terms = {"compute": m * (work[slow] - tp[slow] - cp[slow] - zp[slow]), "tp": m * tp[slow], "cp": m * cp[slow],
             "bubble": fill,
             "pp": 2 * (costs.stages - 1) * costs.message() if pp > 1 else 0.0,
             "dp": m * zp[slow] + max(costs.exposed_grad_sync(st) for st in held),
             "optimizer": max(costs.sync.optimizer(st) for st in held)}
    terms["step"] = sum(terms.values())
    # not part of the step: the data-parallel traffic before overlap, of the rank that moves the most
    terms["dp_traffic"] = max(m * sum(costs.sync.zero_traffic(op, s) for s in st for op in ("forward", "backward"))
                              + costs.sync.grad_sync(st) for st in held)
    return terms
