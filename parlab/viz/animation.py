"""Who sends what to whom: an animated picture of a trace's communication.

Ranks sit on a circle (rank 0 on top, clockwise). Each frame is one
communication *step*, and its arrows are the messages of that step, labelled
with the bytes each arrow carries:

* a send and the matching recv are one step (the k-th send from rank a to rank
  b pairs with the k-th recv on b from a: torch matches messages in order);
* a collective call is one step across its group (every rank calls the
  collectives of a group in the same order, so the k-th call on a group is
  the same call on every member). Its arrows follow the algorithm whose bytes
  `parlab.trace.wire_bytes` counts, so the arrows leaving a rank add up to
  that rank's `Event.wire_bytes`:

      all_reduce                      ring g0 -> g1 -> ... -> g0, 2 (N-1)/N X per arrow
      all_gather / reduce_scatter     ring, (N-1)/N X per arrow
      all_to_all                      every rank to every other, X/N per arrow
      broadcast                       pipelined chain from the root, X per arrow
      reduce                          chain into the root, X per arrow
      scatter / gather                root to each rank / each rank to the root, X/N per arrow

The figure uses plotly frames with play/pause buttons and a slider, so it
plays in JupyterLab and in a static HTML file (``plotly.io.to_html``).
Pure data in, figure out: nothing here communicates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go

from ..trace import Event
from . import style
from .timeline import as_trace, empty_figure

__all__ = ["Step", "comm_steps", "step_edges", "comm_animation"]

NODE_R = 0.15      # how far short of a node's centre an arrow stops (data units; ranks sit on the unit circle)
LANE_OFF = 0.04    # sideways shift of an arrow, so a -> b and b -> a show as two parallel arrows


@dataclass
class Step:
    """One communication step: a collective call across its group, or one send -> recv pair."""
    op: str
    kind: str                               # "collective" | "p2p"
    label: str
    group: tuple[int, ...]                  # the collective's group, or (src, dst) for p2p
    nbytes: int                             # payload of the call (see parlab.trace)
    root: int | None = None                 # broadcast/reduce/scatter/gather root
    events: list[Event] = field(default_factory=list)

    @property
    def start(self) -> float:
        return min(e.start for e in self.events)

    @property
    def edges(self) -> list[tuple[int, int, float]]:
        return step_edges(self)


def comm_steps(trace: Any) -> list[Step]:
    """Group a trace's communication events into steps, in order of their first event's start."""
    steps: dict[tuple, Step] = {}
    calls: dict[tuple, int] = {}            # how many calls of this kind a rank has made so far

    def nth(key: tuple) -> int:
        calls[key] = calls.get(key, -1) + 1
        return calls[key]

    for e in as_trace(trace).comm().events:  # sorted by start: each rank's events are in program order
        if e.kind == "collective":
            key = ("collective", e.group, nth((e.rank, e.group)))
            new = Step(e.op, e.kind, e.label, e.group, e.nbytes, root=e.peer)
        else:
            src, dst = (e.rank, e.peer) if e.op == "send" else (e.peer, e.rank)
            key = ("p2p", src, dst, nth((e.op, src, dst)))
            new = Step("send", e.kind, e.label, (src, dst), e.nbytes)
        step = steps.setdefault(key, new)
        step.events.append(e)
        step.label = step.label or e.label
    return sorted(steps.values(), key=lambda s: s.start)


def step_edges(step: Step) -> list[tuple[int, int, float]]:
    """The messages of one step as (sender, receiver, bytes) under the algorithm in the module docstring."""
    g, x = list(step.group), float(step.nbytes)
    n = len(g)
    if step.kind == "p2p":
        return [(g[0], g[1], x)]
    if n < 2 or step.op == "barrier":
        return []
    ring = [(g[i], g[(i + 1) % n]) for i in range(n)]
    if step.op == "all_reduce":
        return [(a, b, 2 * (n - 1) / n * x) for a, b in ring]
    if step.op in ("all_gather", "reduce_scatter"):
        return [(a, b, (n - 1) / n * x) for a, b in ring]
    if step.op == "all_to_all":
        return [(a, b, x / n) for a in g for b in g if a != b]
    if step.root not in g:
        return []
    k = g.index(step.root)
    chain = g[k:] + g[:k]                   # root first, then the group order around the ring
    if step.op == "broadcast":
        return [(chain[i], chain[i + 1], x) for i in range(n - 1)]
    if step.op == "reduce":
        return [(chain[i], chain[i - 1], x) for i in range(n - 1, 0, -1)]
    if step.op == "scatter":
        return [(step.root, b, x / n) for b in chain[1:]]
    if step.op == "gather":
        return [(a, step.root, x / n) for a in chain[1:]]
    return []


def step_title(step: Step) -> str:
    """E.g. "all_reduce 'grads' on ranks [0, 1, 2, 3]: 64 B payload, 96 B per arrow"."""
    label = f" '{step.label}'" if step.label else ""
    if step.kind == "p2p":
        return f"send rank {step.group[0]} → rank {step.group[1]}{label}: {style.human_bytes(step.nbytes)}"
    edges = step_edges(step)
    per_arrow = f", {style.human_bytes(edges[0][2])} per arrow" if edges else ""
    root = f" (root {step.root})" if step.root is not None else ""
    return (f"{step.op}{label} on ranks {list(step.group)}{root}: "
            f"{style.human_bytes(step.nbytes)} payload{per_arrow}")


# ---------------------------------------------------------------------- geometry and frames
def _positions(ranks: list[int]) -> dict[int, tuple[float, float]]:
    """Ranks on the unit circle, the first on top, going clockwise."""
    n = len(ranks)
    return {r: (math.cos(math.pi / 2 - 2 * math.pi * i / n), math.sin(math.pi / 2 - 2 * math.pi * i / n))
            for i, r in enumerate(ranks)}


def _frame_data(step: Step, pos: dict[int, tuple[float, float]]) -> list[go.Scatter]:
    """Three traces: the arrows, their byte labels, the rank nodes (the step's ranks in the op's colour)."""
    colour = style.color(step.kind, "send" if step.kind == "p2p" else step.op)
    ax, ay, sizes, angles, lx, ly, ltext, lhover = [], [], [], [], [], [], [], []
    for a, b, nbytes in step_edges(step):
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
        lx.append(sx + 0.4 * (ex - sx) + 2 * LANE_OFF * nx)      # 40% along: crossing arrows keep apart
        ly.append(sy + 0.4 * (ey - sy) + 2 * LANE_OFF * ny)
        ltext.append(style.human_bytes(nbytes))
        lhover.append(f"rank {a} → rank {b}: {style.human_bytes(nbytes)}")
    active = set(step.group)
    ranks = list(pos)
    return [
        go.Scatter(x=ax, y=ay, mode="lines+markers", line=dict(color=colour, width=2.5), hoverinfo="skip",
                   marker=dict(symbol="arrow", size=sizes, angle=angles, color=colour), name="messages"),
        go.Scatter(x=lx, y=ly, mode="text", text=ltext, textfont=dict(color=colour, size=11), name="bytes",
                   hovertext=lhover, hovertemplate="%{hovertext}<extra></extra>"),
        go.Scatter(x=[pos[r][0] for r in ranks], y=[pos[r][1] for r in ranks], mode="markers+text",
                   text=[str(r) for r in ranks], textfont=dict(color="white", size=14), name="ranks",
                   marker=dict(size=38, color=[colour if r in active else "#c7c7c7" for r in ranks],
                               line=dict(color="#333333", width=1)),
                   hovertext=[f"rank {r}" for r in ranks], hovertemplate="%{hovertext}<extra></extra>"),
    ]


def comm_animation(trace: Any, title: str | None = None, max_frames: int = 60) -> go.Figure:
    """Animated "who sends what to whom": one frame per communication step (see `comm_steps`).

    Shows the first `max_frames` steps (filter the trace, e.g. ``trace.filter(label="bucket")``, to
    look at others); play/pause buttons and a slider step through them."""
    if max_frames < 1:
        raise ValueError(f"max_frames={max_frames}: need at least 1 frame")
    tr = as_trace(trace)
    all_steps = comm_steps(tr)
    if not all_steps:
        return empty_figure("no communication in this trace: nothing to animate "
                            "(use parlab.comm inside fn and parlab.run(..., trace=True))", title)
    steps = all_steps[:max_frames]
    cut = f" (first {len(steps)} of {len(all_steps)} steps)" if len(all_steps) > len(steps) else ""
    ranks = sorted(set(tr.ranks).union(*(s.group for s in steps)))
    pos = _positions(ranks)

    def heading(i: int) -> str:
        text = f"step {i + 1}/{len(steps)}{cut}: {step_title(steps[i])}"
        return f"{title}<br><sup>{text}</sup>" if title else text

    frames = [go.Frame(name=str(i), data=_frame_data(s, pos), traces=[0, 1, 2],
                       layout=go.Layout(title_text=heading(i))) for i, s in enumerate(steps)]
    still = {"mode": "immediate", "frame": {"duration": 0, "redraw": True}, "transition": {"duration": 0}}
    fig = go.Figure(data=frames[0].data, frames=frames)
    fig.update_layout(
        title_text=heading(0), template="plotly_white", showlegend=False, height=560,
        xaxis=dict(visible=False, range=[-1.35, 1.35]),
        yaxis=dict(visible=False, range=[-1.35, 1.35], scaleanchor="x"),
        updatemenus=[dict(type="buttons", direction="left", x=0.0, y=-0.02, xanchor="left", yanchor="top",
                          buttons=[dict(label="▶ play", method="animate",
                                        args=[None, {"frame": {"duration": 900, "redraw": True},
                                                     "transition": {"duration": 0}, "fromcurrent": True}]),
                                   dict(label="❚❚ pause", method="animate", args=[[None], still])])],
        sliders=[dict(active=0, x=0.2, len=0.8, y=0.0, yanchor="top",
                      currentvalue=dict(prefix="step "),
                      steps=[dict(label=str(i + 1), method="animate", args=[[str(i)], still])
                             for i in range(len(steps))])])
    return fig
