"""Who sends what to whom: an animated picture of a trace's communication.

Ranks sit on a circle (rank 0 on top, clockwise). Each frame is one communication *step* of
`parlab.viz.comm_steps` (a send with its recv, or a collective call), and its arrows are the messages of that
step, labelled with the bytes each arrow carries; they follow the algorithm whose bytes `parlab.trace.wire_bytes`
counts, so the arrows leaving a rank add up to that rank's `Event.wire_bytes`. By default each call is played as
its algorithm runs (`algorithm_steps`: a ring all-reduce on N ranks is 2(N-1) frames); next to every rank a row
of squares shows the chunks it holds after the frame (pale: a partial sum of few ranks; full colour: complete).
``comm_animation(trace, per_call=True)`` draws one frame per call with the call's total arrows.

The figure uses plotly frames with play/pause buttons and a slider, so it plays in JupyterLab and in a
static HTML file (``plotly.io.to_html``); its words are in the language in force (`parlab.i18n`). Pure data
in, figure out: nothing here communicates.
"""
from __future__ import annotations

import math
from typing import Any

import plotly.graph_objects as go

from parlab.i18n import _
from parlab.viz import style
from parlab.viz.comm_steps import (REDUCING, Move, Step, initial_chunks, algorithm_steps, comm_steps, step_edges,
                                   step_title)
from parlab.viz.timeline import as_trace, empty_figure

__all__ = ["Step", "Move", "comm_steps", "step_edges", "algorithm_steps", "comm_animation"]

NODE_R = 0.15      # how far short of a node's centre an arrow stops (data units; ranks sit on the unit circle)
CHUNK_R = 1.32     # chunk squares sit this far out (as a multiple of the node's radius) ...
CHUNK_GAP = 0.085  # ... this far apart along the circle
LANE_OFF = 0.04    # sideways shift of an arrow, so a -> b and b -> a show as two parallel arrows


# ---------------------------------------------------------------------- geometry and frames
def _positions(ranks: list[int]) -> dict[int, tuple[float, float]]:
    """Ranks on the unit circle, the first on top, going clockwise."""
    n = len(ranks)
    return {r: (math.cos(math.pi / 2 - 2 * math.pi * i / n), math.sin(math.pi / 2 - 2 * math.pi * i / n))
            for i, r in enumerate(ranks)}


def _mix(colour: str, f: float) -> str:
    """`colour` faded towards white: f = 1 the colour itself, f = 0 white."""
    rgb = [int(colour[k:k + 2], 16) for k in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - (255 - c) * f):02x}" for c in rgb)


def _chunk_xy(pos: dict[int, tuple[float, float]], rank: int, c: int, n_chunks: int) -> tuple[float, float]:
    """Where chunk square c of a rank sits: in a row outside its node, along the circle."""
    x, y = pos[rank]
    rad = math.hypot(x, y) or 1.0
    ux, uy = x / rad, y / rad                                   # outward
    tx, ty = -uy, ux                                            # along the circle ...
    if tx < -1e-9 or (abs(tx) <= 1e-9 and ty > 0):
        tx, ty = -tx, -ty                                       # ... read left to right, or top to bottom
    off = (c - (n_chunks - 1) / 2) * CHUNK_GAP
    return x * CHUNK_R + tx * off, y * CHUNK_R + ty * off


def _frame_data(step: Step, moves: list[tuple[int, int, float, str]], pos: dict[int, tuple[float, float]],
                chunks: tuple[int, dict[int, list[set]]] | None) -> list[go.Scatter]:
    """Four traces: the arrows, their byte labels, the rank nodes (the step's ranks in the op's colour), and the
    chunk squares (what each rank holds after this frame; empty when the op has none to show)."""
    colour = style.color(step.kind, "send" if step.kind == "p2p" else step.op)
    ax, ay, sizes, angles, lx, ly, ltext, lhover = [], [], [], [], [], [], [], []
    for a, b, nbytes, what in moves:
        (x0, y0), (x1, y1) = pos[a], pos[b]
        d = math.hypot(x1 - x0, y1 - y0)
        ux, uy = (x1 - x0) / d, (y1 - y0) / d               # unit vector a -> b
        nx, ny = uy, -ux                                    # its right-hand normal
        sx, sy = x0 + NODE_R * ux + LANE_OFF * nx, y0 + NODE_R * uy + LANE_OFF * ny
        ex, ey = x1 - NODE_R * ux + LANE_OFF * nx, y1 - NODE_R * uy + LANE_OFF * ny
        ax += [sx, ex, None]
        ay += [sy, ey, None]
        sizes += [0, 13, 0]                                 # an arrowhead at the receiving end only
        angles += [0, math.degrees(math.atan2(ux, uy)), 0]  # plotly: degrees clockwise from "up"
        along, side = (0.5, 0.26) if what else (0.4, 2 * LANE_OFF)   # two-line labels clear the arrow; 40%: crossing
                                                                     # arrows keep their labels apart
        lx.append(sx + along * (ex - sx) + side * nx)
        ly.append(sy + along * (ey - sy) + side * ny)
        ltext.append(f"{what}<br>{style.human_bytes(nbytes)}" if what else style.human_bytes(nbytes))
        lhover.append(f"rank {a} → rank {b}: {what + ', ' if what else ''}{style.human_bytes(nbytes)}")
    active = set(step.group)
    ranks = list(pos)
    cx, cy, ccol, chover = [], [], [], []
    if chunks is not None:
        n_chunks, held = chunks
        full = len(step.group) if step.op in REDUCING else 1
        for r, row in held.items():
            for c, who in enumerate(row):
                x, y = _chunk_xy(pos, r, c, n_chunks)
                cx.append(x)
                cy.append(y)
                ccol.append(_mix(colour, min(1.0, len(who) / full)) if who else "#ffffff")
                g = list(step.group)
                text = (_("rank {rank}, chunk {chunk}: nothing yet") if not who else
                        _("rank {rank}, chunk {chunk}: sum of ranks {ranks}") if step.op in REDUCING else
                        _("rank {rank}, chunk {chunk}: data of rank {ranks}"))
                chover.append(text.format(rank=r, chunk=c, ranks=", ".join(str(g[k]) for k in sorted(who))))
    return [
        go.Scatter(x=ax, y=ay, mode="lines+markers", line=dict(color=colour, width=2.5), hoverinfo="skip",
                   marker=dict(symbol="arrow", size=sizes, angle=angles, color=colour), name="messages"),
        go.Scatter(x=lx, y=ly, mode="text", text=ltext, textfont=dict(color=colour, size=12), name="bytes",
                   hovertext=lhover, hovertemplate="%{hovertext}<extra></extra>"),
        go.Scatter(x=[pos[r][0] for r in ranks], y=[pos[r][1] for r in ranks], mode="markers+text",
                   text=[str(r) for r in ranks], textfont=dict(color="white", size=14), name="ranks",
                   marker=dict(size=38, color=[colour if r in active else "#c7c7c7" for r in ranks],
                               line=dict(color="#333333", width=1)),
                   hovertext=[f"rank {r}" for r in ranks], hovertemplate="%{hovertext}<extra></extra>"),
        go.Scatter(x=cx, y=cy, mode="markers", name="chunks", hovertext=chover,
                   hovertemplate="%{hovertext}<extra></extra>",
                   marker=dict(symbol="square", size=13, color=ccol, line=dict(color="#555555", width=1))),
    ]


def _frames_of(step: Step, per_call: bool) -> list[tuple[str, list[tuple[int, int, float, str]], Any]]:
    """[(what this frame shows, its arrows (src, dst, bytes, chunk label), chunk state after it)] for one call."""
    if per_call:
        return [("", [(a, b, nb, "") for a, b, nb in step_edges(step)], None)]
    init = initial_chunks(step)
    held = None if init is None else {r: [set(w) for w in row] for r, row in init[1].items()}
    out = []
    for what, moves in algorithm_steps(step):
        arrows = []
        for m in moves:
            chunked = step.op == "all_to_all" or (init is not None and init[0] > 1)   # broadcast/reduce: one piece
            label = _("chunk {chunk}").format(chunk=m.chunk) if m.chunk is not None and chunked else ""
            arrows.append((m.src, m.dst, m.nbytes, label))
        if held is not None:
            before = {r: [set(w) for w in row] for r, row in held.items()}   # a step's moves are simultaneous
            for m in moves:
                if m.chunk is None:
                    continue
                if m.reduce:
                    held[m.dst][m.chunk] |= before[m.src][m.chunk]
                else:
                    held[m.dst][m.chunk] = set(before[m.src][m.chunk])
        state = None if held is None else (init[0], {r: [set(w) for w in row] for r, row in held.items()})
        out.append((what, arrows, state))
    return out


def comm_animation(trace: Any, title: str | None = None, max_frames: int = 120, per_call: bool = False) -> go.Figure:
    """Animated "who sends what to whom": by default one frame per step of each call's algorithm
    (`algorithm_steps`: a ring all-reduce on N ranks is 2(N-1) frames), with per_call=True one frame per call
    (`comm_steps`) showing its total arrows.

    Shows the first `max_frames` frames (filter the trace, e.g. ``trace.filter(label="bucket")``, to
    look at others); play/pause buttons and a slider step through them."""
    if max_frames < 1:
        raise ValueError(f"max_frames={max_frames}: need at least 1 frame")
    tr = as_trace(trace)
    all_steps = comm_steps(tr)
    if not all_steps:
        return empty_figure(_("no communication in this trace: nothing to animate "
                              "(use parlab.comm inside fn and parlab.run(..., trace=True))"), title)
    plan = []                                  # (call index, call, what, arrows, chunk state)
    for k, step in enumerate(all_steps):
        plan += [(k, step, what, arrows, state) for what, arrows, state in _frames_of(step, per_call)]
    shown = plan[:max_frames]
    calls = len({k for k, *_rest in shown})
    cut = ((_(" (first {shown} of {total} steps)") if per_call else _(" (first {shown} of {total} frames)"))
           .format(shown=len(shown), total=len(plan)) if len(plan) > len(shown) else "")
    ranks = sorted(set(tr.ranks).union(*(s.group for s in all_steps[:calls])))
    pos = _positions(ranks)
    has_chunks = any(state is not None for *_rest, state in shown)

    def heading(i: int) -> str:
        k, step, what = shown[i][:3]
        head = (_("frame {step}/{steps}{cut}, call {call}: {title}"), _("step {step}/{steps}{cut}: {title}"))[per_call]
        text = head.format(step=i + 1, steps=len(shown), cut=cut, call=k + 1, title=step_title(step, per_call))
        text += f"<br>{what}" if what else ""
        return f"{title}<br><sup>{text}</sup>" if title else f"<sup>{text}</sup>"

    frames = [go.Frame(name=str(i), data=_frame_data(s[1], s[3], pos, s[4]), traces=[0, 1, 2, 3],
                       layout=go.Layout(title_text=heading(i))) for i, s in enumerate(shown)]
    still = {"mode": "immediate", "frame": {"duration": 0, "redraw": True}, "transition": {"duration": 0}}
    lim = CHUNK_R + 0.3 if has_chunks else 1.35
    fig = go.Figure(data=frames[0].data, frames=frames)
    fig.update_layout(
        title=style.top_title(heading(0), several_lines=any("<br>" in f.layout.title.text for f in frames)),
        template="plotly_white", showlegend=False, height=600,
        margin=dict(t=120, b=90),                  # below the toolbar: a title, a heading, what moved, the key
        meta={"parlab_animation": {"calls": [[s.op, len(s.group)] for s in all_steps[:calls]],
                                   "per_call": per_call, "frames": len(shown), "cut": bool(cut)}},
        xaxis=dict(visible=False, range=[-lim, lim]),
        yaxis=dict(visible=False, range=[-lim, lim], scaleanchor="x"),
        updatemenus=[dict(type="buttons", direction="left", x=0.0, y=-0.02, xanchor="left", yanchor="top",
                          buttons=[dict(label=_("▶ play"), method="animate",
                                        args=[None, {"frame": {"duration": 900, "redraw": True},
                                                     "transition": {"duration": 0}, "fromcurrent": True}]),
                                   dict(label=_("❚❚ pause"), method="animate", args=[[None], still])])],
        sliders=[dict(active=0, x=0.2, len=0.8, y=0.0, yanchor="top",
                      currentvalue=dict(prefix=_("frame ") if not per_call else _("step ")),
                      steps=[dict(label=str(i + 1), method="animate", args=[[str(i)], still])
                             for i in range(len(shown))])])
    if has_chunks:
        fig.add_annotation(text=_("squares: the chunks each rank holds after this frame "
                                  "(pale = sum of few ranks, full colour = complete)"),
                           x=0.5, y=1.0, xref="paper", yref="paper", yanchor="bottom", showarrow=False,
                           font=dict(size=12, color="#555555"))
    return fig
