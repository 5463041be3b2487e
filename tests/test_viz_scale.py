"""parlab.viz.scale: the lesson 08 figures draw what they are given, and keep their axes within the data."""
import math

from parlab.viz import scale as vs


def test_speedup_figure_draws_ideal_over_the_measured_ranks_only():
    fig = vs.speedup_figure({"measured": {1: 1.0, 2: 1.5, 4: 1.2}})
    ideal, measured = fig.data
    assert list(ideal.x) == [1, 2, 4] and list(ideal.y) == [1, 2, 4]
    assert list(measured.y) == [1.0, 1.5, 1.2]


def test_working_set_figure_marks_only_caches_inside_the_measured_range_at_log10():
    fig = vs.working_set_figure([2**18, 2**26], [0.1, 1.0], {"L1 32K": 2**15, "L2 1024K": 2**20})
    assert len(fig.layout.shapes) == 1 and fig.layout.shapes[0].x0 == 2**20      # L1 lies below the range
    (note,) = fig.layout.annotations
    assert note.text == "L2 1024K" and math.isclose(note.x, math.log10(2**20))   # log axes place text at log10


def test_bubble_figure_colours_the_microbatch_counts_that_break_the_rule():
    fig = vs.bubble_vs_microbatches([2, 4, 8], [0.6, 0.43, 0.27], [2, 4, 4], stages=4)
    bars = fig.data[0]
    assert bars.marker.color[0] != bars.marker.color[1] == bars.marker.color[2]   # only m = 2 < p is red


def test_resume_figure_spans_the_reference_steps():
    fig = vs.resume_figure([3.0, 2.5, 2.0, 1.8], {"resumed": {2: 2.0, 3: 1.8}}, crash_step=3, checkpoint_step=2)
    assert list(fig.layout.xaxis.range) == [-0.5, 3.5]
    assert [d.name for d in fig.data] == ["uninterrupted", "resumed"]


def test_working_set_axis_is_labelled_in_binary_units_at_the_measured_sizes():
    fig = vs.working_set_figure([2**18, 2**20, 2**26], [0.1, 0.2, 1.0])
    assert list(fig.layout.xaxis.ticktext) == ["256 KiB", "1 MiB", "64 MiB"]     # not "1M" (SI) under a 1 MiB cache
    assert "KiB" in fig.layout.xaxis.title.text and vs.iec_bytes(1.5 * 2**20) == "1.5 MiB"
