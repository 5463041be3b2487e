"""The cost model against published runs it was not built on (`parlab.cluster.validation.VALIDATION`): each run's
stated layout replayed on its GPU's preset, nothing fitted per row, and what each modelling factor changes.

    python benchmarks/validation.py            # markdown tables for benchmarks/README.md (a few minutes)
    python benchmarks/validation.py --planner  # the planner only, no replay (seconds)

The replay builds each run's 1F1B program from its schedule (`parlab.cluster.pipeline_program`) and re-times it
(`parlab.cluster.scaleup.compare`, which gives the planner beside it: the same schedule run under the replay's
rules, `parlab.cluster.pipeline_time`). The factor columns are the planner with one factor of the model switched
off: every network card of a group's GPUs used at once across nodes (off: one card per group, as before), the GEMMs'
waves of tiles (off: FLOPs at the kernel-level rate), and for runs that used one, the fused attention kernel (off:
materialised scores).
Pure arithmetic: the numbers do not depend on the machine; the run time does.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from parlab.cluster.hardware import Hardware, hardware_preset
from parlab.cluster.scaleup import compare, planner_estimate
from parlab.cluster.step_costs import Layout
from parlab.cluster.validation import NOT_EXPRESSED, VALIDATION


@dataclasses.dataclass(frozen=True)
class OneRail(Hardware):
    """The network as the model had it before: a group crossing nodes gets one card's share, however many of
    its GPUs sit on each node."""

    def inter_bandwidth(self, op: str, per_node: int) -> float:
        return super().inter_bandwidth("all_to_all", per_node)


def layout_of(run, **change) -> Layout:
    return dataclasses.replace(run.replay_inputs()[1], **change)


def planner_s(run, hw, layout) -> float:
    return planner_estimate(run.model, hw, layout, run.global_batch).step_s


def factors(run) -> dict[str, float]:
    hw = hardware_preset(run.hardware)
    lay = layout_of(run)
    out = {"one card per group": planner_s(run, OneRail(**hw.to_dict()), lay),
           "no waves": planner_s(run, hw.with_(sms=None), lay)}
    if run.attention == "fused":
        out["materialised attention"] = planner_s(run, hw, layout_of(run, attention="materialised"))
    return out


def table(replay: bool = True) -> str:
    cols = ["one card per group", "no waves", "materialised attention"]
    lines = ["| run | source, framework | GPUs | tp pp dp b m | measured step | replay | planner | "
             + " | ".join(cols) + " | replay run time |", "|---" * (8 + len(cols) + 1) + "|"]
    errs: dict[str, list[float]] = {k: [] for k in ("replay", "planner", *cols)}
    for run in VALIDATION:
        hw, lay = hardware_preset(run.hardware), layout_of(run)
        t0 = time.perf_counter()
        if replay:
            res = compare(run.replay_inputs()[0], run.model, hw, lay, run.global_batch)
            rep, plan = res["replay_s"], res["planner_s"]
        else:
            rep, plan = None, planner_s(run, hw, lay)
        secs = time.perf_counter() - t0
        cell = lambda t: f"{t:.2f} ({t / run.step_s - 1:+.0%})"          # noqa: E731
        f = factors(run)
        for k, t in (("replay", rep), ("planner", plan), *f.items()):
            if t is not None:
                errs[k].append(t / run.step_s - 1)
        lines.append(f"| {run.name} | {run.source}, {run.framework} | {run.gpus} | {run.tp} {run.pp} {run.dp} "
                     f"{run.micro_batch} {run.micro_batches} | {run.step_s:.2f} | "
                     f"{cell(rep) if rep is not None else '-'} | {cell(plan)} | "
                     + " | ".join(cell(f[c]) if c in f else "" for c in cols) + f" | {secs:.1f} s |")
    stat = lambda v: f"{100 * sum(map(abs, v)) / len(v):.1f}% / {100 * max(map(abs, v)):.1f}%" if v else ""  # noqa
    lines.append("| mean / max abs error | | | | | " + " | ".join(stat(errs[k]) for k in ("replay", "planner", *cols))
                 + " | |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the cost model against published runs beyond Korthikanti's table 5")
    ap.add_argument("--planner", action="store_true", help="the planner only, no replay (seconds)")
    args = ap.parse_args()
    print(table(replay=not args.planner))
    print("\nAssumed where the sources are silent (one rule per source):\n")
    for src in dict.fromkeys((r.source, r.framework, r.assumed) for r in VALIDATION):
        print(f"- {src[0]}, {src[1]}: {src[2]}.")
    print("\nPublished runs not replayed:\n")
    for k, v in NOT_EXPRESSED.items():
        print(f"- {k}: {v}.")
