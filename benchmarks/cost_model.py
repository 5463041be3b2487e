"""The cost model against the papers: Korthikanti et al. table 2 (activation memory per layer) for the four table 3
models, and table 5's MFU and HFU recomputed from its published step times.

    python benchmarks/cost_model.py            # markdown tables for benchmarks/README.md

Pure arithmetic (parlab.cluster.transformer, parlab.cluster.published): it runs in a fraction of a second and its
numbers do not depend on the machine.
"""
from __future__ import annotations

import argparse

from parlab.cluster import transformer as T
from parlab.cluster.published import KORTHIKANTI, KORTHIKANTI_MODELS, SELENE_PEAK_FLOPS

ROWS = [("no parallelism", 1, False, "none", "sbh(34 + 5as/h)"),
        ("tensor parallel", None, False, "none", "sbh(10 + 24/t + 5as/ht)"),
        ("tensor + sequence parallel", None, True, "none", "sbh(34/t + 5as/ht)"),
        ("tensor parallel + selective", None, False, "selective", "sbh(10 + 24/t)"),
        ("tensor + sequence + selective", None, True, "selective", "sbh(34/t)"),
        ("full recomputation", None, False, "full", "sbh(2)")]


def table2() -> str:
    names = list(KORTHIKANTI_MODELS)
    lines = ["| row of table 2 | formula | " + " | ".join(f"{n} (t = {KORTHIKANTI_MODELS[n][1]})" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for label, tp, sp, rc, formula in ROWS:
        cells = []
        for n in names:
            model, t, *_ = KORTHIKANTI_MODELS[n]
            cells.append(f"{T.activation_bytes_per_layer(model, 1, tp or t, sp, rc) / 2**20:,.0f}")
        lines.append(f"| {label} | {formula} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table5() -> str:
    lines = ["| run | step (published) | MFU printed | MFU computed | HFU printed | HFU computed | 6ND-based MFU |",
             "|---|---|---|---|---|---|---|"]
    for run in KORTHIKANTI:
        lay = run.layout
        args = (run.model, lay["global_batch"], run.step_s, lay["gpus"], SELENE_PEAK_FLOPS)
        mfu, hfu = T.mfu(*args), T.hfu(*args, recompute=run.recompute)
        six = T.training_flops_6nd(run.model.param_count(), lay["global_batch"] * run.model.seq) / (
            run.step_s * lay["gpus"] * SELENE_PEAK_FLOPS)
        lines.append(f"| {run.label} | {run.step_s:g} s | {100 * run.mfu:.1f}% | {100 * mfu:.1f}% | "
                     f"{100 * run.hfu:.1f}% | {100 * hfu:.1f}% | {100 * six:.1f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    argparse.ArgumentParser(description="Korthikanti et al. tables 2 and 5 from parlab's cost model "
                                        "(markdown tables for benchmarks/README.md)").parse_args()
    print("Activation memory per layer, micro-batch 1, MiB (16-bit):\n")
    print(table2())
    print("\nKorthikanti et al. table 5, utilisation from the published step times (A100 peak 312 TFLOP/s):\n")
    print(table5())
