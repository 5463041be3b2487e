"""Figures of tensor parallelism (lesson 04): block matrices, Megatron's f/g diagram, memory and time per layer.

Plotly only; every function takes plain data (tensors or lists returned by the ranks of a run, numbers
counted from a trace) and never communicates.

* `split_matmul`: Y = X W as heatmaps, with the blocks each rank holds outlined in the rank's colour, then
  every rank's own output Y_r and the result (column split: Y = [Y_0 | Y_1 | ...]; row split:
  Y = Y_0 + Y_1 + ...).
* `megatron_diagram`: one lane per rank through the MLP (column then row) or attention (heads split), with
  f and g marked and what the run's trace recorded for them.
* `memory_per_rank`: parameter bytes per rank against tp, measured vs the ideal 1/tp.
* `layer_time`: communication time of one layer at intra- vs inter-node bandwidth, next to its compute time.
"""
from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from parlab.i18n import _
from parlab.viz import style

__all__ = ["RANK_COLORS", "rank_color", "split_matmul", "megatron_diagram", "memory_per_rank", "layer_time"]

RANK_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#e377c2", "#8c564b")


def rank_color(r: int) -> str:
    return RANK_COLORS[r % len(RANK_COLORS)]


def _rows(m) -> list[list[float]]:
    return m.tolist() if hasattr(m, "tolist") else [list(r) for r in m]


def _outline(fig, row0, row1, col0, col1, color, panel, text=None, dash=None):
    """A rectangle around cells [row0, row1) x [col0, col1) of heatmap panel `panel` (1-based)."""
    fig.add_shape(type="rect", x0=col0 - 0.5, x1=col1 - 0.5, y0=row0 - 0.5, y1=row1 - 0.5,
                  line=dict(color=color, width=4, dash=dash), row=1, col=panel)
    if text:         # under the panel (its y axis is reversed: row1 - 0.5 is the bottom edge), off the titles
        fig.add_annotation(x=(col0 + col1 - 1) / 2, y=row1 - 0.5, text=text, showarrow=False, yanchor="top",
                           yshift=-3, font=dict(color=color, size=12), row=1, col=panel)


def split_matmul(x, w, outs: Sequence, y, split: str, title: str | None = None) -> go.Figure:
    """Y = X W drawn as heatmaps: X (s, h), W (h, h'), each rank's output, Y (s, h').

    split="column": rank r holds columns r of W and computes Y_r = X W_r, a (s, h'/tp) slice of Y.
    split="row": rank r holds rows r of W and the matching columns X_r of X and computes the partial
    sum Y_r = X_r W_r (s, h'); Y is their sum (an all-reduce)."""
    if split not in ("column", "row"):
        raise ValueError(f"split={split!r}: choose 'column' or 'row'")
    x, w, y, outs = _rows(x), _rows(w), _rows(y), [_rows(o) for o in outs]
    tp, s, h, hp = len(outs), len(x), len(w), len(w[0])
    widths = [h, hp] + [len(o[0]) for o in outs] + [hp]
    # two short lines per panel: the panels are narrow (8 of them in a notebook's width at tp=4)
    names = ([_("X<br>(every rank)") if split == "column" else _("X<br>by columns"),
              _("W<br>by columns") if split == "column" else _("W<br>by rows")]
             + [f"rank {r}<br>X W_{r}" if split == "column" else f"rank {r}<br>X_{r} W_{r}" for r in range(tp)]
             + [_("Y = [Y_0|..]<br>(concat)") if split == "column" else "Y = Σ Y_r<br>(all-reduce)"])
    fig = make_subplots(rows=1, cols=len(widths), column_widths=widths, subplot_titles=names,
                        horizontal_spacing=0.035)
    for a in fig.layout.annotations:
        a.font = dict(size=13)
    lim = max(abs(v) for m in [x, w, y] + outs for row in m for v in row) or 1.0
    for k, m in enumerate([x, w] + outs + [y], start=1):
        fig.add_trace(go.Heatmap(z=m, zmin=-lim, zmax=lim, colorscale="RdBu", showscale=k == 1,
                                 hovertemplate=_("row %{y}, col %{x}: %{z:.3f}<extra></extra>")), row=1, col=k)
        fig.update_yaxes(autorange="reversed", showticklabels=False, row=1, col=k)
        fig.update_xaxes(showticklabels=False, row=1, col=k)
    for r in range(tp):            # blocks of 2 columns or fewer are too narrow for "X_3": only the rank's number
        c = rank_color(r)
        if split == "column":
            b = hp // tp
            _outline(fig, 0, h, r * b, (r + 1) * b, c, 2, f"W_{r}" if b > 2 else str(r))
            _outline(fig, 0, s, r * b, (r + 1) * b, c, len(widths), f"Y_{r}" if b > 2 else str(r))
        else:
            b = h // tp
            _outline(fig, 0, s, r * b, (r + 1) * b, c, 1, f"X_{r}" if b > 2 else str(r))
            _outline(fig, r * b, (r + 1) * b, 0, hp, c, 2)
        _outline(fig, 0, s, 0, len(outs[r][0]), c, 3 + r)
    if split == "column":
        _outline(fig, 0, s, 0, h, "#7f7f7f", 1, dash="dot")
    else:                        # W's row blocks named by tick labels in their rank's colour
        fig.update_yaxes(showticklabels=True, tickvals=[(k + 0.5) * (h // tp) - 0.5 for k in range(tp)],
                         ticktext=[f"<span style='color:{rank_color(k)}'>W_{k}</span>" for k in range(tp)],
                         tickfont=dict(size=12), row=1, col=2)
    fig.update_layout(title=title, height=360, template="plotly_white", margin=dict(t=110, l=30, r=20, b=40))
    return fig


_KINDS = ("mlp", "attention")


def _lanes(kind: str) -> tuple[str, str, str]:
    """The three labels of a rank's lane through `kind` (templates of the rank r and its heads)."""
    if kind == "mlp":
        return ("X A_{r}", "GELU", "· B_{r}")
    return (_("Q,K,V<br>heads {heads}"), "softmax<br>(QKᵀ/√d) V", "· O_{r}")   # two short lines per label


def megatron_diagram(kind: str, tp: int, f_note: str = "", g_note: str = "", heads: Sequence[str] | None = None,
                     title: str | None = None) -> go.Figure:
    """The Megatron split of the MLP (A by columns, B by rows) or of attention (heads split; QKV by
    columns, output projection O by rows): X -> f -> one lane per rank -> g -> Y.
    `f_note` / `g_note`: what the run recorded for f and g; `heads[r]`: the heads rank r holds."""
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r}: choose one of {sorted(_KINDS)}")
    fig = go.Figure()
    lane_y = [(tp - 1) / 2 - r for r in range(tp)]
    steps = _lanes(kind)
    for r, yy in enumerate(lane_y):
        texts = [t.format(r=r, heads=heads[r] if heads else "") for t in steps]
        xs = [2, 3, 4]
        fig.add_trace(go.Scatter(x=[1] + xs + [5], y=[0] + [yy] * 3 + [0], mode="lines",
                                 line=dict(color=rank_color(r), width=2), hoverinfo="skip", showlegend=False))
        fig.add_trace(go.Scatter(x=xs, y=[yy] * 3, mode="markers+text", text=texts, textposition="top center",
                                 marker=dict(size=26, symbol="square", color=rank_color(r)),
                                 name=f"rank {r}", hoverinfo="text", hovertext=texts))
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 0], mode="lines", line=dict(color="grey"), showlegend=False))
    fig.add_trace(go.Scatter(x=[5, 6], y=[0, 0], mode="lines", line=dict(color="grey"), showlegend=False))
    ar = style.COLLECTIVE_COLORS["all_reduce"]
    fig.add_trace(go.Scatter(x=[0, 6], y=[0, 0], mode="markers+text", text=["X", "Y"], textposition="top center",
                             marker=dict(size=26, color="lightgrey", symbol="square"), showlegend=False))
    fig.add_trace(go.Scatter(
        x=[1, 5], y=[0, 0], mode="markers+text", marker=dict(size=44, color=ar, symbol="circle"),
        text=["<b>f</b>", "<b>g</b>"], textfont=dict(color="white", size=16), textposition="middle center",
        name="f / g (all-reduce)", hoverinfo="text",
        hovertext=[_("f: forward identity, backward all-reduce"), _("g: forward all-reduce, backward identity")]))
    bottom = min(lane_y) - 0.8
    for x_, head, note in ((1, _("f: fwd identity<br>bwd all-reduce"), f_note),
                           (5, _("g: fwd all-reduce<br>bwd identity"), g_note)):
        fig.add_annotation(x=x_, y=bottom, text=head + (f"<br><i>{note}</i>" if note else ""), showarrow=False,
                           font=dict(color=ar, size=11))
    fig.update_layout(title=title, height=220 + 100 * tp, template="plotly_white",   # room for two-line labels
                      xaxis=dict(visible=False, range=[-0.5, 6.5]),
                      yaxis=dict(visible=False, range=[bottom - 0.6, max(lane_y) + 1.0]))
    return fig


def memory_per_rank(tps: Sequence[int], measured: Sequence[float], dense: float, replicated: Sequence[float] = (),
                    title: str | None = None) -> go.Figure:
    """Parameter bytes held by one rank vs tp: measured, the ideal dense/tp, and (optionally) the replicated
    part that does not shrink (layer norms, row-parallel biases, position table)."""
    fig = go.Figure([
        go.Scatter(x=list(tps), y=[dense / t / 1e3 for t in tps], name=_("ideal: dense / tp"),
                   line=dict(dash="dash")),
        go.Scatter(x=list(tps), y=[m / 1e3 for m in measured], mode="lines+markers", marker_size=10,
                   name=_("measured on rank 0")),
    ])
    if replicated:
        fig.add_trace(go.Bar(x=list(tps), y=[b / 1e3 for b in replicated], name=_("of which replicated"),
                             opacity=0.4))
    fig.update_layout(title=title, xaxis=dict(title="tp", tickvals=list(tps)), yaxis_title=_("parameter kB per rank"),
                      height=380, template="plotly_white")
    return fig


def layer_time(rows: Sequence[dict], title: str | None = None) -> go.Figure:
    """Grouped bars, one group per row: {"name": ..., "compute_ms": ..., "intra_ms": ..., "inter_ms": ...}."""
    names = [r["name"] for r in rows]
    fig = go.Figure([
        go.Bar(x=names, y=[r["compute_ms"] for r in rows], name=_("compute"), marker_color=style.color("compute",
                                                                                                       "forward")),
        go.Bar(x=names, y=[r["intra_ms"] for r in rows], name=_("TP comm inside a node (NVLink)"),
               marker_color="#2ca02c"),
        go.Bar(x=names, y=[r["inter_ms"] for r in rows], name=_("TP comm across nodes"), marker_color="#d62728"),
    ])
    fig.update_layout(title=title, barmode="group", yaxis_title=_("ms per layer (forward + backward)"), height=400,
                      template="plotly_white")
    return fig
