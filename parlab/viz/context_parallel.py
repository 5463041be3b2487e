"""Figures of lesson 06 (sequence / context parallel): plotly only, fed by plain data, never communicates.

    ring_animation(rows, P, layout, causal)   K/V blocks travelling around the ring (from
                                              `parlab.parallel.context.ring.ring_steps(trace)`), with the score
                                              matrix filling in block by block, coloured by the rank
                                              that computed it: each row is a rank's output.
    work_heatmaps({"contiguous": m, ...})     score blocks computed, rank x ring step (RingStats or
                                              `work_matrix`), side by side, with each rank's total.
    ulysses_grid(before, after, S, nh)        which rank holds each (position, head) cell of q before and
                                              after Ulysses' all-to-all.
    memory_figure(S_values, curves)           memory per rank (curves in bytes, drawn in GB) vs sequence length.
    overlap_figure(c_values, compute_s, comm_s, threshold)
                                              time of one ring step: compute vs K/V transfer, and where
                                              the transfer hides.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from parlab.i18n import _
from parlab.viz import style

__all__ = ["RANK_COLORS", "ring_animation", "work_heatmaps", "ulysses_grid", "memory_figure", "overlap_figure",
           "block_cells"]

RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _rank_color(r: int) -> str:
    return RANK_COLORS[r % len(RANK_COLORS)]


def _discrete_scale(n: int) -> list:
    """A plotly colour scale mapping the integers 0..n-1 to RANK_COLORS (for heatmaps of 'which rank')."""
    if n == 1:
        return [[0, _rank_color(0)], [1, _rank_color(0)]]
    scale = []
    for r in range(n):
        scale += [[r / n, _rank_color(r)], [(r + 1) / n, _rank_color(r)]]
    return scale


def _units(rank: int, P: int, layout: str) -> list[int]:
    """The half-chunks (units of S / 2P positions) a rank holds, in order."""
    return [2 * rank, 2 * rank + 1] if layout == "contiguous" else [rank, 2 * P - 1 - rank]


def _part(units: list[int], part: str) -> list[int]:
    return units if part == "all" else (units[:1] if part == "front" else units[1:])


def block_cells(row: dict, P: int, layout: str, causal: bool) -> list[tuple[int, int]]:
    """The (query unit, key unit) cells of the 2P x 2P score matrix that one compute row of `ring_steps`
    covers: rank `row['rank']`'s query rows `row['q']` against key rows `row['k']` of rank `row['src']`."""
    qs = _part(_units(row["rank"], P, layout), row.get("q", "all"))
    ks = _part(_units(row["src"], P, layout), row.get("k", "all"))
    return [(i, j) for i in qs for j in ks if not causal or j <= i]


def _ring_positions(P: int) -> list[tuple[float, float]]:
    return [(math.cos(math.pi / 2 - 2 * math.pi * i / P), math.sin(math.pi / 2 - 2 * math.pi * i / P))
            for i in range(P)]


def ring_animation(rows: Sequence[dict], P: int, layout: str = "zigzag", causal: bool = True,
                   phase: str = "fwd", title: str | None = None) -> go.Figure:
    """One frame per ring step of `phase`: left, the ranks on a ring, each labelled with the K/V block it
    holds, and the K/V messages of that step (from the trace's send rows, with their bytes); right, the
    2P x 2P score matrix in half-chunks (S/2P positions each), every block coloured by the rank that has
    computed it so far. A rank's rows are its queries: its output is complete when its rows are full."""
    rows = [r for r in rows if r["phase"] == phase]
    if not rows:
        fig = go.Figure()
        fig.update_layout(title=_("no '{phase}' ring events in these rows (run with trace=True)").format(phase=phase))
        return fig
    pos = _ring_positions(P)
    n = 2 * P
    computes = [r for r in rows if r["what"] == "compute" and "src" in r]
    kv_send = "send kv" if phase == "fwd" else "send kv"
    nbytes = max((r["bytes"] for r in rows if r["what"] == kv_send), default=0)

    def frame(step: int) -> list[go.BaseTraceType]:
        z = [[None] * n for _row in range(n)]                 # rank that computed each cell, so far
        txt = [[""] * n for _row in range(n)]
        for r in computes:
            if r["step"] <= step:
                for i, j in block_cells(r, P, layout, causal):
                    z[i][j], txt[i][j] = r["rank"], f"s{r['step']}"
        held = {r["rank"]: r["src"] for r in computes if r["step"] == step}
        ax, ay, lx, ly, lt = [], [], [], [], []
        for r in rows:
            if r["what"] != kv_send or r["step"] != step:
                continue
            (x0, y0), (x1, y1) = pos[r["rank"]], pos[r["peer"]]
            d = math.hypot(x1 - x0, y1 - y0)
            ux, uy = (x1 - x0) / d, (y1 - y0) / d
            ax += [x0 + 0.2 * ux, x1 - 0.2 * ux, None]
            ay += [y0 + 0.2 * uy, y1 - 0.2 * uy, None]
            lx.append((x0 + x1) / 2 + 0.12 * uy)
            ly.append((y0 + y1) / 2 - 0.12 * ux)
            lt.append(style.human_bytes(r["bytes"]))
        node_text = [f"rank {q}<br>K/V {held[q]}" if q in held else _("rank {rank}<br>(skips)").format(rank=q)
                     for q in range(P)]
        return [
            go.Scatter(x=ax, y=ay, mode="lines+markers", line=dict(color=style.P2P_COLORS["send"], width=3),
                       marker=dict(symbol="arrow", size=[0, 14, 0] * (len(ax) // 3), angleref="previous",
                                   color=style.P2P_COLORS["send"]), hoverinfo="skip", name="K/V sent"),
            go.Scatter(x=lx, y=ly, mode="text", text=lt, textfont=dict(size=11, color="#8a6d00"),
                       hoverinfo="skip", name="bytes"),
            go.Scatter(x=[p[0] for p in pos], y=[p[1] for p in pos], mode="markers+text", text=node_text,
                       textfont=dict(color="white", size=11), hoverinfo="skip", name="ranks",
                       marker=dict(size=62, color=[_rank_color(q) for q in range(P)])),
            go.Heatmap(z=z, text=txt, texttemplate="%{text}", zmin=-0.5, zmax=P - 0.5,
                       colorscale=_discrete_scale(P), showscale=False, xgap=2, ygap=2,
                       hovertemplate=_("query unit %{y}, key unit %{x}: rank %{z}<extra></extra>")),
        ]

    steps = sorted({r["step"] for r in rows})
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.08,
                        subplot_titles=(_("K/V blocks on the ring"),
                                        _("score blocks computed (row = a rank's queries)")))
    for k, tr in enumerate(frame(steps[0])):
        fig.add_trace(tr, row=1, col=1 if k < 3 else 2)
    head = title or (_("ring attention, P={P}, {layout}, causal") if causal else
                     _("ring attention, P={P}, {layout}")).format(P=P, layout=layout)

    def heading(s: int) -> str:
        done = [r for r in computes if r["step"] <= s]
        cells = {c for r in done for c in block_cells(r, P, layout, causal)}
        return _("{head}<br><sup>step {step}: each rank computes with the K/V block it holds while sending it on "
                 "({nbytes} per message)<br>so far {done} block computations (one per rank and step), covering the "
                 "{cells} coloured score cells</sup>").format(head=head, step=s, nbytes=style.human_bytes(nbytes),
                                                               done=len(done), cells=len(cells))

    frames = [go.Frame(name=str(s), data=frame(s), traces=[0, 1, 2, 3], layout=go.Layout(title_text=heading(s)))
              for s in steps]
    fig.frames = frames
    still = {"mode": "immediate", "frame": {"duration": 0, "redraw": True}, "transition": {"duration": 0}}
    ticks = [f"{u}" for u in range(n)]
    fig.update_layout(
        title_text=heading(steps[0]), template="plotly_white", showlegend=False, height=630,
        margin=dict(t=150, b=130),
        xaxis=dict(visible=False, range=[-1.5, 1.5]), yaxis=dict(visible=False, range=[-1.5, 1.5]),
        xaxis2=dict(title=_("key position unit (S/2P positions)"), tickvals=list(range(n)), ticktext=ticks,
                    range=[-0.5, n - 0.5], constrain="domain"),
        yaxis2=dict(title=_("query position unit"), tickvals=list(range(n)), ticktext=ticks, autorange="reversed",
                    scaleanchor="x2"),
        updatemenus=[dict(type="buttons", direction="left", x=0.0, y=-0.14, xanchor="left", yanchor="top",
                          buttons=[dict(label=_("▶ play"), method="animate",
                                        args=[None, {"frame": {"duration": 1100, "redraw": True},
                                                     "transition": {"duration": 0}, "fromcurrent": True}]),
                                   dict(label=_("❚❚ pause"), method="animate", args=[[None], still])])],
        sliders=[dict(active=0, x=0.2, len=0.8, y=-0.12, yanchor="top", currentvalue=dict(prefix=_("ring step ")),
                      steps=[dict(label=str(s), method="animate", args=[[str(s)], still]) for s in steps])])
    return fig


def work_heatmaps(matrices: Mapping[str, Sequence[Sequence[float]]], title: str | None = None,
                  unit: str | None = None) -> go.Figure:
    """One heat map per entry (rank x ring step, value = work in `unit`, default "blocks"), with each rank's total
    on the right."""
    unit = _("blocks") if unit is None else unit
    names = list(matrices)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, horizontal_spacing=0.12)
    zmax = max(max(max(row) for row in m) for m in matrices.values()) or 1
    for k, name in enumerate(names):
        m = [list(row) for row in matrices[name]]
        P, steps = len(m), len(m[0])
        fig.add_trace(go.Heatmap(z=m, x=[_("step {step}").format(step=s) for s in range(steps)],
                                 y=[f"rank {r}" for r in range(P)],
                                 zmin=0, zmax=zmax, colorscale="Blues", showscale=k == len(names) - 1,
                                 text=[[f"{v:g}" for v in row] for row in m], texttemplate="%{text}", xgap=2, ygap=2,
                                 colorbar=dict(title=unit),
                                 hovertemplate="%{y}, %{x}: %{z:g} " + unit + "<extra></extra>"),
                      row=1, col=k + 1)
        totals = [sum(row) for row in m]
        for r, tot in enumerate(totals):
            fig.add_annotation(x=steps - 0.5 + 0.1, y=r, xanchor="left", text=f"Σ {tot:g}", showarrow=False,
                               xref=f"x{k + 1 if k else ''}", yref=f"y{k + 1 if k else ''}")
        fig.update_yaxes(autorange="reversed", row=1, col=k + 1)
        fig.update_xaxes(range=[-0.5, steps + 0.2], row=1, col=k + 1)
    fig.update_layout(title=title or _("work per rank and ring step ({unit})").format(unit=unit),
                      template="plotly_white",
                      height=120 + 60 * max(len(m) for m in matrices.values()))
    return fig


def ulysses_grid(before: Sequence[Sequence[tuple[int, int]]], after: Sequence[Sequence[tuple[int, int]]],
                 S: int, nh: int, title: str | None = None) -> go.Figure:
    """Two (sequence position x head) grids coloured by the rank holding each cell: `before[r]` and
    `after[r]` list the (position, head) pairs rank r holds before and after the all-to-all."""
    P = len(before)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=(_("before: sequence-sharded (S/P positions, all heads)"),
                                        _("after all-to-all: head-sharded (all positions, nh/P heads)")))
    for k, held in enumerate((before, after)):
        z = [[None] * nh for _pos in range(S)]
        for r, cells in enumerate(held):
            for s, h in cells:
                z[s][h] = r
        fig.add_trace(go.Heatmap(z=z, x=[_("head {head}").format(head=h) for h in range(nh)], y=list(range(S)),
                                 zmin=-0.5,
                                 zmax=P - 0.5, colorscale=_discrete_scale(P), showscale=k == 1, xgap=2, ygap=1,
                                 colorbar=dict(title="rank", tickvals=list(range(P))),
                                 hovertemplate=_("position %{y}, %{x}: rank %{z}<extra></extra>")), row=1, col=k + 1)
        fig.update_yaxes(autorange="reversed", title=_("sequence position") if k == 0 else None, row=1, col=k + 1)
    fig.update_layout(title=title or _("Ulysses all-to-all on P={P} ranks: S={S} positions x {nh} heads").format(
                          P=P, S=S, nh=nh),
                      template="plotly_white", height=480)
    return fig


def memory_figure(S_values: Sequence[int], curves: Mapping[str, Sequence[float]], title: str | None = None,
                  limit: float | None = None) -> go.Figure:
    """Bytes per rank vs sequence length, one line per entry of `curves`, log-log; `limit`: a device's memory."""
    fig = go.Figure([go.Scatter(x=list(S_values), y=[b / 1e9 for b in v], mode="lines+markers", name=name)
                     for name, v in curves.items()])                       # plotted in GB (10^9 bytes)
    if limit:      # a shape on a log axis takes data values, an annotation log10 values
        fig.add_hline(y=limit / 1e9, line_dash="dash", line_color="grey")
        fig.add_annotation(x=0.02, xref="paper", y=math.log10(limit / 1e9), yanchor="bottom", showarrow=False,
                           text=_("device memory {gb:g} GB").format(gb=limit / 1e9))
    fig.update_layout(title=title or _("attention memory per rank vs sequence length"), template="plotly_white",
                      xaxis=dict(type="log", title=_("sequence length S"), minorloglabels="none"),
                      yaxis=dict(type="log", title=_("GB per rank"), minorloglabels="none"), height=430)
    return fig


def overlap_figure(c_values: Sequence[float], compute_s: Sequence[float], comm_s: Sequence[float],
                   threshold: float, title: str | None = None, mark: float | None = None) -> go.Figure:
    """Seconds per ring step vs block length c: compute (grows as c^2) and the K/V transfer (grows as c);
    the step takes the larger of the two when they overlap; they cross at `threshold`."""
    fig = go.Figure([
        go.Scatter(x=list(c_values), y=list(compute_s), name=_("compute one block: 4 c² H / FLOPS")),
        go.Scatter(x=list(c_values), y=list(comm_s), name=_("send one K/V block: 2 c H e / bandwidth")),
        go.Scatter(x=list(c_values), y=[max(a, b) for a, b in zip(compute_s, comm_s)], name=_("overlapped step"),
                   line=dict(dash="dot", color="black")),
    ])
    fig.add_vline(x=threshold, line_dash="dash", line_color="grey")   # shapes: data values on a log axis
    fig.add_annotation(x=math.log10(threshold), y=1, yref="paper", xanchor="left", showarrow=False,   # log10
                       text=_("c* = {threshold:,.0f}: transfer hidden to the right").format(threshold=threshold))
    if mark:
        fig.add_vline(x=mark, line_color="#d62728")
        fig.add_annotation(x=math.log10(mark), y=0, yref="paper", xanchor="left", yanchor="bottom",
                           showarrow=False, text=f"c = {mark:,.0f}", font_color="#d62728")
    fig.update_layout(title=title or _("when does ring communication hide behind compute?"), template="plotly_white",
                      xaxis=dict(type="log", title=_("block length c = S / P (tokens per rank)"),
                                 minorloglabels="none"),
                      yaxis=dict(type="log", title=_("seconds per ring step"), minorloglabels="none"), height=430)
    return fig
