"""The planner as figures: every candidate layout's memory per GPU against its step time, and where the time goes.

`planner_figure(estimates, cluster)` draws one marker per layout that `parlab.cluster.planner.enumerate_layouts`
returned: x = memory of the fullest GPU (GB), y = estimated step time (s), both on log axes. Filled markers
fit the GPU's usable memory, open crosses do not; the colour says the tensor-parallel size (and whether its
groups leave a node). A dashed vertical line marks the usable memory, a star the planner's best layout, and
optional `marks` (e.g. a published layout) get their own labelled symbol. Hovering a marker shows the
layout and its memory and time split.

`breakdown_figure(ranked)` stacks the step time of the first layouts of `parlab.cluster.planner.plan` into its
terms (compute, bubble, TP, CP, exposed DP, PP), so "why is the best one best" becomes visible.

Example::

    from parlab.cluster.costs import Cluster, model_preset
    from parlab.cluster.planner import enumerate_layouts, plan
    from parlab.viz.planner import planner_figure, breakdown_figure
    gpt3, cluster = model_preset("gpt3-175b"), Cluster(nodes=128)      # Megatron's 1024 A100s
    every = enumerate_layouts(gpt3, cluster, 1536)
    planner_figure(every, cluster, marks={"Megatron (t=8, p=8)": dict(tp=8, pp=8)})
    breakdown_figure(plan(gpt3, cluster, 1536), top=8)

Plotly graph_objects only; pure (never communicates).
"""
from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.colors import qualitative

from parlab.i18n import _

__all__ = ["planner_figure", "breakdown_figure", "TERMS", "terms"]

GB = 1e9
#: step-time terms of `parlab.cluster.planner.Estimate`, in the order they are stacked, with their colours
TERMS = (("compute_s", "compute", "#4c78a8"), ("bubble_s", "pipeline bubble", "#bab0ac"),
         ("tp_s", "TP all-reduces", "#e45756"), ("cp_s", "CP ring", "#b279a2"),
         ("dp_s", "DP (exposed)", "#54a24b"), ("pp_s", "PP send/recv", "#eeca3b"))


def terms() -> tuple[tuple[str, str, str], ...]:
    """`TERMS` with their names in the language in force (what a legend shows)."""
    names = {"compute": _("compute"), "pipeline bubble": _("pipeline bubble"), "TP all-reduces": _("TP all-reduces"),
             "CP ring": _("CP ring"), "DP (exposed)": _("DP (exposed)"), "PP send/recv": _("PP send/recv")}
    return tuple((attr, names.get(name, name), colour) for attr, name, colour in TERMS)


def _hover(e) -> str:
    states = e.params_bytes + e.grads_bytes + e.optimizer_bytes
    where = ", ".join(_("{dim} crosses nodes").format(dim=d) for d in ("tp", "cp", "dp", "pp")
                      if e.crosses[d] and e.volume[d])
    return (_("<b>{layout}</b><br>memory {memory:.1f} GB = states {states:.1f} + activations {activations:.1f} + "
              "buffers {buffers:.1f}<br>step {step:.2f} s = compute {compute:.2f} + bubble {bubble:.2f} + TP {tp:.2f} "
              "+ CP {cp:.2f} + DP {dp:.2f} + PP {pp:.2f}<br>{tflops:.0f} TFLOP/s per GPU").format(
                layout=e.layout, memory=e.total_bytes / GB, states=states / GB, activations=e.activation_bytes / GB,
                buffers=e.buffer_bytes / GB, step=e.step_s, compute=e.compute_s, bubble=e.bubble_s, tp=e.tp_s,
                cp=e.cp_s, dp=e.dp_s, pp=e.pp_s, tflops=e.achieved_tflops)
            + (f"<br>{where}" if where else "")
            + ("" if e.fits else "<br>" + _("<b>does not fit</b>: {reason}").format(reason=e.reason)))


def _matches(e, spec: dict) -> bool:
    return all(getattr(e, k) == v for k, v in spec.items())


def _ticks_125(values) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... covering `values` (positive), one step beyond each end; 1, 2, 3, ..., 9 steps
    when fewer than two of those fall inside the values' range."""
    lo, hi = min(values), max(values)
    for mantissas in ((1, 2, 5), tuple(range(1, 10))):
        ticks, k = [], math.floor(math.log10(lo)) - 1
        while not ticks or ticks[-1] < hi:
            ticks += [m * 10.0 ** k for m in mantissas]
            k += 1
        i = max(j for j, t in enumerate(ticks) if t <= lo)
        j = min(j for j, t in enumerate(ticks) if t >= hi)
        if sum(lo <= t <= hi for t in ticks) >= 2:
            break
    return [float(f"{t:.6g}") for t in ticks[i:j + 1]]


def planner_figure(estimates, cluster=None, marks: dict | None = None, title: str | None = None) -> go.Figure:
    """Memory per GPU (x) vs step time (y) of every layout in `estimates`; fitting ones filled, the rest open.

    `cluster` (a `parlab.cluster.costs.Cluster`) draws its usable memory as a line; `marks` maps a label to a dict of
    Estimate fields (e.g. ``{"Megatron": dict(tp=8, pp=8)}``): the fastest fitting estimate that matches is
    ringed and labelled. The fastest fitting layout overall gets a star."""
    estimates = list(estimates)
    if not estimates:
        raise ValueError("planner_figure needs at least one Estimate (from parlab.cluster.planner.enumerate_layouts)")
    fig = go.Figure()
    tps = sorted({e.tp for e in estimates})
    colors = {tp: qualitative.D3[i % len(qualitative.D3)] for i, tp in enumerate(tps)}
    for tp in tps:
        for fits in (True, False):
            group = [e for e in estimates if e.tp == tp and e.fits == fits]
            if not group:
                continue
            crosses = any(e.crosses["tp"] for e in group if e.tp > 1)
            name = ("tp={tp}" if fits else _("tp={tp}: does not fit")) if not crosses else \
                _("tp={tp} (crosses nodes)") if fits else _("tp={tp} (crosses nodes): does not fit")
            fig.add_trace(go.Scatter(
                x=[e.total_bytes / GB for e in group], y=[e.step_s for e in group], mode="markers",
                name=name.format(tp=tp),
                legendgroup=f"tp{tp}",
                marker=dict(color=colors[tp], size=8 if fits else 7, opacity=0.8 if fits else 0.45,
                            symbol="circle" if fits else "x-thin-open", line=dict(width=1.5, color=colors[tp])),
                hovertext=[_hover(e) for e in group], hovertemplate="%{hovertext}<extra></extra>"))
    fitting = [e for e in estimates if e.fits]
    if cluster is not None:
        # a shape on a log axis takes the data value, an annotation its log10 (plotly), so the two are added
        # separately: add_vline's own annotation_text would sit at 10^76 and stretch the axis to it
        fig.add_vline(x=cluster.mem_bytes / GB, line=dict(color="#333", dash="dash"))
        fig.add_annotation(x=math.log10(cluster.mem_bytes / GB), y=1, yref="paper", xanchor="right",
                           yanchor="bottom", showarrow=False,
                           text=_("usable {usable:.0f} GB of {gpu:g} GB").format(usable=cluster.mem_bytes / GB,
                                                                                 gpu=cluster.gpu_mem_gb))
    if fitting:
        best = min(fitting, key=lambda e: (e.step_s, e.total_bytes))
        fig.add_trace(go.Scatter(x=[best.total_bytes / GB], y=[best.step_s], mode="markers",
                                 name=_("best: {layout}").format(layout=best.layout),
                                 marker=dict(symbol="star", size=18, color="gold",
                                                                          line=dict(color="black", width=1)),
                                 hovertext=[_hover(best)], hovertemplate="%{hovertext}<extra></extra>"))
    for i, (label, spec) in enumerate((marks or {}).items()):
        found = sorted((e for e in estimates if _matches(e, spec)), key=lambda e: (not e.fits, e.step_s))
        if not found:
            raise ValueError(f"mark {label!r}: no estimate has {spec}")
        e = found[0]
        fig.add_trace(go.Scatter(x=[e.total_bytes / GB], y=[e.step_s], mode="markers+text", text=[label],
                                 textposition="bottom left", name=f"{label}: {e.layout}",   # off the memory line
                                 marker=dict(symbol="circle-open", size=22, color="black", line=dict(width=2.5)),
                                 hovertext=[_hover(e)], hovertemplate="%{hovertext}<extra></extra>"))
    n_fit = len(fitting)
    fig.update_layout(
        title=title or _("{n} candidate layouts, {fit} fit: memory per GPU vs step time").format(n=len(estimates),
                                                                                               fit=n_fit),
        xaxis=dict(title=_("memory of the fullest GPU (GB, log)"), type="log", minorloglabels="none"),
        # plotly's minor log labels are single digits ("2" for 20 s between 10 and 100), which a student reads
        # as 2 s: label 1-2-5 steps in full instead
        yaxis=dict(title=_("estimated step time (s, log)"), type="log", minorloglabels="none",
                   tickvals=_ticks_125([e.step_s for e in estimates])),
        # tall enough for the legend (a row per trace, a gap per tp group), which would scroll otherwise
        template="plotly_white", height=max(520, 220 + 21 * len(fig.data) + 10 * len(tps)),
        legend=dict(title=_("tensor parallel size")), hovermode="closest")
    return fig


def breakdown_figure(ranked, top: int = 8, title: str | None = None) -> go.Figure:
    """Stacked bars: each term of the step time for the first `top` layouts of `ranked` (fastest first)."""
    rows = list(ranked)[:top]
    if not rows:
        raise ValueError("breakdown_figure needs at least one Estimate (from parlab.cluster.planner.plan)")
    names = [f"{i}. {e.layout}" for i, e in enumerate(rows, 1)]
    fig = go.Figure([go.Bar(y=names, x=[getattr(e, attr) for e in rows], name=label, orientation="h",
                            marker_color=color, hovertemplate=f"{label}: %{{x:.2f}} s<extra></extra>")
                     for attr, label, color in terms()])
    fig.update_layout(barmode="stack", title=title or _("Where the step time goes: the {n} fastest layouts").format(
                          n=len(rows)),
                      xaxis_title=_("seconds per step"), yaxis=dict(autorange="reversed"), template="plotly_white",
                      height=max(300, 140 + 34 * len(rows)), legend=dict(title=_("term")))
    return fig
