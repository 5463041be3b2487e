"""Figures of lesson 09 (mixture of experts, expert parallelism): plotly only, fed by plain data and traces,
never communicates.

    expert_load({"name": counts, ...}, capacity)   tokens routed to each expert, one bar group per router
                                                   (balanced, skewed, ...), the capacity as a dashed line.
    all_to_all_matrix(trace, label)                who sent how much to whom in an all-to-all: a source rank x
                                                   destination rank heat map of the bytes each rank's traced
                                                   call recorded (`Event.splits`); the diagonal stays home.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

from parlab.i18n import _
from parlab.viz import style

__all__ = ["expert_load", "all_to_all_matrix", "split_matrix"]

_BAR_COLORS = ("#4c78a8", "#e45756", "#54a24b", "#b279a2")


def expert_load(loads: Mapping[str, Sequence[int]], capacity: int | None = None,
                title: str | None = None) -> go.Figure:
    """Grouped bars: for each router (key), the assignments each expert received; `capacity` as a dashed line
    (an expert keeps at most that many, the rest are dropped)."""
    fig = go.Figure()
    for k, (name, counts) in enumerate(loads.items()):
        fig.add_trace(go.Bar(x=[_("expert {expert}").format(expert=e) for e in range(len(counts))], y=list(counts),
                             name=name, marker_color=_BAR_COLORS[k % len(_BAR_COLORS)], text=list(counts),
                             textposition="outside",
                             hovertemplate="%{x}: %{y} " + _("tokens") + "<extra>" + name + "</extra>"))
    top = max(max(c) for c in loads.values())
    if capacity is not None:
        fig.add_hline(y=capacity, line_dash="dash", line_color="#444", layer="below")   # under the bars and their numbers
        # labelled in the right margin: inside the plot it would sit on a bar's number
        fig.add_annotation(xref="paper", x=1.0, xanchor="left", y=capacity, showarrow=False,
                           text=_("capacity {capacity}").format(capacity=capacity))
        top = max(top, capacity)
    fig.update_layout(title=title or _("tokens routed to each expert"), barmode="group", template="plotly_white",
                      yaxis=dict(title=_("tokens (assignments)"), range=[0, top * 1.25]), height=380,
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0),
                      margin=dict(t=90, r=110))
    return fig


def split_matrix(trace, label: str) -> list[list[int]]:
    """[src][dst] bytes of the all-to-all calls labelled `label` in `trace` (summed if there are several), from
    each call's recorded per-rank bytes; the group's order is the ranks' order."""
    calls = [e for e in trace.events if e.op == "all_to_all" and e.label == label and e.splits]
    if not calls:
        raise ValueError(f"no traced all-to-all labelled {label!r} with per-rank bytes: run with trace=True "
                         f"(labels here: {sorted({e.label for e in trace.events if e.op == 'all_to_all'})})")
    group = calls[0].group
    m = [[0] * len(group) for _r in group]
    for e in calls:
        src = group.index(e.rank)
        for dst, b in enumerate(e.splits):
            m[src][dst] += b
    return m


def all_to_all_matrix(trace, label: str = "ep dispatch", title: str | None = None) -> go.Figure:
    """Heat map of the bytes each rank sent to each rank in the all-to-all calls labelled `label` (rows:
    senders, columns: receivers), each cell annotated; each row's total on the right."""
    m = split_matrix(trace, label)
    n = len(m)
    text = [[style.human_bytes(v) for v in row] for row in m]
    fig = go.Figure(go.Heatmap(z=m, x=[_("to rank {rank}").format(rank=r) for r in range(n)],
                               y=[_("rank {rank}").format(rank=r) for r in range(n)], colorscale="Blues",
                               text=text, texttemplate="%{text}", xgap=2, ygap=2,
                               colorbar=dict(title=_("bytes")),
                               hovertemplate="%{y} → %{x}: %{text}<extra></extra>"))
    for r, row in enumerate(m):
        fig.add_annotation(x=n - 0.5 + 0.08, y=r, xanchor="left", showarrow=False,
                           text=_("sent {sent}").format(sent=style.human_bytes(sum(row) - row[r])))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(range=[-0.5, n + 0.6], side="top")
    fig.update_layout(title=title or _("all-to-all '{label}': bytes from each rank (row) to each rank "
                                       "(column)").format(label=style.event_label(label)),
                      template="plotly_white", height=160 + 60 * n, margin=dict(t=110))
    return fig
