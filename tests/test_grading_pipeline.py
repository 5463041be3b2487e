"""Exercise 05's checks bite: parlab's own answers pass, and the mistakes students make fail with a message that
names the problem. Plus the pipeline figures of parlab.viz.pipeline (fast, no ranks).

The wrong 1F1B orders below: GPipe's order, one warm-up forward too many or too few, the steady state's B before
its F (deadlock on the last stage), the cool-down forgotten, every rank writing stage 0. The wrong bubbles: the
other convention, v ignored, a percentage.
"""
import pytest

from parlab.parallel import pipeline as sch
from parlab.course.grading import pipeline as grading
from parlab.viz import pipeline as vp


def reference(p, m, r):
    """1F1B written by hand (warm-up p - r - 1 forwards, steady F/B pairs, cool-down), as a student would."""
    return _one_f_one_b(p, m, r, p - r - 1)


def gpipe(p, m, r):
    return [f"{r}F{i}" for i in range(m)] + [f"{r}B{i}" for i in range(m)]


def _one_f_one_b(p, m, r, warmup, b_first=False, cooldown=True):
    warmup = max(0, min(warmup, m))
    acts = [f"{r}F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        pair = [f"{r}F{warmup + i}", f"{r}B{i}"]
        acts += pair[::-1] if b_first else pair
    return acts + ([f"{r}B{i}" for i in range(m - warmup, m)] if cooldown else [])


def warmup_too_long(p, m, r):
    return _one_f_one_b(p, m, r, p - r)


def warmup_too_short(p, m, r):
    return _one_f_one_b(p, m, r, p - r - 2)


def backward_first(p, m, r):
    return _one_f_one_b(p, m, r, p - r - 1, b_first=True)


def no_cooldown(p, m, r):
    return _one_f_one_b(p, m, r, p - r - 1, cooldown=False)


def always_stage_0(p, m, r):
    return [a.replace(f"{r}", "0", 1) for a in reference(p, m, r)]


def not_written(p, m, r):
    raise NotImplementedError


# ---------------------------------------------------------------------- part 1: the 1F1B order
def test_reference_order_passes_every_check_and_runs_on_the_executor(capsys):
    grading.check_1f1b_valid(reference)                # includes the real 4-rank run against the unsplit model
    grading.check_1f1b_reference(reference)
    grading.check_1f1b_bubble(reference)
    out = capsys.readouterr().out
    assert "runs on 4 ranks" in out and "equals parlab's 1F1B" in out and "bubble" in out


def test_actions_may_be_returned_as_action_objects_or_one_string():
    grading.check_1f1b_reference(lambda p, m, r: [sch.Action.parse(a) for a in reference(p, m, r)])


def test_calling_parlabs_schedule_is_rejected():
    with pytest.raises(AssertionError, match="you called parlab's one_f_one_b; write your own"):
        grading.check_1f1b_reference(lambda p, m, r: list(sch.one_f_one_b(p, m).actions[r]))
    assert sch.one_f_one_b(2, 2).actions                    # restored afterwards
    grading.check_1f1b_reference(lambda p, m, r: " ".join(reference(p, m, r)))


@pytest.mark.parametrize("fn, says", [
    (backward_first, "deadlock"),
    (no_cooldown, "is missing|needs either one B"),
    (always_stage_0, "lives on rank"),
    (not_written, "not written yet"),
    (lambda p, m, r: 42, "returned int"),
    (lambda p, m, r: ["0X1"], "cannot read action"),
])
def test_invalid_orders_fail_the_validity_check(fn, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_1f1b_valid(fn, run_case=None)


def test_valid_but_different_orders_pass_validity_and_fail_equality():
    for fn in (gpipe, warmup_too_long, warmup_too_short):
        grading.check_1f1b_valid(fn, run_case=None)     # valid schedules, just not 1F1B
    with pytest.raises(AssertionError, match="GPipe's order"):
        grading.check_1f1b_reference(gpipe)
    with pytest.raises(AssertionError, match=r"(?s)You run 3 forwards before the first backward; 1F1B runs p - r = 2"):
        grading.check_1f1b_reference(warmup_too_long)
    with pytest.raises(AssertionError, match=r"(?s)expected .*got .*Hint: rank r runs min\(p - r - 1, m\)"):
        grading.check_1f1b_reference(warmup_too_short)


def test_bubble_check_rejects_gpipe_memory_and_a_short_warm_up():
    with pytest.raises(AssertionError, match=r"bubble is right, but rank 0 keeps \d+ micro-batches"):
        grading.check_1f1b_bubble(gpipe)
    with pytest.raises(AssertionError, match=r"idles .* of the step .* 1F1B idles \(p-1\)/\(m\+p-1\)"):
        grading.check_1f1b_bubble(warmup_too_short)
    with pytest.raises(AssertionError, match="micro-batches"):   # one forward too many holds one more
        grading.check_1f1b_bubble(warmup_too_long)
    with pytest.raises(AssertionError, match="deadlock"):
        grading.check_1f1b_bubble(backward_first)


# ---------------------------------------------------------------------- part 2: the bubble formulas
def of_step(p, m, v=1):
    return (p - 1) / (v * m + p - 1)


def over_ideal(p, m, v=1):
    return (p - 1) / (v * m)


def test_reference_formulas_pass(capsys):
    grading.check_bubble_of_step(of_step)
    grading.check_bubble_over_ideal(over_ideal)
    assert capsys.readouterr().out.count("matches the simulation") == 2


@pytest.mark.parametrize("check, fn, says", [
    (grading.check_bubble_of_step, over_ideal, "other convention, idle time over the ideal"),
    (grading.check_bubble_over_ideal, of_step, "other convention, the fraction of the whole step"),
    (grading.check_bubble_of_step, lambda p, m, v=1: (p - 1) / (m + p - 1), "without interleaving"),
    (grading.check_bubble_over_ideal, lambda p, m, v=1: (p - 1) / m, "without interleaving"),
    (grading.check_bubble_of_step, lambda p, m, v=1: 100 * of_step(p, m, v), "percentage"),
    (grading.check_bubble_of_step, lambda p, m, v=1: (p - 1) / (v * m + p), r"simulation of .* gives"),
    (grading.check_bubble_over_ideal, lambda p, m, v=1: "big", "return a number"),
    (grading.check_bubble_over_ideal, lambda p, m, v=1: 1 / 0, "raised ZeroDivisionError"),
])
def test_wrong_formulas_are_rejected_with_a_reason(check, fn, says):
    with pytest.raises(AssertionError, match=says):
        check(fn)


# ---------------------------------------------------------------------- parlab.viz.pipeline
def test_schedule_timeline_draws_one_cell_per_action_with_its_micro_batch():
    sim = sch.simulate(sch.zero_bubble_h1(3, 4))
    fig = vp.schedule_timeline(sim.spans, title="zb")
    cells = sum(len(t.x) for t in fig.data)
    assert cells == sum(map(len, sim.schedule.actions))
    assert {t.name for t in fig.data} == {vp.KIND_NAMES[k] for k in "FIW"}
    f = next(t for t in fig.data if t.name.startswith("F"))
    assert sorted(map(int, f.text)) == sorted(i for i in range(4) for _ in range(3))   # mb numbers in the cells
    assert f.marker.color == vp.KIND_COLORS["F"]


def test_overlay_adds_the_schedule_as_outlines_and_scale_converts_seconds():
    sim = sch.simulate(sch.one_f_one_b(2, 2))
    measured = {r: [(2 * t0, 2 * t1, a) for t0, t1, a in sp] for r, sp in enumerate(sim.spans)}   # "seconds"
    fig = vp.schedule_timeline(measured, scale=0.5, overlay=sim.spans)
    outline = next(t for t in fig.data if t.name.startswith("scheduled"))
    assert outline.marker.color == "rgba(0,0,0,0)"
    drawn = sorted(b for t in fig.data if t is not outline for b in t.base)
    assert drawn == sorted(outline.base)                  # scaled measured cells sit exactly on the schedule


def test_overlay_outlines_are_drawn_under_the_cells_and_stick_out_around_them():
    """Issue 39: the red outlines were drawn over the measured cells, and a measured run shifted against its
    schedule put an outline's side across a cell's micro-batch number. Drawn first (under the opaque cells) and
    taller than a cell, the outline still shows above, below and between the cells, never across a number."""
    sim = sch.simulate(sch.one_f_one_b(4, 8))
    late = {r: [(t0 + 0.4, t1 + 0.4, a) for t0, t1, a in sp] for r, sp in enumerate(sim.spans)}
    fig = vp.schedule_timeline(late, overlay=sim.spans)
    assert fig.data[0].name.startswith("scheduled")                                    # drawn first: under
    cells = fig.data[1:]
    assert all(t.text is not None and t.marker.line.color == "white" for t in cells)   # opaque cells, numbers
    assert all(fig.data[0].width - t.width >= 0.2 for t in cells)                      # edges show around them
    assert fig.data[0].legendrank > max(t.legendrank or 1000 for t in cells)           # still last in the legend


def test_schedules_figure_stacks_panels_and_hatches_interleaved_chunks():
    panels = {"1F1B": sch.simulate(sch.one_f_one_b(2, 4)).spans,
              "interleaved": sch.simulate(sch.interleaved_1f1b(2, 4, 2)).spans}
    fig = vp.schedules_figure(panels, title="two")
    assert [a.text for a in fig.layout.annotations] == ["1F1B", "interleaved"]
    chunk1 = [t for t in fig.data if "chunk 1" in t.name]
    assert chunk1 and all(t.marker.pattern.shape == "/" for t in chunk1)
    names = [t.name for t in fig.data if t.showlegend]
    assert len(names) == len(set(names))                  # each kind once in the legend


def test_peak_bars_one_group_per_schedule():
    fig = vp.peak_bars({"GPipe": [8, 8], "1F1B": [2, 1]})
    assert [t.name for t in fig.data] == ["GPipe", "1F1B"] and list(fig.data[1].y) == [2, 1]


def test_explorer_legend_sits_below_the_axis_title_at_every_size_and_chunk_colours_stay_apart():
    """Lesson 05's explorer at p = 2 put the legend (a fraction of a short plot below it) on the x axis's title, and
    at v = 4 forward's chunk 3 and backward's chunk 2 were one colour (38 apart in RGB; figcheck wants 40)."""
    import itertools
    import math
    for p, schedule in ((2, sch.dualpipe_v(2, 8)), (4, sch.interleaved_1f1b(4, 8, 4)), (8, sch.one_f_one_b(8, 1))):
        fig = vp.schedule_timeline(sch.simulate(schedule).spans, ranks=p)
        plot_px = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
        assert fig.layout.legend.yanchor == "top" and -fig.layout.legend.y * plot_px == pytest.approx(vp.LEGEND_TOP)
        rows = -(-sum(bool(t.showlegend) for t in fig.data) // vp.LEGEND_PER_ROW)
        assert fig.layout.margin.b >= vp.LEGEND_TOP + 24 * rows
    colours = [vp._shade(vp.KIND_COLORS[k], c, vp.SHADE_STEP[k]) for k in "FB" for c in range(4)]
    colours += [vp._shade(vp.KIND_COLORS[k], c, vp.SHADE_STEP[k]) for k in "IW" for c in range(2)]   # ZB, DualPipeV
    rgb = [[int(h[i:i + 2], 16) for i in (1, 3, 5)] for h in colours]
    assert min(math.dist(a, b) for a, b in itertools.combinations(rgb, 2)) >= 40
