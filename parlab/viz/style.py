"""One look for every lesson: the colour of each kind of work, and how numbers are written.

Every figure in parlab colours an event the same way, so a student who learnt
"red is all-reduce" in lesson 2 still reads lesson 9 at a glance:

* compute spans are blues, keyed by region name: light blue forward, mid
  blue backward, navy optimizer; any other region name gets a stable colour
  of its own from a family of teals and purples, far from every other colour;
* each collective op has its own distinct colour (all-reduce red,
  reduce-scatter orange, all-gather green, ...);
* point-to-point messages are mustard (send) and pale yellow (recv);
* marks (instants) are black diamonds.

Pure Python: no plotly, no torch.
"""
from __future__ import annotations

import re
import zlib

from parlab.i18n import _
from parlab.trace import format_bytes

__all__ = ["COMPUTE_COLORS", "COLLECTIVE_COLORS", "P2P_COLORS", "MARK_COLOR", "OTHER_COLOR", "KIND_ORDER",
           "TOOLBAR_PX", "top_title", "color", "colors", "human_bytes", "op_label", "event_label"]

COMPUTE_COLORS: dict[str, str] = {
    "forward": "#9ecae1",
    "backward": "#4292c6",
    "optimizer": "#08306b",
    "untraced": "#bdbdbd",              # a replay's work outside every traced region (parlab.cluster.replay): grey, not blue
}
# other region names (loss, attention, ...): teals, purples and a deep blue, each at least 55 (RGB distance) from
# the fixed compute colours, every collective and p2p colour and white, and 75 from each other, so that a region
# never looks like backward (the old family had #3182bd, 25 from backward's #4292c6: the same blue on a projector)
_COMPUTE_FAMILY = ("#01665e", "#542788", "#2d004b", "#225ea8", "#00441b", "#66c2a4")

COLLECTIVE_COLORS: dict[str, str] = {
    "all_reduce": "#d62728",
    "reduce_scatter": "#ff7f0e",
    "all_gather": "#2ca02c",
    "all_to_all": "#9467bd",
    "broadcast": "#8c564b",
    "reduce": "#bcbd22",
    "gather": "#e377c2",
    "scatter": "#17becf",
    "barrier": "#7f7f7f",
}
P2P_COLORS: dict[str, str] = {"send": "#e6ab02", "recv": "#f7dc6f"}
MARK_COLOR = "#000000"
OTHER_COLOR = "#7f7f7f"

# Drawing order in a timeline: later kinds are drawn on top of earlier ones.
KIND_ORDER = ("compute", "collective", "p2p", "mark")

#: plotly's toolbar (the modebar: zoom, pan, download, ...) shows at a figure's top right while the mouse is over
#: the figure, from 2 to about 25 px below its top edge, over whatever is drawn there. Nothing of a parlab figure is
#: written in that band: a title plotly places itself sits in the middle of a top margin of at least 80 px, and one
#: placed at the very top (`top_title`) starts below the band. `parlab.course.figcheck` checks every lesson figure
#: against the toolbar as drawn (issue 39: long titles ran under it).
TOOLBAR_PX = 30


def top_title(text: str | None, several_lines: bool | None = None, **kw) -> dict:
    """A plotly title anchored at the figure's top edge, just below the toolbar's band (`TOOLBAR_PX`), so a title
    as long as the figure is wide stays readable when the toolbar shows; `kw` adds or overrides keys (x, font, ...).
    Plotly draws a title of several lines 12 px higher than its pad says: such a one (`several_lines`; by default
    when `text` holds a ``<br>``; an animation whose later frames do says so) gets 12 px more."""
    several = several_lines if several_lines is not None else bool(text and "<br>" in text)
    pad = TOOLBAR_PX + (12 if several else 0)
    return dict(text=text, y=1.0, yref="container", yanchor="top", pad=dict(t=pad)) | kw


def color(kind: str, op: str) -> str:
    """The colour of an event of this kind and op (compute: op is the region name)."""
    if kind == "compute":
        if op in COMPUTE_COLORS:
            return COMPUTE_COLORS[op]
        # crc32, not hash(): the same region name gets the same colour in every Python process
        return _COMPUTE_FAMILY[zlib.crc32(op.encode()) % len(_COMPUTE_FAMILY)]
    if kind == "collective":
        return COLLECTIVE_COLORS.get(op, OTHER_COLOR)
    if kind == "p2p":
        return P2P_COLORS.get(op, OTHER_COLOR)
    if kind == "mark":
        return MARK_COLOR
    return OTHER_COLOR


def colors(keys) -> dict[tuple[str, str], str]:
    """`color` for each (kind, op) of one figure, with no two compute regions sharing a colour: a region whose
    stable blue is already taken (two names can hash to the same one of the six) gets the next free one."""
    out: dict[tuple[str, str], str] = {}
    keys = list(dict.fromkeys(keys))
    taken = {color(k, op) for k, op in keys if k == "compute" and op in COMPUTE_COLORS}
    for kind, op in keys:
        c = color(kind, op)
        if kind == "compute" and op not in COMPUTE_COLORS:
            start = _COMPUTE_FAMILY.index(c)
            free = [_COMPUTE_FAMILY[(start + i) % len(_COMPUTE_FAMILY)] for i in range(len(_COMPUTE_FAMILY))]
            c = next((f for f in free if f not in taken), c)
            taken.add(c)
        out[(kind, op)] = c
    return out


def human_bytes(n: float) -> str:
    """4_000_000 -> '4.00 MB' (SI, powers of 1000, as `Trace.summary` writes them)."""
    return format_bytes(n)


def op_label(op: str) -> str:
    """How a legend names a compute region: the course's own region names in the language in force ("forward"
    is 前向 in Chinese), every other name (a collective, a region the student named) as it is in the trace."""
    names = {"forward": _("forward"), "backward": _("backward"), "optimizer": _("optimizer"), "loss": _("loss"),
             "untraced": _("untraced"), "grad sync": _("grad sync"), "ring attention": _("ring attention")}
    return names.get(op, op)


def event_label(label: str) -> str:
    """A label the course's own code writes (a trace label such as "scatter inputs" or "grad bucket 3", a memory
    category such as "optimizer state") in the language in force; any other label (one the student wrote) as it is."""
    names = {"scatter inputs": _("scatter inputs"), "scatter inputs (shape)": _("scatter inputs (shape)"),
             "replicate model": _("replicate model"), "gather outputs": _("gather outputs"),
             "scatter output grads": _("scatter output grads"), "reduce grads": _("reduce grads"),
             "grad bucket": _("grad bucket"), "wait for buckets": _("wait for buckets"),
             "rest of backward": _("rest of backward"), "parameters": _("parameters"), "gradients": _("gradients"),
             "optimizer state": _("optimizer state"), "inputs": _("inputs"), "activations": _("activations"),
             "outputs": _("outputs"), "output grads": _("output grads"), "grad buckets": _("grad buckets"),
             # expert parallelism's calls (parlab.parallel.expert: comm.py, grads.py)
             "ep counts": _("ep counts (tokens per expert)"), "ep dispatch": _("ep dispatch (tokens out)"),
             "ep combine": _("ep combine (tokens back)"),
             "ep dispatch backward": _("ep dispatch, backward"), "ep combine backward": _("ep combine, backward"),
             "ep grads dense": _("ep dense gradients"), "ep grads": _("ep expert gradients"),
             "ep grad norm": _("ep gradient norm")}
    if label in names:
        return names[label]
    if m := re.fullmatch(r"grad bucket (\d+)", label):
        return _("grad bucket {i}").format(i=m[1])
    if m := re.fullmatch(r"until bucket (\d+) ready", label):
        return _("until bucket {i} ready").format(i=m[1])
    return label
