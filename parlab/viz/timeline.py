"""Timelines: what every rank did, and when, as one lane per rank.

`timeline(trace)` draws each event of a `parlab.Trace` as a horizontal bar in
its rank's lane, from its start to its end (relative to the first event), in
the colours of `parlab.viz.style`. It is the picture behind most lessons: the
bubble of a pipeline schedule, a gradient all-reduce hiding behind the
backward pass, the all-gathers of ZeRO-3 in front of every layer.

How to read it:

* full-height bars are compute regions and blocking communication (the rank
  is busy with it);
* asynchronous calls (``async_op=True``, ``isend``/``irecv``) are thin bars in
  the lower part of the lane, so a bucket all-reduce running *while*
  "backward" computes shows as a red strip under the blue bar: overlap;
* marks (instants) are black diamonds.

`bytes_bars(trace)` answers "who put how many bytes on the wire", stacked by op.

Figures take a `Trace`, a `RunResult` from ``parlab.run(..., trace=True)``, or
plain records (dicts with rank, op, start, end and optionally kind, label,
nbytes, group, peer, ...): a lesson's simulated pipeline schedule is drawn the
same way as a measured run (`from_records`).

Efficiency: one plotly trace per colour (per op), with per-bar arrays
(``base`` = start, ``x`` = duration, ``y`` = lane), so a few thousand events
draw instantly. Plotly graph_objects only; visualization never communicates.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import plotly.graph_objects as go

from parlab.i18n import _
from parlab.trace import COLLECTIVES, P2P, Event, Trace
from parlab.viz import style

__all__ = ["timeline", "bytes_bars", "from_records", "as_trace", "TIME_UNITS", "SYNC_WIDTH", "ASYNC_WIDTH",
           "ASYNC_SHIFT"]

TIME_UNITS: dict[str, float] = {"s": 1.0, "ms": 1e3, "us": 1e6, "steps": 1.0}  # "steps": unitless schedules
SYNC_WIDTH = 0.8     # bar thickness in lane units (a lane is 1 tall)
ASYNC_WIDTH = 0.2    # asynchronous calls: a thin strip ...
ASYNC_SHIFT = 0.3    # ... at the bottom of the lane (rank 0 is at the top; y grows downwards), below the middle
                     # where a compute bar writes its label (0.3 and 0.25 covered half of "wait for buckets")

_EVENT_FIELDS = ("rank", "kind", "op", "start", "end", "group", "peer", "numel", "nbytes", "dtype", "label",
                 "asynchronous", "flops", "kernels", "waited", "clock", "mem_hist", "batched_flops", "special",
                 "meter_at", "meter_waited")


def _group_titles() -> dict[str, str]:
    """The legend's title of each kind of event, in the language in force."""
    return {"compute": _("compute regions"), "collective": _("collectives"), "p2p": _("point-to-point"),
            "mark": _("instants")}


def _hist(h) -> tuple:
    """A size histogram ((k, bytes), ...) from its record (lists after JSON) back to the tuples `Event` keeps."""
    return tuple((int(k), v) for k, v in h)


def _meter(m) -> tuple:
    """The meter's running totals (flops, bytes, kernels, histogram, batched flops[, special results]) back to
    `Event`'s tuple."""
    m = tuple(m)
    return m[:3] + (_hist(m[3]),) + m[4:] if len(m) >= 4 else m


# ---------------------------------------------------------------------- inputs
def from_records(records: Iterable[dict[str, Any]]) -> Trace:
    """A `Trace` from plain dicts, e.g. ``Trace.records()`` or a hand-made schedule.

    Each record needs ``rank``, ``op``, ``start`` and ``end``; ``kind`` defaults
    to "collective"/"p2p" for torch's op names, "mark" when start == end, else
    "compute". Other `Event` fields (label, nbytes, group, peer, the metered
    work a replay needs: flops, mem_hist, batched_flops, meter_at, ...) are
    optional (lists, as JSON gives them back, become the tuples `Event` keeps); unknown keys (e.g. ``wire_bytes``, which is recomputed) are ignored."""
    events = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"record {i} is a {type(rec).__name__}, not a dict; pass dicts with keys "
                             f"rank, op, start, end (e.g. Trace.records())")
        missing = [k for k in ("rank", "op", "start", "end") if k not in rec]
        if missing:
            raise ValueError(f"record {i} lacks {', '.join(missing)}; every record needs rank, op, start and end "
                             f"(got keys {sorted(rec)})")
        fields = {k: rec[k] for k in _EVENT_FIELDS if k in rec and rec[k] is not None}
        fields["group"] = tuple(fields.get("group", ()))
        for k, back in (("mem_hist", _hist), ("meter_at", _meter), ("meter_waited", _meter)):
            if k in fields:
                fields[k] = back(fields[k])
        fields.setdefault("kind", _default_kind(rec["op"], rec["start"], rec["end"]))
        events.append(Event(**fields))
    return Trace(events)


def _default_kind(op: str, start: float, end: float) -> str:
    if op in COLLECTIVES:
        return "collective"
    if op in P2P:
        return "p2p"
    return "mark" if start == end else "compute"


def as_trace(data: Any) -> Trace:
    """Accept a `Trace`, a `RunResult` (its ``.trace``), or a list of `Event`s or record dicts."""
    if isinstance(data, Trace):
        return data
    if hasattr(data, "trace") and hasattr(data, "results"):   # a parlab RunResult
        if data.trace is None:
            raise ValueError("this run recorded no trace; call parlab.run(fn, world_size, trace=True)")
        return data.trace
    if isinstance(data, (list, tuple)):
        if all(isinstance(e, Event) for e in data):
            return Trace(list(data))
        return from_records(data)
    raise ValueError(f"cannot draw a {type(data).__name__}; pass a parlab.Trace, the result of "
                     f"parlab.run(..., trace=True), or a list of record dicts (Trace.records())")


def empty_figure(message: str, title: str | None = None) -> go.Figure:
    """A blank figure that says why it is blank."""
    fig = go.Figure()
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=14))
    fig.update_layout(title=title, xaxis_visible=False, yaxis_visible=False, height=240, template="plotly_white")
    return fig


# ---------------------------------------------------------------------- hover text
def hover_text(e: Event, t0: float, scale: float, unit: str) -> str:
    """Everything worth knowing about one event, as plotly hover HTML."""
    op = style.op_label(e.op) if e.kind == "compute" else e.op
    lines = [f"<b>{op}</b>" + (f" · {style.event_label(e.label)}" if e.label else ""),
             f"rank {e.rank} · {e.kind}" + (" · " + _("async") if e.asynchronous else ""),
             _("start {start:.4g} {unit} · duration {duration:.4g} {unit}").format(
                 start=(e.start - t0) * scale, duration=e.duration * scale, unit=unit)]
    if e.kind in ("collective", "p2p"):
        lines.append(_("payload {payload} · wire {wire}").format(payload=style.human_bytes(e.nbytes),
                                                                  wire=style.human_bytes(e.wire_bytes))
                     + (f" · {e.numel} × {e.dtype}" if e.dtype else ""))
        if e.group:
            lines.append(_("group {group}").format(group=list(e.group)))
        if e.peer is not None:
            lines.append((_("root {peer}") if e.kind == "collective" else _("peer {peer}")).format(peer=e.peer))
    return "<br>".join(lines)


# ---------------------------------------------------------------------- timeline
def timeline(trace: Any, title: str | None = None, ranks: Sequence[int] | None = None, time_unit: str = "ms",
             show_labels: bool = False) -> go.Figure:
    """One lane per rank (rank 0 on top), one bar per event, coloured by kind and op.

    `ranks` picks and orders the lanes (default: every rank in the trace);
    `time_unit` is "s", "ms", "us", or "steps" for unitless schedule records;
    `show_labels` writes each event's label inside its bar."""
    if time_unit not in TIME_UNITS:
        raise ValueError(f"unknown time_unit {time_unit!r}; choose one of {sorted(TIME_UNITS)}")
    tr = as_trace(trace)
    if tr.hardware:   # a replayed trace (parlab.cluster.replay) says what it was replayed on
        title = (_("{title} (replayed on {hardware})").format(title=title, hardware=tr.hardware) if title
                 else _("replayed on {hardware}").format(hardware=tr.hardware))
    if not tr.events:
        return empty_figure(_("empty trace: nothing was recorded (run with parlab.run(..., trace=True) "
                              "and call parlab.comm / parlab.trace.region inside fn)"), title)
    scale, t0 = TIME_UNITS[time_unit], tr.t0
    lanes = list(ranks) if ranks is not None else tr.ranks
    lane_of = {r: i for i, r in enumerate(lanes)}

    # one plotly trace per colour: compute regions, then collectives, p2p and marks on top
    by_colour: dict[tuple[str, str], list[Event]] = {}
    for e in tr.events:
        if e.rank in lane_of:
            by_colour.setdefault((e.kind, "marks" if e.kind == "mark" else e.op), []).append(e)
    order = sorted(by_colour, key=lambda k: (style.KIND_ORDER.index(k[0]) if k[0] in style.KIND_ORDER else 9, k[1]))

    palette = style.colors(order)                     # no two regions of this figure share a colour
    group_titles = _group_titles()
    fig = go.Figure()
    for kind, op in order:
        evs = by_colour[(kind, op)]
        hover = [hover_text(e, t0, scale, time_unit) for e in evs]
        # group titles in the plural, so a region called "compute" is not listed as "compute" twice
        common = dict(name=_("marks") if kind == "mark" else style.op_label(op) if kind == "compute" else op,
                      legendgroup=kind,                       # "marks", a region's name: keys, shown translated
                      legendgrouptitle_text=group_titles.get(kind, kind),
                      hovertext=hover, hovertemplate="%{hovertext}<extra></extra>")
        if kind == "mark":
            fig.add_trace(go.Scatter(
                x=[(e.start - t0) * scale for e in evs], y=[lane_of[e.rank] for e in evs],
                mode="markers+text" if show_labels else "markers", text=[style.event_label(e.label) or e.op for e in evs],
                textposition="top center", marker=dict(symbol="diamond", size=10, color=style.MARK_COLOR),
                **common))
            continue
        colour = palette[(kind, op)]
        fig.add_trace(go.Bar(
            orientation="h",
            base=[(e.start - t0) * scale for e in evs],                              # bar starts at the event start
            x=[e.duration * scale for e in evs],                                     # ... and is as long as it took
            y=[lane_of[e.rank] + (ASYNC_SHIFT if e.asynchronous else 0.0) for e in evs],
            width=[ASYNC_WIDTH if e.asynchronous else SYNC_WIDTH for e in evs],
            # a 1-px outline in the bar's own colour keeps microsecond calls visible on a long axis
            marker=dict(color=colour, line=dict(color=colour, width=1)),
            text=[style.event_label(e.label) for e in evs] if show_labels else None, textposition="inside",
            insidetextanchor="middle", textfont=dict(size=12), **common))

    fig.update_layout(
        title=title, barmode="overlay", template="plotly_white", hovermode="closest",
        uniformtext=dict(minsize=10, mode="hide"),     # a label that would need < 10 px is left to the hover
        # tall enough for the lanes and for the legend (one row per trace, one title per kind)
        height=max(140 + 48 * len(lanes), 200 + 22 * (len(order) + len({k for k, _op in order}))),
        showlegend=True, legend=dict(groupclick="toggleitem"),   # a legend even when one op is shown
        xaxis=dict(title=_("time ({unit}) since the first event").format(unit=time_unit), zeroline=False),
        yaxis=dict(tickvals=list(range(len(lanes))), ticktext=[f"rank {r}" for r in lanes],
                   range=[len(lanes) - 0.5, -0.5], zeroline=False, showgrid=False))   # reversed: rank 0 on top
    return fig


# ---------------------------------------------------------------------- bytes per rank
def label_prefix(e: Event) -> str:
    """The label up to its first digit ("grad bucket 2" -> "grad bucket"), or "(op)" when unlabelled."""
    prefix = re.split(r"\d", e.label, maxsplit=1)[0].strip(" -:#>")
    return prefix or f"({e.op})"


def bytes_bars(trace: Any, by: str = "op", title: str | None = None) -> go.Figure:
    """Wire bytes each rank sent (ring model, `Event.wire_bytes`), stacked by op or by label prefix."""
    if by not in ("op", "label"):
        raise ValueError(f"by={by!r}: choose 'op' (stack by collective) or 'label' (stack by label prefix)")
    tr = as_trace(trace).comm()
    if not tr.events:
        return empty_figure(_("no communication in this trace: nothing was sent"), title)
    ranks = tr.ranks
    sent: dict[str, dict[int, float]] = {}
    for e in tr.events:
        key = e.op if by == "op" else style.event_label(label_prefix(e))
        sent.setdefault(key, dict.fromkeys(ranks, 0.0))[e.rank] += e.wire_bytes
    fig = go.Figure()
    for key in sorted(k for k in sent if any(sent[k].values())):   # recv and barrier send nothing
        ys = [sent[key][r] for r in ranks]
        fig.add_trace(go.Bar(
            x=[f"rank {r}" for r in ranks], y=ys, name=key,
            marker_color=style.COLLECTIVE_COLORS.get(key, style.P2P_COLORS.get(key)) if by == "op" else None,
            hovertext=[f"<b>{key}</b><br>" + _("rank {rank} sent {nbytes}").format(rank=r, nbytes=style.human_bytes(y))
                       for r, y in zip(ranks, ys)],
            hovertemplate="%{hovertext}<extra></extra>"))
    by_name = _("collective") if by == "op" else _("label")
    fig.update_layout(title=title or _("bytes sent per rank, by {by}").format(by=by_name), barmode="stack",
                      template="plotly_white",
                      yaxis=dict(title=_("bytes sent (ring model)"), tickformat=".3~s", ticksuffix="B"))
    return fig
