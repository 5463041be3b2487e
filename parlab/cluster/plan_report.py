"""The planner's answers as text: the ranked table, the volume table and why the best layout is best.

`format_table(estimates)` prints `parlab.cluster.planner.Estimate`s as a fixed-width table (memory split, time split,
step time, model TFLOP/s per GPU); `format_volume_table(rows)` the bytes per GPU and step along each dimension
(`planner.volume_table`); `explain(ranked, every)` says, for tp, pp, dp, the ZeRO stage, recomputation and the
micro-batch, what the best layout with another value would cost and which term makes the difference. Pure text
formatting of estimates: it computes nothing (``parlab plan`` prints all three).
"""
from __future__ import annotations

__all__ = ["explain", "format_table", "format_volume_table", "DIMS", "GB", "RC_MARK"]

GB = 1e9
DIMS = ("tp", "cp", "dp", "pp")
RC_MARK = {"none": "n", "selective": "s", "full": "y"}      # the table's rc column


def _dominant(a, b) -> str:
    """The cost term that differs most between two estimates, as words."""
    terms = {"bubble_s": "pipeline bubble", "tp_s": "TP communication", "dp_s": "exposed DP communication",
             "pp_s": "PP communication", "cp_s": "CP communication", "compute_s": "compute (recomputation)"}
    k = max(terms, key=lambda k: abs(getattr(b, k) - getattr(a, k)))
    return f"{terms[k]} {getattr(b, k):.2f} s vs {getattr(a, k):.2f} s"


def explain(ranked: list, every: list | None = None, gpus_per_node: int | None = None) -> str:
    """Why the first layout of `ranked` has its tp, pp, dp (and the rest): the best alternative for each."""
    top = ranked[0]
    every = every or ranked
    lines = [f"Best: {top.layout}: {top.step_s:.2f} s/step, {top.total_bytes / GB:.1f} GB per GPU, "
             f"{top.achieved_tflops:.0f} TFLOP/s per GPU."]
    size = {"tp": top.tp, "cp": top.cp, "dp": top.dp, "pp": top.pp}
    where = {d: "no group" if size[d] == 1 else "crosses nodes" if top.crosses[d] else "inside a node" for d in DIMS}
    lines.append(f"  tp={top.tp} ({where['tp']}), pp={top.pp} ({where['pp']}), dp={top.dp} ({where['dp']}); "
                 f"per GPU and step TP sends {top.volume['tp'] / GB:.1f} GB, DP {top.volume['dp'] / GB:.1f} GB, "
                 f"PP {top.volume['pp'] / GB:.2f} GB.")
    for dim, attr in (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("ZeRO stage", "zero"),
                      ("recomputation", "recompute"), ("micro-batch", "micro_batch")):
        others = [e for e in every if getattr(e, attr) != getattr(top, attr)]
        fitting = [e for e in others if e.fits]
        if fitting:
            alt = min(fitting, key=lambda e: (e.step_s, e.total_bytes))
            if alt.step_s - top.step_s < 0.005 * top.step_s:
                lines.append(f"  {dim}={getattr(top, attr)} or {getattr(alt, attr)}: a tie within 0.5% "
                             f"({alt.layout}: {alt.step_s:.2f} s, {alt.total_bytes / GB:.1f} GB): closer than this "
                             f"model can tell apart; either is a sound choice.")
                continue
            lines.append(f"  {dim}={getattr(top, attr)} rather than {getattr(alt, attr)}: the best such layout "
                         f"({alt.layout}) takes {alt.step_s:.2f} s (+{100 * (alt.step_s / top.step_s - 1):.0f}%), "
                         f"mostly {_dominant(top, alt)}.")
        elif others:
            alt = min(others, key=lambda e: e.total_bytes)
            lines.append(f"  {dim}={getattr(top, attr)}: no layout with another {dim} fits "
                         f"(smallest {alt.layout} {alt.reason}).")
    return "\n".join(lines)


def format_table(estimates: list, top: int | None = 10) -> str:
    """A fixed-width text table: layout, memory split, time split, step time, throughput."""
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'v':>1} {'dp':>4} {'cp':>2} {'b':>2} {'m':>4} {'Z':>1} {'rc':>2} | "
            f"{'states':>7} {'act':>6} {'total GB':>8} | {'compute':>7} {'bubble':>6} {'TP':>6} {'DP':>6} "
            f"{'PP':>6} {'CP':>6} {'step s':>7} {'TF/GPU':>6} {'note':<4}")
    rows = [head, "-" * len(head)]
    for i, e in enumerate(estimates[:top] if top else estimates, 1):
        states = e.params_bytes + e.grads_bytes + e.optimizer_bytes
        x = {d: "*" if e.crosses[d] and e.volume[d] else " " for d in DIMS}
        rows.append(f"{i:>3} {e.tp:>3} {e.pp:>3} {e.virtual:>1} {e.dp:>4} {e.cp:>2} {e.micro_batch:>2} {e.micro_batches:>4} "
                    f"{e.zero:>1} {RC_MARK[e.recomputation]:>2} | {states / GB:>7.1f} "
                    f"{e.activation_bytes / GB:>6.1f} {e.total_bytes / GB:>8.1f} | {e.compute_s:>7.2f} "
                    f"{e.bubble_s:>6.2f} {e.tp_s:>5.2f}{x['tp']} {e.dp_s:>5.2f}{x['dp']} {e.pp_s:>5.2f}{x['pp']} "
                    f"{e.cp_s:>5.2f}{x['cp']} {e.step_s:>7.2f} {e.achieved_tflops:>6.0f} "
                    f"{'' if e.fits else 'NO: ' + e.reason}")
    rows.append("(times in s per step; * = that dimension's groups cross nodes; DP = exposed part)")
    return "\n".join(rows)


def format_volume_table(rows: list[dict]) -> str:
    out = [f"{'dim':<4} {'size':>4} {'GB/GPU/step':>12} {'link':<10} what"]
    for r in rows:
        link = "-" if r["size"] == 1 else "inter-node" if r["crosses_nodes"] else "intra-node"
        out.append(f"{r['dim']:<4} {r['size']:>4} {r['bytes'] / GB:>12.3f} {link:<10} {r['what']}")
    return "\n".join(out)
