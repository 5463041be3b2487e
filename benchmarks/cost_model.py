"""The cost model against the papers: Korthikanti et al. table 2 (activation memory per layer) for the four table 3
models, table 5's MFU and HFU recomputed from its published step times, and table 5's eight step times replayed.

    python benchmarks/cost_model.py            # markdown tables for benchmarks/README.md
    python benchmarks/cost_model.py --no-replay    # tables 2 and 5 only (a fraction of a second)

Pure arithmetic (parlab.cluster.transformer, published, pipeline_program, scaleup): the numbers do not depend on
the machine; the replay's own run time (last column) does.
"""
from __future__ import annotations

import argparse
import time

from parlab.cluster import transformer as T
from parlab.cluster.hardware import hardware_preset
from parlab.cluster.published import CALCULON_TABLE5, KORTHIKANTI, KORTHIKANTI_MODELS, SELENE_PEAK_FLOPS
from parlab.cluster.replay import step_time
from parlab.cluster.scaleup import planner_estimate, scaleup

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
            kept = T.activation_bytes_per_layer(model, 1, tp or t, sp, rc, attention="materialised")  # as in 2022
            cells.append(f"{kept / 2**20:,.0f}")
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


def planner_step(run, hw) -> float:
    return planner_estimate(run.model, hw, run.replay_inputs()[1], run.layout["global_batch"]).step_s


def table5_replay() -> str:
    """Table 5's step times replayed on the DGX A100 preset from programs built from the paper's schedules, with
    each first-principles factor switched off in turn, Calculon's estimates and the planner's beside them."""
    a100 = hardware_preset("dgx-a100")
    variants = {"replay": a100, "no waves": a100.with_(sms=None), "NVLink at 300 GB/s": a100.with_(intra_efficiency=1.0),
                "neither (before)": a100.with_(sms=None, intra_efficiency=1.0)}
    lines = ["| run | published | replay | without waves | NVLink at 300 GB/s | neither | Calculon | planner | "
             "replay run time |", "|---|---|---|---|---|---|---|---|---|"]
    errs = {k: [] for k in (*variants, "Calculon", "planner")}
    for run in KORTHIKANTI:
        schedule, layout = run.replay_inputs()
        cells = []
        for name, hw in variants.items():
            t0 = time.perf_counter()
            t = step_time(scaleup(schedule, run.model, hw, layout))
            if name == "replay":
                secs = time.perf_counter() - t0
            errs[name].append(t / run.step_s - 1)
            cells.append(f"{t:.2f} ({t / run.step_s - 1:+.1%})")
        calc = CALCULON_TABLE5[run.model_name][0 if run.recompute == "full" else 1]
        plan = planner_step(run, a100)
        errs["Calculon"].append(calc / run.step_s - 1)
        errs["planner"].append(plan / run.step_s - 1)
        v = f", v {layout.virtual}" if layout.virtual > 1 else ""
        lines.append(f"| {run.label} (tp {layout.tp} pp {layout.pp}{v}) | {run.step_s:g} | " + " | ".join(cells)
                     + f" | {calc:.2f} ({calc / run.step_s - 1:+.1%}) | {plan:.2f} ({plan / run.step_s - 1:+.1%}) | "
                     f"{secs:.1f} s |")
    mean = {k: sum(map(abs, v)) / len(v) for k, v in errs.items()}
    worst = {k: max(map(abs, v)) for k, v in errs.items()}
    lines.append("| mean / max abs error | | " + " | ".join(f"{100 * mean[k]:.1f}% / {100 * worst[k]:.1f}%"
                                                       for k in (*variants, "Calculon", "planner")) + " | |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Korthikanti et al. tables 2 and 5 from parlab's cost model "
                                             "(markdown tables for benchmarks/README.md)")
    ap.add_argument("--no-replay", action="store_true", help="skip replaying table 5's step times (~1 minute)")
    args = ap.parse_args()
    print("Activation memory per layer, micro-batch 1, MiB (16-bit):\n")
    print(table2())
    print("\nKorthikanti et al. table 5, utilisation from the published step times (A100 peak 312 TFLOP/s):\n")
    print(table5())
    if not args.no_replay:
        print("\nKorthikanti et al. table 5, step times (s) replayed on the DGX A100 preset from built programs:\n")
        print(table5_replay())
