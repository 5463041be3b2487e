"""Figures and trace readings for lesson 02 (data parallel): naive DataParallel next to DDP.

Plain data in, plotly figure out; nothing here communicates.

* `split_steps` cuts a training run's trace into one sub-trace per update, so a
  figure can show one step (each rank's step starts at its k-th "step start" event);
* `ddp_overlap` reads from a DDP step's trace how much of the bucket traffic was
  launched while backward was still running, and how long the end of backward
  waited for it ("grad sync");
* `phase_bars`: bytes each rank sent, stacked by phase, one panel per design
  (fed by `parlab.parallel.data.naive.traffic_by_phase`);
* `memory_bars`: bytes each rank held, stacked by category, one panel per design
  (fed by `NaiveDataParallel.memory` / `memory_report`).

The two panels of a figure share their y axis, so rank 0's extra load in the naive
design is read off against the same scale as DDP's balanced ranks.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from parlab.i18n import _
from parlab.trace import Event, Trace
from parlab.viz import style
from parlab.viz.timeline import as_trace

__all__ = ["split_steps", "ddp_overlap", "phase_bars", "memory_bars"]

_PALETTE = qualitative.Plotly + qualitative.Set2


def split_steps(trace: Any, is_step_start: Callable[[Event], bool]) -> list[Trace]:
    """One Trace per step: on each rank, step k runs from its k-th event with ``is_step_start(e)`` to its
    (k+1)-th (events before the first one, e.g. DDP's construction broadcast, belong to no step)."""
    tr = as_trace(trace)
    steps: list[list[Event]] = []
    for rank in tr.ranks:
        k = -1
        for e in tr.filter(rank=rank).events:
            if is_step_start(e):
                k += 1
                while len(steps) <= k:
                    steps.append([])
            if k >= 0:
                steps[k].append(e)
    return [Trace(evs) for evs in steps]


def ddp_overlap(step: Any, rank: int) -> dict[str, float]:
    """What one DDP step's trace says about overlap on `rank`.

    buckets            number of "grad bucket i" all-reduces
    launched_early     fraction of the bucket bytes whose all-reduce was launched while backward still had
                       gradients to produce (before its last span, "rest of backward", began)
    hidden             fraction of the all-reduces' duration that lay inside the backward span
    backward_s         backward compute, from its first span's start to its last span's end (seconds)
    wait_s             the "grad sync" region: how long the end of backward waited for the buckets
    """
    tr = as_trace(step).filter(rank=rank)
    spans = tr.filter(op="backward", kind="compute").events
    buckets = tr.filter(op="all_reduce", label="grad bucket").events
    if not spans or not buckets:
        raise ValueError(f"rank {rank}: this trace has no backward spans or no 'grad bucket' all-reduces; pass "
                         f"the trace of a DistributedDataParallel step run with trace=True")
    b0, b1 = min(e.start for e in spans), max(e.end for e in spans)
    total = sum(e.nbytes for e in buckets)
    last = max(e.start for e in spans)                     # the last span: after the last gradient arrived
    early = sum(e.nbytes for e in buckets if e.start < last)
    busy = sum(e.duration for e in buckets)
    inside = sum(max(0.0, min(e.end, b1) - max(e.start, b0)) for e in buckets)
    wait = sum(e.duration for e in tr.filter(op="grad sync", kind="compute").events)
    return {"buckets": len(buckets), "launched_early": early / total if total else 0.0,
            "hidden": inside / busy if busy > 0 else 0.0, "backward_s": b1 - b0, "wait_s": wait}


def _colours(keys: Sequence[str]) -> dict[str, str]:
    return {k: _PALETTE[i % len(_PALETTE)] for i, k in enumerate(keys)}


def _stacked_panels(panels: Mapping[str, Mapping[str, Mapping[int, float]]], title: str, yaxis_title: str,
                    scale: float, unit: str) -> go.Figure:
    """panels: {panel title: {category: {rank: value}}} -> side-by-side stacked bars with one legend."""
    cats: list[str] = []
    for data in panels.values():
        cats += [c for c in data if c not in cats]
    colour = _colours(cats)
    fig = make_subplots(rows=1, cols=len(panels), shared_yaxes=True, subplot_titles=list(panels),
                        horizontal_spacing=0.06)
    shown: set[str] = set()
    for col, data in enumerate(panels.values(), start=1):
        ranks = sorted({r for per_rank in data.values() for r in per_rank})
        for cat, per_rank in data.items():
            ys = [per_rank.get(r, 0) / scale for r in ranks]
            if not any(ys):
                continue
            name = style.event_label(cat)
            fig.add_trace(go.Bar(x=[f"rank {r}" for r in ranks], y=ys, name=name, marker_color=colour[cat],
                                 legendgroup=cat, showlegend=cat not in shown,
                                 hovertemplate=f"<b>{name}</b><br>%{{x}}: %{{y:.3f}} {unit}<extra></extra>"),
                          row=1, col=col)
            shown.add(cat)
    fig.update_layout(title=title, barmode="stack", template="plotly_white", height=420)
    fig.update_yaxes(title_text=yaxis_title, row=1, col=1)
    return fig


def phase_bars(panels: Mapping[str, Mapping[str, Mapping[int, float]]], title: str | None = None,
               steps: int = 1) -> go.Figure:
    """{design: {phase: {rank: bytes sent over the run}}} -> MB sent per rank per step, stacked by phase
    (`title` defaults to "bytes sent per rank per step")."""
    title = _("bytes sent per rank per step") if title is None else title
    return _stacked_panels(panels, title, _("MB sent per step (ring model)"), 1e6 * steps, "MB")


def memory_bars(panels: Mapping[str, Sequence[Mapping[str, int]]], title: str | None = None) -> go.Figure:
    """{design: [rank 0's {category: bytes}, rank 1's, ...]} -> MB held per rank, stacked by category
    (`title` defaults to "memory per rank")."""
    title = _("memory per rank") if title is None else title
    data = {}
    for design, per_rank in panels.items():
        cats: dict[str, dict[int, float]] = {}
        for r, report in enumerate(per_rank):
            for cat, nbytes in report.items():
                cats.setdefault(cat, {})[r] = nbytes
        data[design] = cats
    return _stacked_panels(data, title, _("MB held"), 1e6, "MB")
