"""The group grid: which GPUs work together along each parallel dimension, and which groups leave a node.

`grid_figure(grid)` draws every GPU of a `parlab.parallel.topology.ParallelGrid` as a square inside its node's
box, labelled with its global rank and its (tp, cp, dp, pp) coordinates. The groups of one dimension
are drawn on top: each group gets its own colour, an outline around each of its GPUs and a line
through them in rank order. A group whose GPUs sit on more than one node is drawn **dashed** and
marked "crosses nodes" in the legend: its traffic leaves NVLink for the slower network. Hovering a
GPU lists all its groups. A dropdown switches the highlighted dimension (tp, cp, dp, pp, or tp-pp,
the model-parallel groups) in the browser, so the figure works in a static HTML export too.

Seed 000's example (Megatron's docstring): 2 nodes x 8 GPUs, tp=2, pp=4, hence dp=2::

    from parlab.parallel.topology import ParallelGrid
    from parlab.viz.grid import grid_figure
    grid_figure(ParallelGrid(16, tp=2, pp=4, gpus_per_node=8), highlight="pp")

shows the tp pairs [0, 1], [2, 3], ... inside the nodes, and the four pp groups [0, 4, 8, 12], ...
dashed across both nodes: TP (the most traffic) stays on NVLink, PP (the least) crosses nodes.

References: Narayanan et al., arXiv:2104.04473, section 3 (placement); Megatron-LM
``parallel_state.initialize_model_parallel``; seed 000. Plotly graph_objects only; never communicates.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.colors import qualitative

from parlab.i18n import _
from parlab.parallel.topology import ParallelGrid, parse_dims

__all__ = ["grid_figure", "gpu_positions", "HIGHLIGHTS"]

#: The dimensions the dropdown offers ("tp-pp": one model replica per group).
HIGHLIGHTS = ("tp", "cp", "dp", "pp", "tp-pp")
GROUP_COLORS = qualitative.Dark24 + qualitative.Light24   # one colour per group, cycled beyond 48
NODE_GAP = 0.8        # space between node boxes, in GPU widths
PAD = 0.45            # node box margin around its GPUs


def _layout_cols(gpus_per_node: int) -> int:
    """GPU columns inside a node box: 8 GPUs -> 4 x 2, 4 -> 2 x 2, 16 -> 4 x 4."""
    cols = 1
    while cols * cols < gpus_per_node:
        cols *= 2
    return min(cols, gpus_per_node)


def gpu_positions(grid: ParallelGrid, nodes_per_row: int = 4) -> dict[int, tuple[float, float]]:
    """(x, y) centre of every rank's square: nodes left to right (wrapping after `nodes_per_row`), ranks
    row by row inside a node. y grows upwards in plotly, so rows are placed at negative y."""
    gpn = grid.gpus_per_node
    cols = _layout_cols(gpn)
    rows = -(-gpn // cols)
    pos = {}
    for r in range(grid.world_size):
        node, local = divmod(r, gpn)
        ny, nx = divmod(node, nodes_per_row)
        x = nx * (cols + NODE_GAP) + local % cols
        y = -(ny * (rows + NODE_GAP) + local // cols)
        pos[r] = (float(x), float(y))
    return pos


def _memberships(grid: ParallelGrid, rank: int) -> str:
    c = grid.coords(rank)
    lines = [_("<b>rank {rank}</b> on node {node}").format(rank=rank, node=grid.node_of(rank)),
             _("coords: {coords}").format(coords=", ".join(f"{d}={c[d]}" for d in ("tp", "cp", "dp", "pp")))]
    for dims in HIGHLIGHTS:
        g = grid.group_of(rank, dims)
        line = _("{dims} group: {group} (crosses nodes)") if grid.crosses_nodes(g) else _("{dims} group: {group}")
        lines.append(line.format(dims=dims, group=g))
    return "<br>".join(lines)


def _group_traces(grid: ParallelGrid, dims: str, pos: dict, marker_size: float) -> list[go.Scatter]:
    """One trace per group of `dims`: open squares around its GPUs and a line through them."""
    groups = grid.groups(dims)
    if len(groups[0]) == 1:                     # size 1: nothing to connect; one legend-only note
        return [go.Scatter(x=[None], y=[None], mode="markers",
                           name=_("{dims} = 1: every GPU is its own group").format(dims=dims),
                           legendgroup=dims, marker=dict(color="#7f7f7f"), hoverinfo="skip")]
    traces = []
    for i, g in enumerate(groups):
        crosses = grid.crosses_nodes(g)
        color = GROUP_COLORS[i % len(GROUP_COLORS)]
        shown = g if len(g) <= 8 else g[:4] + ["..."] + g[-2:]
        name = _("{dims} {group}  - - crosses nodes") if crosses else "{dims} {group}"
        traces.append(go.Scatter(
            x=[pos[r][0] for r in g], y=[pos[r][1] for r in g], mode="lines+markers",
            name=name.format(dims=dims, group=shown), legendgroup=dims,
            line=dict(color=color, width=3, dash="dash" if crosses else "solid"),
            marker=dict(symbol="square-open", size=marker_size + 8, color=color, line=dict(width=3)),
            opacity=0.85, hovertext=[(_("{dims} group {group} crosses nodes") if crosses else
                                      _("{dims} group {group} (one node)")).format(dims=dims, group=g)] * len(g),
            hovertemplate="%{hovertext}<extra></extra>"))
    return traces


PLOT_W, PLOT_H = 860, 560   # the plot area the figure sizes itself for (a notebook's output at 1440 x 900)


def _fit(grid: ParallelGrid, nodes_per_row: int | None, gpu_size: float) -> tuple[int, float]:
    """(nodes per row, pixels per GPU width): the shortest figure whose GPUs get `gpu_size` pixels with 3/7
    of that between them inside PLOT_W x PLOT_H; where no row length allows that, the one that shows them
    largest (a given `nodes_per_row` is kept)."""
    gpn = grid.gpus_per_node
    cols = _layout_cols(gpn)
    rows = -(-gpn // cols)
    wanted, options = gpu_size / 0.7, []
    for npr in ([nodes_per_row] if nodes_per_row else range(1, grid.num_nodes + 1)):
        width = min(npr, grid.num_nodes) * (cols + NODE_GAP)               # in GPU widths, boxes and gaps
        height = -(-grid.num_nodes // npr) * (rows + NODE_GAP) + 0.3       # + the node labels
        unit = min(PLOT_W / width, PLOT_H / height, wanted)
        options.append((unit < wanted, -unit if unit < wanted else height, npr, unit))
    _short, _key, npr, unit = min(options)
    return npr, unit


def grid_figure(grid: ParallelGrid, highlight: str = "tp", nodes_per_row: int | None = None,
                title: str | None = None, gpu_size: float = 46) -> go.Figure:
    """GPUs in node boxes, `highlight`'s groups in colour (dashed if they cross nodes), a dropdown to switch.

    `highlight` is one of ``HIGHLIGHTS`` ("tp", "cp", "dp", "pp", "tp-pp"); nodes come from
    ``grid.gpus_per_node``. `nodes_per_row` (default: the row length that shows the GPUs largest) and the
    height follow from the number of nodes, and a GPU's square shrinks below `gpu_size` pixels only where its
    neighbours would otherwise touch it (64 GPUs: 8 nodes in rows of 3). The legend sits under the grid.
    Returns a plotly Figure (``fig.write_html(path)`` keeps the dropdown)."""
    if not isinstance(grid, ParallelGrid):
        raise ValueError(f"grid_figure needs a parlab.parallel.topology.ParallelGrid, got {type(grid).__name__}")
    if highlight not in HIGHLIGHTS:
        parse_dims(highlight)   # a clear error for unknown names first
        raise ValueError(f"highlight must be one of {HIGHLIGHTS}, got {highlight!r}")
    nodes_per_row, unit = _fit(grid, nodes_per_row, gpu_size)
    gpu_size = min(gpu_size, 0.7 * unit)                 # pixels: 30% of the pitch stays between squares
    pos = gpu_positions(grid, nodes_per_row)
    gpn = grid.gpus_per_node
    fig = go.Figure()
    # node boxes: one rectangle per node, around its GPUs
    for n in range(grid.num_nodes):
        xs = [pos[r][0] for r in range(n * gpn, (n + 1) * gpn)]
        ys = [pos[r][1] for r in range(n * gpn, (n + 1) * gpn)]
        fig.add_shape(type="rect", x0=min(xs) - PAD - 0.1, x1=max(xs) + PAD + 0.1, y0=min(ys) - PAD - 0.1,
                      y1=max(ys) + PAD + 0.25, line=dict(color="#444", width=2), fillcolor="#f4f4f4", layer="below")
        fig.add_annotation(x=min(xs) - PAD, y=max(ys) + PAD + 0.25, text=_("<b>node {node}</b>").format(node=n),
                           showarrow=False,
                           xanchor="left", yanchor="bottom", font=dict(size=12))
    # every dimension's group traces; only the highlighted dimension's are visible. They go first, under the GPUs:
    # a GPU's white square then hides the part of a group's line that would cross its label, and the line shows
    # between the squares, with the group's open square as a ring around each member
    owner: list[str | None] = []
    for dims in HIGHLIGHTS:
        traces = _group_traces(grid, dims, pos, gpu_size)
        for t in traces:
            t.visible = dims == highlight
            fig.add_trace(t)
        owner += [dims] * len(traces)
    # the GPUs: always visible, on top
    ranks = list(range(grid.world_size))
    coords = [grid.coords(r) for r in ranks]
    fig.add_trace(go.Scatter(
        x=[pos[r][0] for r in ranks], y=[pos[r][1] for r in ranks], mode="markers+text", name="GPU",
        marker=dict(symbol="square", size=gpu_size, color="white", line=dict(color="#222", width=1.5)),
        text=[f"<b>{r}</b><br>{c['tp']}{c['cp']}{c['dp']}{c['pp']}" for r, c in zip(ranks, coords)],
        textfont=dict(size=10), hovertext=[_memberships(grid, r) for r in ranks],
        hovertemplate="%{hovertext}<extra></extra>", showlegend=False))
    owner.append(None)

    def heading(dims: str) -> str:
        gs = grid.groups(dims)
        crossing = sum(grid.crosses_nodes(g) for g in gs)
        return _("{title}<br><sub>{dims}: {groups} group(s) of {size}, {crossing} cross nodes (dashed); GPU label: "
                 "rank, then tp cp dp pp coords</sub>").format(title=title or f"{grid!r}", dims=dims, groups=len(gs),
                                                               size=len(gs[0]), crossing=crossing)

    buttons = [dict(label=dims, method="update",
                    args=[{"visible": [o is None or o == dims for o in owner]}, {"title.text": heading(dims)}])
               for dims in HIGHLIGHTS]
    xs, ys = [x for x, _y in pos.values()], [y for _x, y in pos.values()]
    plot_h = unit * (max(ys) - min(ys) + 2 * PAD + 0.6)                 # the boxes, their labels: as drawn
    entries = max(len(grid.groups(d)) if len(grid.groups(d)[0]) > 1 else 1 for d in HIGHLIGHTS)
    legend_h = 26 + 21 * -(-min(entries, 48) // 3)                      # three entries a row under the grid
    fig.update_layout(
        title=dict(text=heading(highlight)), template="plotly_white", hovermode="closest",
        updatemenus=[dict(type="dropdown", buttons=buttons, active=HIGHLIGHTS.index(highlight), x=1, xanchor="right",
                          y=1.0, yanchor="bottom", showactive=True)],
        xaxis=dict(visible=False, scaleanchor="y", scaleratio=1), yaxis=dict(visible=False),
        legend=dict(title=_("groups"), itemclick="toggle", orientation="h", x=0, xanchor="left", y=0,
                    yanchor="top", traceorder="normal"),     # normal: a legendgroup's entries flow in rows too
        height=int(plot_h + 110 + legend_h),
        margin=dict(t=110, b=legend_h, l=40, r=40))
    return fig
