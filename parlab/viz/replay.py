"""Timelines of a run as measured here and as replayed on a virtual cluster, with a toggle between them.

`toggle(measured, replayed)` draws both traces (`parlab.viz.timeline.timeline`) in one figure with two buttons,
"this machine" and "replayed on <hardware>"; each keeps its own time unit and axis. `replay_toggle(trace,
hardware)` replays the trace first (`parlab.replay.replay`). Plotly graph_objects only; nothing communicates.
"""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from ..replay import replay, step_time
from .timeline import as_trace, timeline

__all__ = ["toggle", "replay_toggle", "pick_unit"]


def pick_unit(seconds: float) -> str:
    """The time unit that shows a span of `seconds` with readable numbers."""
    return "s" if seconds >= 1 else "ms" if seconds >= 1e-3 else "us"


def toggle(measured: Any, replayed: Any, title: str | None = None, labels: tuple[str, str] | None = None,
           show_labels: bool = False, start: int = 1) -> go.Figure:
    """One figure, two views: the measured trace and the replayed one (`start`: 0 or 1, the view shown first)."""
    a, b = as_trace(measured), as_trace(replayed)
    if start not in (0, 1):
        raise ValueError(f"start must be 0 (measured) or 1 (replayed), got {start!r}")
    names = labels or ("this machine", f"replayed on {b.hardware or 'a model'}")
    views = []
    for tr, name in ((a, names[0]), (b, names[1])):
        unit = pick_unit(step_time(tr))
        fig = timeline(tr, title=None, time_unit=unit, show_labels=show_labels)
        views.append((fig, unit, f"{title + ': ' if title else ''}{name}, step {step_time(tr) * 1e3:.3g} ms"))
    out = go.Figure()
    counts = []
    for i, (fig, _, _) in enumerate(views):
        for t in fig.data:
            t.visible = i == start
            t.legendgroup = f"{i}-{t.legendgroup}"
            out.add_trace(t)
        counts.append(len(fig.data))
    layout = views[start][0].layout
    # both views' legends share the figure, and the buttons take 20 px more of the top than a timeline does
    height = max(fig.layout.height for fig, _, _ in views) + 20
    out.update_layout(template="plotly_white", barmode="overlay", hovermode="closest", height=height,
                      yaxis=layout.yaxis, xaxis=layout.xaxis, legend=layout.legend,
                      # the title on the top line, the buttons on their own line under it: long labels never meet
                      title=dict(text=views[start][2], x=0.015, xanchor="left", y=1.0, yref="container", yanchor="top",
                                 pad=dict(t=12)),
                      margin=dict(t=120))
    buttons = []
    for i, (fig, unit, text) in enumerate(views):
        visible = [j == i for j, n in enumerate(counts) for _ in range(n)]
        buttons.append(dict(label=names[i], method="update",
                            args=[{"visible": visible},
                                  {"title.text": text, "xaxis.title.text": f"time ({unit}) since the first event",
                                   "xaxis.autorange": True}]))
    out.update_layout(updatemenus=[dict(type="buttons", direction="right", buttons=buttons, active=start,
                                        x=0.0, xanchor="left", y=1.02, yanchor="bottom")])
    return out


def replay_toggle(trace: Any, hardware, title: str | None = None, show_labels: bool = False, **replay_kw) -> go.Figure:
    """Replay `trace` on `hardware` (keyword arguments go to `parlab.replay.replay`) and `toggle` the two."""
    tr = as_trace(trace)
    return toggle(tr, replay(tr, hardware, **replay_kw), title=title, show_labels=show_labels)
