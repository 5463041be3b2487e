"""Figures for lesson 08 (training at scale): the communication wall, the memory hierarchy behind super-linear
speed-up, a loss curve that survives a dead rank, and the pipeline bubble below the micro-batch rule.

    from parlab.viz import scale as vs
    vs.speedup_figure({1: 1.0, 2: 1.7, 4: 2.1}, title="measured")           # speed-up and ideal vs ranks
    vs.working_set_figure(sizes, ns_per_element, caches={"L2": 2**20})     # time per element vs bytes
    vs.resume_figure(reference, {"crashed run": {0: 4.1, 1: 3.9}}, crash_step=7, checkpoint_step=4)
    vs.bubble_vs_microbatches([1, 2, 4, 8], bubbles, busy, stages=4)        # the m >= p rule

Inputs are plain numbers (measured by the lesson or computed by `parlab.cluster.planner` / `parlab.parallel.pipeline`); these
functions only draw. Plotly graph_objects only; never communicates.

References: speed-up and efficiency as in seed 002 (total speed ~ single-device speed x devices x speed-up);
pipeline bubble (p-1)/(m+p-1) from GPipe (Huang et al., arXiv:1811.06965) and 1F1B (Narayanan et al.,
arXiv:2006.09503); the micro-batch rule m >= p from MindSpore's `mindspore.parallel.Pipeline` (seed 003).
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import plotly.graph_objects as go

from parlab.i18n import _

__all__ = ["speedup_figure", "iec_bytes", "working_set_figure", "resume_figure", "bubble_vs_microbatches", "link_seconds_bars"]

_IDEAL = dict(color="#888888", dash="dash")


def speedup_figure(curves: Mapping[str, Mapping[int, float]], title: str | None = None, log: bool = False,
                   xaxis_title: str | None = None) -> go.Figure:
    """Speed-up (time on 1 / time on N) against N for each named curve, with the ideal speed-up N dashed.
    The ideal line spans the curves' N only, so the axes stay within the data. `xaxis_title` defaults to
    "ranks (devices)"."""
    ns = sorted({n for c in curves.values() for n in c})
    fig = go.Figure(go.Scatter(x=ns, y=ns, mode="lines", line=_IDEAL, name=_("ideal: speed-up = N")))
    for name, c in curves.items():
        xs = sorted(c)
        fig.add_scatter(x=xs, y=[c[n] for n in xs], mode="lines+markers", name=name,
                        hovertemplate=_("N = %{x}<br>speed-up %{y:.2f}") + "<extra>" + name + "</extra>")
    kind = "log" if log else "linear"
    fig.update_layout(title=title, xaxis=dict(title=_("ranks (devices)") if xaxis_title is None else xaxis_title,
                                              type=kind, tickvals=ns),
                      yaxis=dict(title=_("speed-up (time on 1 / time on N)"), type=kind), height=420,
                      xaxis_minorloglabels="none", yaxis_minorloglabels="none",
                      template="plotly_white", legend=dict(orientation="h", y=-0.25))
    return fig


def iec_bytes(n: float) -> str:
    """2**20 -> '1 MiB', 3 * 2**19 -> '1.5 MiB': powers of 1024, for sizes that are powers of two (caches, the
    working sets measured against them); SI bytes ('MB' = 10^6) stay the rule everywhere else."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def working_set_figure(sizes_bytes: Sequence[float], ns_per_element: Sequence[float],
                       caches: Mapping[str, float] | None = None, title: str | None = None) -> go.Figure:
    """Measured time per element of a streaming operation against its working set, log x labelled at the
    measured sizes in KiB/MiB (they are powers of two, as caches are); dotted vertical lines at the cache sizes
    that lie inside the measured range."""
    fig = go.Figure(go.Scatter(x=list(sizes_bytes), y=list(ns_per_element), mode="lines+markers",
                               name=_("measured"), text=[iec_bytes(b) for b in sizes_bytes],
                               hovertemplate=_("%{text}: %{y:.3f} ns/element<extra></extra>")))
    lo, hi = min(sizes_bytes), max(sizes_bytes)
    for name, nbytes in (caches or {}).items():
        if lo <= nbytes <= hi:
            fig.add_vline(x=nbytes, line=dict(color="#888888", dash="dot"))
            # an annotation on a log axis takes log10 of its position (add_vline's own label would not)
            fig.add_annotation(x=math.log10(nbytes), y=1, yref="paper", yanchor="bottom", text=name,
                               showarrow=False)
    fig.update_layout(title=title, xaxis=dict(title=_("working set (KiB, MiB: powers of 1024)"), type="log",
                                              tickvals=list(sizes_bytes),
                                              ticktext=[iec_bytes(b) for b in sizes_bytes]),
                      yaxis=dict(title=_("ns per element"), rangemode="tozero"), height=400,
                      template="plotly_white", showlegend=False, margin=dict(t=90))
    return fig


def resume_figure(reference: Sequence[float], runs: Mapping[str, Mapping[int, float]], crash_step: int,
                  checkpoint_step: int, title: str | None = None) -> go.Figure:
    """Loss per step: the uninterrupted reference as a thick grey line, each run (step -> loss) on top, and
    where the crash happened and which checkpoint the runs resumed from."""
    steps = list(range(len(reference)))
    fig = go.Figure(go.Scatter(x=steps, y=list(reference), mode="lines", name=_("uninterrupted"),
                               line=dict(color="#bbbbbb", width=8)))
    symbols = ("circle", "x", "diamond", "square")
    for i, (name, losses) in enumerate(runs.items()):
        xs = sorted(losses)
        fig.add_scatter(x=xs, y=[losses[t] for t in xs], mode="lines+markers", name=name,
                        marker=dict(symbol=symbols[i % len(symbols)], size=max(6, 14 - 3 * i)))
    fig.add_vline(x=crash_step - 0.5, line=dict(color="#d62728", dash="dash"), annotation_text=_("a rank dies"),
                  annotation_position="top right")
    fig.add_vline(x=checkpoint_step - 0.5, line=dict(color="#2ca02c", dash="dot"),
                  annotation_text=_("last checkpoint"), annotation_position="top left")
    fig.update_layout(title=title, xaxis=dict(title=_("step"), range=[-0.5, len(reference) - 0.5], dtick=1),
                      yaxis_title=_("loss (mean over ranks)"), height=430, template="plotly_white",
                      legend=dict(orientation="h", y=-0.25), margin=dict(t=90))
    return fig


def bubble_vs_microbatches(ms: Sequence[int], bubble: Sequence[float], busy_at_most: Sequence[int], stages: int,
                           title: str | None = None) -> go.Figure:
    """Bubble fraction of the step (bars) and the most stages ever busy at once (line, right axis) against the
    number of micro-batches m; bars with m < stages are red (the rule m >= p is broken)."""
    colors = ["#d62728" if m < stages else "#4c78a8" for m in ms]
    fig = go.Figure(go.Bar(x=[str(m) for m in ms], y=list(bubble), marker_color=colors,
                           name=_("idle fraction (red: m < p)"),   # the swatch takes the first bar's colour
                           text=[f"{b:.0%}" for b in bubble], textposition="outside"))
    fig.add_scatter(x=[str(m) for m in ms], y=list(busy_at_most), mode="lines+markers", yaxis="y2",
                    name=_("most stages busy at once"), line=dict(color="#333333"))
    fig.update_layout(title=title, xaxis_title=_("micro-batches m (red: m < p = {stages})").format(stages=stages),
                      yaxis=dict(title=_("idle fraction of the step"), range=[0, 1.05], tickformat=".0%"),
                      yaxis2=dict(title=_("stages busy at once"), overlaying="y", side="right",
                                  range=[0, stages + 0.5], dtick=1),
                      height=420, template="plotly_white", legend=dict(orientation="h", y=-0.25),
                      margin=dict(t=80, r=80))
    return fig


def link_seconds_bars(rows: Sequence[Mapping], title: str | None = None) -> go.Figure:
    """Seconds per step each parallel dimension spends on its link: rows of {'dim', 'seconds', 'link'}."""
    fig = go.Figure(go.Bar(x=[r["dim"] for r in rows], y=[r["seconds"] for r in rows],
                           text=[r["link"] for r in rows], textposition="outside",
                           marker_color=["#e45756" if "inter" in r["link"] else "#4c78a8" for r in rows]))
    top = max((r["seconds"] for r in rows), default=1.0)
    fig.update_layout(title=title, xaxis_title=_("parallel dimension"),
                      yaxis=dict(title=_("seconds per step on the link"), range=[0, top * 1.25]), height=400,
                      template="plotly_white", showlegend=False,
                      margin=dict(t=80))
    return fig
