"""Timelines of a run as measured here and as replayed on a virtual cluster, with a toggle between them.

`toggle(measured, replayed)` draws both traces (`parlab.viz.timeline.timeline`) in one figure with two buttons,
"this machine" and "replayed on <hardware>"; each keeps its own time unit and axis. `replay_toggle(trace,
hardware)` replays the trace first (`parlab.cluster.replay.replay`). `toggle_figures({name: figure})` does the same for
figures already drawn with one subplot layout (e.g. `parlab.viz.pipeline.schedules_figure` of measured and of
replayed runs). Plotly graph_objects only; nothing communicates.
"""
from __future__ import annotations

from typing import Any, Mapping

import plotly.graph_objects as go

from parlab.cluster.replay import replay, step_time
from parlab.i18n import _
from parlab.viz import style
from parlab.viz.timeline import as_trace, timeline

__all__ = ["toggle", "toggle_figures", "replay_toggle", "pick_unit"]

TOP = 136       # px above the plot: the title under plotly's toolbar (style.TOOLBAR_PX), then the buttons' row


def pick_unit(seconds: float) -> str:
    """The time unit that shows a span of `seconds` with readable numbers."""
    return "s" if seconds >= 1 else "ms" if seconds >= 1e-3 else "us"


def toggle(measured: Any, replayed: Any, title: str | None = None, labels: tuple[str, str] | None = None,
           show_labels: bool = False, start: int = 1) -> go.Figure:
    """One figure, two views: the measured trace and the replayed one (`start`: 0 or 1, the view shown first)."""
    a, b = as_trace(measured), as_trace(replayed)
    if start not in (0, 1):
        raise ValueError(f"start must be 0 (measured) or 1 (replayed), got {start!r}")
    names = labels or (_("this machine"), _("replayed on {hardware}").format(hardware=b.hardware) if b.hardware
                       else _("replayed on a model"))
    views = []
    for tr, name in ((a, names[0]), (b, names[1])):
        unit = pick_unit(step_time(tr))
        fig = timeline(tr, title=None, time_unit=unit, show_labels=show_labels)
        text = _("{title}: {name}, step {ms:.3g} ms") if title else _("{name}, step {ms:.3g} ms")
        views.append((fig, unit, text.format(title=title, name=name, ms=step_time(tr) * 1e3)))
    out = go.Figure()
    counts = []
    for i, (fig, _unit, _text) in enumerate(views):
        for t in fig.data:
            t.visible = i == start
            t.legendgroup = f"{i}-{t.legendgroup}"
            out.add_trace(t)
        counts.append(len(fig.data))
    layout = views[start][0].layout
    # both views' legends share the figure, and the buttons take 36 px more of the top than a timeline does
    height = max(fig.layout.height for fig, _unit, _text in views) + TOP - 100
    out.update_layout(template="plotly_white", barmode="overlay", hovermode="closest", height=height,
                      yaxis=layout.yaxis, xaxis=layout.xaxis, legend=layout.legend,
                      # the title on the top line (below plotly's toolbar), the buttons on their own line under it:
                      # long labels never meet
                      title=style.top_title(views[start][2], x=0.015, xanchor="left"), margin=dict(t=TOP))
    buttons = []
    for i, (fig, unit, text) in enumerate(views):
        visible = [j == i for j, n in enumerate(counts) for _k in range(n)]
        buttons.append(dict(label=names[i], method="update",
                            args=[{"visible": visible},
                                  {"title.text": text,
                                   "xaxis.title.text": _("time ({unit}) since the first event").format(unit=unit),
                                   "xaxis.autorange": True}]))
    out.update_layout(updatemenus=[dict(type="buttons", direction="right", buttons=buttons, active=start,
                                        x=0.0, xanchor="left", y=1.02, yanchor="bottom")])
    return out


def replay_toggle(trace: Any, hardware, title: str | None = None, show_labels: bool = False, **replay_kw) -> go.Figure:
    """Replay `trace` on `hardware` (keyword arguments go to `parlab.cluster.replay.replay`) and `toggle` the two."""
    tr = as_trace(trace)
    return toggle(tr, replay(tr, hardware, **replay_kw), title=title, show_labels=show_labels)


def toggle_figures(views: Mapping[str, go.Figure], start: int = 0) -> go.Figure:
    """One figure, one button per view: `views` maps a button's label to a figure, all drawn with the same subplot
    layout (the same panels); each view keeps its own title, x-axis titles and time range. Everything else of the
    layout (panel titles, y axes, the legend) is the first view's. The figures passed in are not changed."""
    names, figs = list(views), list(views.values())
    if len(figs) < 2:
        raise ValueError(f"toggle_figures needs at least two views, got {len(figs)}")
    if not 0 <= start < len(figs):
        raise ValueError(f"start must be the index of a view (0 to {len(figs) - 1}), got {start!r}")
    axes = [sorted(k for k in f.layout.to_plotly_json() if k.startswith(("xaxis", "yaxis"))) for f in figs]
    if any(a != axes[0] for a in axes):
        raise ValueError("the views have different subplot layouts (axes " + " vs ".join(map(str, axes)) + "); "
                         "draw them with the same panels")
    out = go.Figure(layout=figs[0].layout)
    counts = []
    for i, fig in enumerate(figs):
        for t in fig.data:
            out.add_trace(t.to_plotly_json() | {"visible": i == start,      # a copy: the caller's figure keeps its own
                                                "legendgroup": f"{i}-{t.legendgroup or t.name}"})
        counts.append(len(fig.data))
    height = max(f.layout.height or 450 for f in figs) + TOP - 80
    plot_px = height - TOP - (out.layout.margin.b if out.layout.margin.b is not None else 80)
    xaxes = [a for a in axes[0] if a.startswith("xaxis")]
    buttons = []
    for i, fig in enumerate(figs):
        visible = [j == i for j, n in enumerate(counts) for _k in range(n)]
        relayout = {"title.text": fig.layout.title.text or ""}
        for a in xaxes:
            relayout[f"{a}.title.text"] = fig.layout[a].title.text or ""
            relayout[f"{a}.autorange"] = True
        buttons.append(dict(label=names[i], method="update", args=[{"visible": visible}, relayout]))
    out.update_layout(height=height, margin=dict(t=TOP),
                      title=style.top_title(figs[start].layout.title.text, x=0.015, xanchor="left"),
                      # the buttons between the title and the first panel's title
                      updatemenus=[dict(type="buttons", direction="right", buttons=buttons, active=start, x=0.0,
                                        xanchor="left", y=1.0 + 40 / max(plot_px, 1), yanchor="bottom")])
    for a in xaxes:
        out.layout[a].title.text = figs[start].layout[a].title.text
    return out
