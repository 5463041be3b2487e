"""Figures for lesson 03 (ZeRO and FSDP): model-state memory per rank, and gathered weights over time.

Fed by plain data (dicts of bytes, `parlab.parallel.zero.memory.gathered_timeline` points); never communicates.

    from parlab.parallel.zero import memory
    from parlab.viz.memory import memory_bars, gathered_figure, fit_curves

    cols = [dict(stage="ZeRO-1", source="rank 0", **memory.measure(model.parameters(), opt)),
            dict(stage="ZeRO-1", source="formula", **memory.model_state_bytes(psi, 4, 1, 4, 4, 8))]
    memory_bars(cols, unit=1e6, unit_name="MB")       # stacked params / grads / optimizer, grouped by stage
    gathered_figure(memory.gathered_timeline(res.trace, rank=0))    # FSDP: gathered bytes over time
    fit_curves(175e9, gpu_bytes=80e9)                 # GB per GPU against the DP size, one line per stage
"""
from __future__ import annotations

from typing import Iterable, Sequence

import plotly.graph_objects as go

from parlab.i18n import _
from parlab.parallel.zero import memory
from parlab.viz import style

__all__ = ["PART_COLORS", "memory_bars", "gathered_figure", "fit_curves"]

PARTS = ("params", "grads", "optimizer")
PART_COLORS = {"params": "#9ecae1", "grads": "#4292c6", "optimizer": "#08306b"}   # the compute blues, by depth


def _part_names() -> dict[str, str]:
    """What the legend calls each part, in the language in force."""
    return {"params": _("parameters"), "grads": _("gradients"), "optimizer": _("optimizer state")}


def memory_bars(columns: Sequence[dict], title: str | None = None, unit: float = 1e6, unit_name: str = "MB",
                limit: float | None = None, limit_text: str = "", totals: bool = False) -> go.Figure:
    """Stacked bars of params / grads / optimizer bytes; one bar per column, grouped by ``column['stage']``.

    columns     dicts with 'stage' (outer axis label), 'source' (inner label, e.g. 'rank 0', 'formula')
                and the byte counts 'params', 'grads', 'optimizer' (as `memory.measure` returns them)
    unit        bytes per plotted unit (1e6 -> MB, 1e9 -> GB)
    limit       optional horizontal line (in bytes), e.g. one GPU's memory
    totals      write each column's total above it (for a few wide columns: a bar 60x shorter than its
                neighbour is invisible on a projector, its number is not)"""
    if not columns:
        raise ValueError("memory_bars needs at least one column of byte counts")
    for c in columns:
        missing = [k for k in ("stage", "source", *PARTS) if k not in c]
        if missing:
            raise ValueError(f"column {c!r} lacks {missing}; give 'stage', 'source', 'params', 'grads', 'optimizer'")
    x = [[c["stage"] for c in columns], [c["source"] for c in columns]]     # two-level category axis
    names = _part_names()
    fig = go.Figure()
    for part in PARTS:
        ys = [c[part] / unit for c in columns]
        hover = [_("<b>{stage}, {source}</b><br>{part}: {value:.3f} {unit}<br>total: {total:.3f} {unit}").format(
                     stage=c["stage"], source=c["source"], part=names[part], value=c[part] / unit, unit=unit_name,
                     total=sum(c[p] for p in PARTS) / unit) for c in columns]
        top = totals and part == PARTS[-1]
        fig.add_trace(go.Bar(x=x, y=ys, name=names[part], marker_color=PART_COLORS[part], hovertext=hover,
                             hovertemplate="%{hovertext}<extra></extra>",
                             text=[f"{_number(sum(c[p] for p in PARTS) / unit)} {unit_name}" for c in columns] if top
                             else None, textposition="outside" if top else None, cliponaxis=False,
                             textfont=dict(size=13)))
    if limit is not None:
        fig.add_hline(y=limit / unit, line_dash="dash", line_color="#d62728", annotation_text=limit_text)
    fig.update_layout(barmode="stack", template="plotly_white", title=title, height=460,
                      yaxis_title=_("{unit} per rank").format(unit=unit_name))
    return fig


def _number(v: float) -> str:
    """2800.0 -> '2,800', 43.75 -> '43.8', 0.0312 -> '0.0312': three significant digits, never 2.8e+03."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def gathered_figure(points: Iterable[dict], title: str | None = None, full_bytes: float | None = None,
                    unit: float = 1e6, unit_name: str = "MB") -> go.Figure:
    """Bytes of gathered (unsharded) weights over time: a step line through the marks FSDP leaves
    (`parlab.parallel.zero.memory.gathered_timeline`), each point labelled 'gathered blocks.0', 'freed blocks.0', ...
    `full_bytes` draws the whole model's weights as a reference line."""
    pts = list(points)
    if not pts:
        fig = go.Figure()
        fig.add_annotation(text=_("no 'unsharded_bytes' marks in this trace: wrap the model in "
                                  "FullyShardedDataParallel and run with trace=True"), showarrow=False)
        fig.update_layout(title=title, xaxis_visible=False, yaxis_visible=False)
        return fig
    t = [p["t"] * 1e3 for p in pts]
    y = [p["bytes"] / unit for p in pts]
    colours = [style.COLLECTIVE_COLORS["all_gather"] if "gathered" in p["label"] else "#7f7f7f" for p in pts]
    fig = go.Figure(go.Scatter(
        x=t, y=y, mode="lines+markers", line_shape="hv", name="gathered weights",
        marker=dict(size=8, color=colours), hovertext=[f"{p['label']}: {p['bytes'] / unit:.3f} {unit_name}"
                                                       for p in pts],
        hovertemplate="%{hovertext}<br>t = %{x:.1f} ms<extra></extra>"))
    if full_bytes is not None:
        fig.add_hline(y=full_bytes / unit, line_dash="dash", annotation_text=_("whole model, unsharded"))
    fig.update_layout(template="plotly_white", title=title, height=380,
                      xaxis_title=_("time (ms) since the trace start"),
                      yaxis_title=_("gathered weights ({unit})").format(unit=unit_name), showlegend=False)
    return fig


def fit_curves(psi: float, gpu_bytes: float = 80e9, nds: Sequence[int] = tuple(2 ** k for k in range(11)),
               param_bytes: float = 2, grad_bytes: float = 2, k: float = 12, title: str | None = None,
               mark_nd: int | None = None) -> go.Figure:
    """GB of model states per GPU against the DP size, one line per stage, with the GPU's memory as a line."""
    fig = go.Figure()
    lowest = gpu_bytes / 1e9
    for stage, name in memory.STAGES.items():
        ys = [memory.model_state_bytes(psi, nd, stage, param_bytes, grad_bytes, k)["total"] / 1e9 for nd in nds]
        lowest = min(lowest, *ys)
        fig.add_trace(go.Scatter(x=list(nds), y=ys, mode="lines+markers", name=name))
    # lines as traces, not shapes: a shape on a log axis would take log10 coordinates
    fig.add_trace(go.Scatter(x=[nds[0], nds[-1]], y=[gpu_bytes / 1e9] * 2, mode="lines",
                             name=_("one {gb:g} GB GPU").format(gb=gpu_bytes / 1e9),
                             line=dict(dash="dash", color="#d62728")))
    if mark_nd is not None:
        top = memory.model_state_bytes(psi, 1, 0, param_bytes, grad_bytes, k)["total"] / 1e9
        fig.add_trace(go.Scatter(x=[mark_nd, mark_nd], y=[lowest, top], mode="lines", name=f"Nd = {mark_nd}",
                                 line=dict(dash="dot", color="#7f7f7f")))
    fig.update_layout(template="plotly_white", title=title, height=400,
                      xaxis=dict(type="log", title=_("DP size Nd"), minorloglabels="none"),
                      yaxis=dict(type="log", title=_("GB of model states per GPU"), minorloglabels="none"))
    return fig
