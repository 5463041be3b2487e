"""Pipeline schedule figures: one lane per rank, a cell per action, the micro-batch number written inside.

The pictures of the GPipe, 1F1B, interleaved and zero-bubble papers (and of seed 001 / 003), drawn from data:

    from parlab.parallel import pipeline as sch
    from parlab.viz import pipeline as vp

    sim = sch.simulate(sch.one_f_one_b(4, 8))
    vp.schedule_timeline(sim.spans, title="1F1B")                 # scheduled, in unit time
    vp.schedule_timeline(measured, scale=1 / 0.02, overlay=sim.spans)   # measured (s -> units), schedule outlined
    vp.schedules_figure({"GPipe": gpipe_spans, "1F1B": spans})    # several schedules stacked, one x axis
    vp.peak_bars({"GPipe": sim_g.peak_in_flight, "1F1B": sim.peak_in_flight})

`spans` is what `Simulation.spans` or `pipeline_parallel.measured_spans(trace)` give: per rank (a list indexed by
rank, or a dict rank -> list) the (start, end, Action) of every action. Colours: forward light blue, backward
mid blue (as in every parlab timeline), the zero-bubble split I (input gradient) darker blue and W (weight
gradient) green; with interleaving the virtual stage's chunk is hatched (chunk 0 plain, chunk 1 "/", ...).
Plotly only; never communicates.
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from parlab.i18n import _
from parlab.viz import style

__all__ = ["KIND_COLORS", "KIND_NAMES", "kind_names", "schedule_label", "schedule_timeline", "schedules_figure",
           "peak_bars"]

KIND_COLORS = {"F": style.COMPUTE_COLORS["forward"], "B": style.COMPUTE_COLORS["backward"],
               "I": "#6a51a3", "W": "#a1d99b"}   # I purple: apart from B even two chunks darker
KIND_NAMES = {"F": "F forward", "B": "B backward", "I": "I input grad", "W": "W weight grad"}   # in English
PATTERNS = ("", "/", "x", "\\", ".", "+")         # hatch of chunk 0, 1, 2, ... (interleaving)


def kind_names() -> dict[str, str]:
    """`KIND_NAMES` in the language in force: the legend's name of each kind of cell."""
    return {"F": _("F forward"), "B": _("B backward"), "I": _("I input grad"), "W": _("W weight grad")}


def schedule_label(name: str) -> str:
    """A schedule's name as the course's notebooks key it ("naive", "interleaved 1F1B (v=2)", ...) in the language
    in force, for a title, a legend or a table; a name that is a name (GPipe, 1F1B, ZB-H1) or one the student
    wrote stays as it is. The key itself never changes: cells look schedules up by it."""
    names = {"naive": _("naive"), "interleaved": _("interleaved"),
             "interleaved (memory-optimised)": _("interleaved (memory-optimised)")}
    if name in names:
        return names[name]
    if m := re.fullmatch(r"interleaved 1F1B \(v=(\d+)\)", name):
        return _("interleaved 1F1B (v={v})").format(v=m[1])
    return name


def _rows(spans) -> list[tuple[int, list]]:
    items = spans.items() if isinstance(spans, Mapping) else enumerate(spans)
    return sorted((int(r), list(sp)) for r, sp in items)


#: how much darker each further chunk of a kind is: the light kinds (F, W) by less, so that forward's chunk 3 does
#: not meet backward's chunk 2 (20% for all made them one colour, 38 apart in RGB, in lesson 05's explorer at v=4)
SHADE_STEP = {"F": 0.15, "B": 0.2, "I": 0.2, "W": 0.15}


def _shade(colour: str, chunk: int, step: float = 0.2) -> str:
    """The kind's colour for chunk 0, darker by `step` per further chunk: chunks differ in colour, not only hatch."""
    k = max(0.0, 1.0 - step * chunk)
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"#{int(r * k):02x}{int(g * k):02x}{int(b * k):02x}"


#: a lane with more cells than this draws them without their micro-batch numbers (they would not fit)
MAX_LABELLED = 48
#: a timeline's legend: its top this many px below the plot (under the x axis's title), and at most this many
#: entries a row in a 920-px notebook output ("B backward, chunk 1" is 150 px wide)
LEGEND_TOP, LEGEND_PER_ROW = 62, 4


#: a cell's height in its lane (a lane is 1 tall); under an overlay the cells are thinner and the outline taller,
#: so the outline's edges show above and below every cell
CELL_WIDTH, OVERLAID_CELL_WIDTH, OUTLINE_WIDTH = 0.8, 0.7, 0.94


def _add_cells(fig: go.Figure, spans, scale: float, ranks: int, row=None, col=None, legend: bool = True,
               seen: set | None = None, width: float = CELL_WIDTH) -> None:
    """One bar trace per (kind, chunk): base = start, x = duration, y = rank lane, text = micro-batch (unless a
    lane holds more than MAX_LABELLED cells)."""
    groups: dict[tuple[str, int], list] = {}
    for r, sp in _rows(spans):
        for t0, t1, a in sp:
            groups.setdefault((a.kind, a.stage // ranks), []).append((r, t0 * scale, (t1 - t0) * scale, a))
    labelled = max((len(sp) for _r, sp in _rows(spans)), default=0) <= MAX_LABELLED
    seen = set() if seen is None else seen
    names = kind_names()
    for (kind, chunk), cells in sorted(groups.items(), key=lambda kv: ("FBIW".index(kv[0][0]), kv[0][1])):
        name = _("{kind}, chunk {chunk}").format(kind=names[kind], chunk=chunk) if chunk else names[kind]
        fig.add_trace(go.Bar(
            orientation="h", base=[c[1] for c in cells], x=[c[2] for c in cells], y=[f"rank {c[0]}" for c in cells],
            text=[str(c[3].mb) for c in cells] if labelled else None, textposition="inside",
            insidetextanchor="middle",
            textfont=dict(size=11, color="black" if kind in "FW" else "white"), width=width, name=name,
            legendgroup=name, showlegend=legend and name not in seen,
            marker=dict(color=_shade(KIND_COLORS[kind], chunk, SHADE_STEP[kind]),
                        line=dict(color="white", width=0.5 if labelled else 0),
                        pattern=dict(shape=PATTERNS[chunk % len(PATTERNS)], fgcolor="rgba(0,0,0,0.35)")),
            hovertemplate=[_("rank {rank}: {action} (stage {stage}, micro-batch {mb})<br>{start:.2f} to {end:.2f}"
                             "<extra></extra>").format(rank=c[0], action=c[3], stage=c[3].stage, mb=c[3].mb,
                                                        start=c[1], end=c[1] + c[2]) for c in cells]),
            row=row, col=col)
        seen.add(name)


def _add_outline(fig: go.Figure, spans, scale: float, row=None, col=None, legend: bool = True) -> None:
    """The scheduled cells as red outlines, taller than a cell (OUTLINE_WIDTH); added before the cells, so drawn
    under them: where a measured cell lies, its opaque fill hides the outline's edges and they never cross its
    micro-batch number (they did when drawn on top), while the outline's top and bottom and the ends of its sides
    still show above and below the cell, and whole in the gaps. Listed last in the legend."""
    cells = [(r, t0 * scale, (t1 - t0) * scale, a) for r, sp in _rows(spans) for t0, t1, a in sp]
    fig.add_trace(go.Bar(
        orientation="h", base=[c[1] for c in cells], x=[c[2] for c in cells], y=[f"rank {c[0]}" for c in cells],
        width=OUTLINE_WIDTH, name=_("scheduled (simulation)"), showlegend=legend, legendgroup="scheduled",
        legendrank=2000,
        marker=dict(color="rgba(0,0,0,0)", line=dict(color="#d62728", width=1.5)),
        hovertemplate=[_("scheduled {action}: {start:.2f} to {end:.2f}<extra></extra>").format(
                           action=c[3], start=c[1], end=c[1] + c[2]) for c in cells]),
        row=row, col=col)


def _lanes(spans) -> list[str]:
    return [f"rank {r}" for r, _sp in _rows(spans)]


def schedule_timeline(spans, title: str | None = None, scale: float = 1.0, time_unit: str | None = None,
                      overlay=None, overlay_scale: float = 1.0, ranks: int | None = None) -> go.Figure:
    """One lane per rank; each action a cell coloured by kind (F, B, I, W) with its micro-batch number.

    `scale` multiplies the times (e.g. 1 / device_time turns measured seconds into unit time); `overlay`,
    other spans (usually the simulation of the same schedule), is drawn as red outlines around and between the
    cells (under them, so they never cross a number), and the measured run and its schedule can be compared cell
    by cell. `ranks` (pipeline size, for the chunk of a virtual
    stage) defaults to the number of lanes; `time_unit`, the x axis's title, to "unit time"."""
    p = ranks or len(_rows(spans))
    fig = go.Figure()
    if overlay is not None:
        _add_outline(fig, overlay, overlay_scale)
    _add_cells(fig, spans, scale, p, width=CELL_WIDTH if overlay is None else OVERLAID_CELL_WIDTH)
    lanes = _lanes(spans)
    plot_px = (45 if overlay is None else 55) * len(lanes)    # an overlay: room for the outline around each cell
    # the legend below the x axis's title, in pixels: at p = 2 a fraction of the plot put it on the title, and its
    # second row (chunks, I and W) needs its own room
    rows = -(-sum(bool(t.showlegend) for t in fig.data) // LEGEND_PER_ROW)
    bottom = LEGEND_TOP + 24 * rows + 10
    fig.update_layout(title=title, barmode="overlay", height=100 + plot_px + bottom, template="plotly_white",
                      uniformtext=dict(minsize=10, mode="show"),   # micro-batch numbers never under 10 px
                      xaxis_title=_("unit time") if time_unit is None else time_unit, margin=dict(t=100, b=bottom),
                      legend=dict(orientation="h", y=-LEGEND_TOP / plot_px, yanchor="top"), bargap=0.1,
                      yaxis=dict(categoryorder="array", categoryarray=lanes[::-1]))
    return fig


def schedules_figure(panels: Mapping[str, object], title: str | None = None, scale: float | Mapping = 1.0,
                     time_unit: str | None = None, ranks: int | None = None, lane_px: int = 32) -> go.Figure:
    """Several schedules stacked, one panel each (name -> spans, each titled by `schedule_label`), on a shared time
    axis: the bubbles line up.
    `scale` is one factor for all panels or a mapping name -> factor; `time_unit` (the x axis's title) defaults
    to "unit time"; `lane_px`, the height of a rank's lane (lesson 07's explorer: 24, to fit a screen)."""
    names = list(panels)
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[schedule_label(n) for n in names])
    seen: set = set()
    for i, name in enumerate(names, start=1):
        sp = panels[name]
        k = scale[name] if isinstance(scale, Mapping) else scale
        _add_cells(fig, sp, k, ranks or len(_rows(sp)), row=i, col=1, seen=seen)
        lanes = _lanes(sp)
        fig.update_yaxes(categoryorder="array", categoryarray=lanes[::-1], row=i, col=1)
    lanes_total = sum(len(_rows(panels[n])) for n in names)
    height = 140 + lane_px * lanes_total + 30 * len(names)   # 4 panels of 4 ranks + the replay toggle fit 900 px
    fig.update_layout(title=title, barmode="overlay", height=height, template="plotly_white", bargap=0.1,
                      uniformtext=dict(minsize=10, mode="show"),   # micro-batch numbers never under 10 px
                      legend=dict(orientation="h", y=-75 / (height - 160)))   # below the x-axis title
    fig.update_xaxes(title_text=_("unit time") if time_unit is None else time_unit, row=len(names), col=1)
    return fig


def peak_bars(peaks: Mapping[str, Sequence[int]], title: str | None = None,
              yaxis_title: str | None = None) -> go.Figure:
    """Grouped bars: for each schedule (name -> per-rank peak), the peak activations in flight on each rank
    (`yaxis_title` defaults to "micro-batches of activations alive (peak)")."""
    yaxis_title = _("micro-batches of activations alive (peak)") if yaxis_title is None else yaxis_title
    fig = go.Figure([go.Bar(name=schedule_label(name), x=[f"rank {r}" for r in range(len(v))], y=list(v),
                            text=list(v), textposition="outside") for name, v in peaks.items()])
    fig.update_layout(title=title, barmode="group", yaxis_title=yaxis_title, height=360, template="plotly_white")
    return fig
