"""The group-grid figure on seed 000's example (2 nodes x 8 GPUs, tp=2, pp=4, dp=2): node boxes, the groups
of each dimension (dashed when they cross nodes), hover text, and a dropdown that works without Python."""
import plotly.io as pio
import pytest

from parlab.parallel.topology import ParallelGrid
from parlab.viz.grid import HIGHLIGHTS, gpu_positions, grid_figure

SEED_000 = ParallelGrid(16, tp=2, pp=4, gpus_per_node=8)


def visible_groups(fig):
    return [t for t in fig.data if t.visible and t.name != "GPU"]


def gpu_trace(fig):
    (gpus,) = [t for t in fig.data if t.name == "GPU"]
    return gpus


@pytest.mark.parametrize("dims, expected, dashed", [
    ("tp", [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]], False),
    ("dp", [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]], False),
    ("pp", [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]], True),
    ("tp-pp", [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]], True),
])
def test_seed_000_groups(dims, expected, dashed):
    fig = grid_figure(SEED_000, highlight=dims)
    shown = visible_groups(fig)
    assert [t.name.split("  ")[0] for t in shown] == [f"{dims} {g}" for g in expected]
    pos = gpu_positions(SEED_000)
    for t, g in zip(shown, expected):
        assert list(zip(t.x, t.y)) == [pos[r] for r in g]                 # drawn through its GPUs
        assert (t.line.dash == "dash") == dashed == ("crosses nodes" in t.name)
    assert len({t.line.color for t in shown}) == len(expected)           # a colour per group
    assert f"{len(expected)} group(s) of {len(expected[0])}" in fig.layout.title.text


def test_gpus_sit_in_their_node_boxes_with_labels_and_hover():
    fig = grid_figure(SEED_000)
    boxes = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(boxes) == 2 and [a.text for a in fig.layout.annotations] == ["<b>node 0</b>", "<b>node 1</b>"]
    gpus = gpu_trace(fig)
    assert fig.data[-1] is gpus                                           # drawn last: over the groups' lines
    assert len(gpus.x) == 16 and gpus.visible is not False
    for r, (x, y) in enumerate(zip(gpus.x, gpus.y)):
        box = boxes[SEED_000.node_of(r)]
        assert box.x0 < x < box.x1 and box.y0 < y < box.y1
    assert gpus.text[13].startswith("<b>13</b>") and gpus.text[13].endswith("1003")   # tp cp dp pp
    hover = gpus.hovertext[13]
    assert "node 1" in hover and "tp=1, cp=0, dp=0, pp=3" in hover
    assert "pp group: [1, 5, 9, 13] (crosses nodes)" in hover and "tp group: [12, 13]" in hover


def test_dropdown_switches_dimension_in_static_html():
    fig = grid_figure(SEED_000, highlight="tp")
    menu = fig.layout.updatemenus[0]
    assert [b.label for b in menu.buttons] == list(HIGHLIGHTS)
    for b in menu.buttons:
        vis = b.args[0]["visible"]
        assert len(vis) == len(fig.data) and vis[-1]                      # GPUs always shown
        chosen = [t.legendgroup for t, v in zip(fig.data[:-1], vis[:-1]) if v]
        assert chosen and set(chosen) == {b.label}
    html = pio.to_html(fig, include_plotlyjs=False, full_html=False)
    assert "updatemenus" in html and "crosses nodes" in html


def test_size_one_dimension_and_other_layouts():
    fig = grid_figure(SEED_000, highlight="cp")                          # cp = 1
    (note,) = visible_groups(fig)
    assert "cp = 1" in note.name
    wide = ParallelGrid(32, tp=16, pp=2, gpus_per_node=8)                # tp spans two nodes
    shown = visible_groups(grid_figure(wide, highlight="tp"))
    assert len(shown) == 2 and all(t.line.dash == "dash" for t in shown)
    assert len(grid_figure(ParallelGrid(64, tp=8, pp=8, gpus_per_node=8)).layout.shapes) == 8


def test_clear_errors():
    with pytest.raises(ValueError, match="unknown dimension"):
        grid_figure(SEED_000, highlight="xx")
    with pytest.raises(ValueError, match="one of"):
        grid_figure(SEED_000, highlight="pp-tp")
    with pytest.raises(ValueError, match="ParallelGrid"):
        grid_figure("tp=2")


def test_the_figure_gives_every_gpu_room_at_every_world_size():
    """Lesson 07's grid at world 64 once squeezed 8 nodes into 200 px of a 680 px figure (squares and labels on
    top of each other): the row length and the height now follow from the nodes, and a GPU's square keeps 30% of
    its pitch free. (Checked in Chromium at worlds 8, 16, 32 and 64.)"""
    from parlab.viz.grid import NODE_GAP, PLOT_H, PLOT_W, _fit, _layout_cols
    for world, gpn in ((8, 8), (16, 8), (32, 8), (64, 8), (128, 8), (16, 4)):
        grid = ParallelGrid(world, tp=2, gpus_per_node=gpn)
        npr, unit = _fit(grid, None, 46)
        cols, rows = _layout_cols(gpn), -(-gpn // _layout_cols(gpn))
        assert min(npr, grid.num_nodes) * (cols + NODE_GAP) * unit <= PLOT_W + 1e-9          # fits the width
        assert (-(-grid.num_nodes // npr) * (rows + NODE_GAP) + 0.3) * unit <= PLOT_H + 1e-9   # and the height
        size = gpu_trace(grid_figure(grid)).marker.size
        assert size == min(46, 0.7 * unit) and size >= 30, (world, size)                 # room, and legible
    assert _fit(ParallelGrid(16, tp=2, gpus_per_node=8), None, 46)[0] == 2               # two nodes side by side
