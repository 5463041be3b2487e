"""Figures as a student sees them: drawn by plotly.js in headless Chromium and checked from the page
(`parlab.course.figcheck`). First the checker itself, on figures made to fail each rule; then real lessons.

Needs Debian's `chromium` package (.ci/run installs it) and the playwright Python package (a dependency).
Every lesson is executed and checked here, the suite's only run of the lessons; `python -m parlab.course.figcheck` does the
same by hand and writes a screenshot of each figure for a person to look at.
"""
import json
from pathlib import Path

import nbformat
import plotly.graph_objects as go
import pytest
from plotly.subplots import make_subplots

import lesson_tables
from parlab import viz
from parlab.trace import Event
from parlab.course import figcheck as check, figpage

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(check.chromium_path() is None,
                                reason="needs Debian's chromium (apt-get install -y chromium); .ci/run installs it")


@pytest.fixture(scope="module")
def browser(chromium):
    """One Chromium page with plotly.js loaded for all of the module's checks, and the Chinese lessons' too
    (tests/conftest.py `chromium`: starting Chromium and loading plotly.js cost ~3 CPU s, once, not per check)."""
    return chromium


def _problems(browser, tmp_path, *figs, labels=()):
    shown = [check.Figure("t", i, 0, json.loads(f.to_json())) for i, f in enumerate(figs)]
    label_problems = check.check_pages(shown, list(labels), tmp_path, browser=browser)
    return [f.problems for f in shown], label_problems


def test_checker_finds_each_kind_of_problem(browser, tmp_path):
    overlap = make_subplots(rows=1, cols=4, horizontal_spacing=0.01,
                            subplot_titles=[f"a long subplot title number {i}" for i in range(4)])
    for c in range(1, 5):
        overlap.add_trace(go.Scatter(x=[0, 1], y=[0, 1]), row=1, col=c)
    log_marker = go.Figure(go.Scatter(x=[3, 1000], y=[1, 2]))        # a vline label on a log axis, as lesson 07 had
    log_marker.add_vline(x=76, annotation_text="usable 76 GB")
    log_marker.update_xaxes(type="log")
    twice = go.Figure([go.Bar(x=["a"], y=[1], name="all_reduce"), go.Bar(x=["b"], y=[2], name="all_reduce")])
    tiny = go.Figure(go.Scatter(x=[0, 1], y=[0, 1], mode="text", text=["tiny", "tiny"], textfont_size=7))
    cut = go.Figure(go.Scatter(x=[0, 1], y=[0, 1]))
    cut.update_layout(title="a title far too long for its figure " * 6, width=500)
    off_plot = go.Figure(go.Scatter(x=[1, 100], y=[1, 2]))          # lesson 06 had c* labelled at the raw value
    off_plot.update_xaxes(type="log", range=[0, 2])
    off_plot.add_annotation(x=50, y=1.5, text="c*", showarrow=False)   # 50 read as 10^50: not drawn
    far_zero = go.Figure(go.Scatter(x=[1, 2, 3], y=[0.09, 0.2, 0.26]))    # flat data, an axis forced to 0
    far_zero.update_yaxes(range=[0, 0.28])
    clean = go.Figure(go.Bar(x=["a", "b"], y=[1, 2], name="bytes"))
    clean.update_layout(title="a short title", yaxis_title="bytes", height=300)
    labels = [{"notebook": "t", "cell": 0, "description": "microbatches per step", "width": "80px"},
              {"notebook": "t", "cell": 0, "description": "m", "width": "80px"}]
    baseline = go.Figure(go.Scatter(x=[1, 2, 3], y=[0.09, 0.2, 0.26]))    # the same, asking for a zero baseline
    baseline.update_yaxes(rangemode="tozero")
    (p_overlap, p_log, p_twice, p_tiny, p_cut, p_off, p_far, p_base, p_clean), p_labels = _problems(
        browser, tmp_path, overlap, log_marker, twice, tiny, cut, off_plot, far_zero, baseline, clean, labels=labels)
    assert any("annotation" in p and "overlaps" in p for p in p_overlap), p_overlap      # subplot titles
    assert any(p.startswith("xaxis runs") for p in p_log), p_log
    assert any('legend lists "all_reduce" twice' in p for p in p_twice), p_twice
    assert any("smaller than 10 px" in p and "tiny" in p for p in p_tiny), p_tiny
    assert any("cut off" in p for p in p_cut), p_cut
    assert any('annotation "c*" is not drawn' in p and "log10" in p for p in p_off), p_off
    assert any(p.startswith("yaxis runs 0.00..0.280") for p in p_far), p_far
    assert p_base == [] and p_clean == []                              # lesson 08's cache curve when it is flat
    assert len(p_labels) == 1 and "microbatches per step" in p_labels[0]
    assert len(list(tmp_path.rglob("*.png"))) == 9                   # a screenshot per figure


def test_checker_finds_legend_colours_scrolling_legends_and_single_digit_log_labels(browser, tmp_path):
    """Lesson 02's replay figure had "grad sync" and "untraced" in the same blue (their names hash to it); lesson
    07's planner figure labelled 20 s as "2" (plotly's minor log labels)."""
    same = go.Figure([go.Bar(x=[1], y=["a"], orientation="h", name="grad sync", marker_color="#08519c"),
                      go.Bar(x=[2], y=["a"], orientation="h", name="untraced", marker_color="#08519c")])
    dashed = go.Figure([go.Scatter(x=[0, 1], y=[0, 1], name="measured", line_color="grey"),      # told apart
                        go.Scatter(x=[0, 1], y=[0, 2], name="ideal", line=dict(color="grey", dash="dash"))])
    # lesson 02's naive timeline drew "loss" in #3182bd beside backward's #4292c6 (RGB distance 25): one blue
    near = go.Figure([go.Bar(x=[1], y=["a"], orientation="h", name="backward", marker_color="#4292c6"),
                      go.Bar(x=[2], y=["a"], orientation="h", name="loss", marker_color="#3182bd")])
    ev = [Event(rank=r, kind="compute", op=op, start=s, end=s + 1.0) for r in (0, 1)
          for s, op in ((0.0, "grad sync"), (1.0, "untraced"), (2.0, "wait"), (3.0, "loss"), (4.0, "backward"))]
    digits = go.Figure(go.Scatter(x=[1, 2], y=[15, 250]))
    digits.update_yaxes(type="log")
    from parlab.viz.planner import _ticks_125
    full = go.Figure(go.Scatter(x=[1, 2], y=[15, 250]))
    full.update_yaxes(type="log", minorloglabels="none", tickvals=_ticks_125([15, 250]))
    scrolls = go.Figure([go.Scatter(x=[0, 1], y=[i, i], name=f"series {i}") for i in range(30)])
    scrolls.update_layout(height=300)                     # lesson 07's planner legend scrolled at 520 px
    (p_same, p_near, p_dashed, p_timeline, p_digits, p_full, p_scrolls), _ = _problems(
        browser, tmp_path, same, near, dashed, viz.timeline(ev), digits, full, scrolls)
    assert [p.split(" have ")[0] for p in p_near] == ['legend entries "backward" and "loss"'], p_near
    assert any(p.startswith("legend does not fit the figure's height") for p in p_scrolls), p_scrolls
    assert p_digits[0].startswith('yaxis labels 20.0 as "2"'), p_digits          # (and small: 9 px)
    assert p_full == [], p_full
    assert p_same == ['legend entries "grad sync" and "untraced" have the same colour rgb(8, 81, 156)'], p_same
    assert p_dashed == [] and p_timeline == [], (p_dashed, p_timeline)     # the timeline gives each its own


def test_checker_finds_bar_labels_crossed_by_an_outline_and_lesson_05s_overlay_has_none(browser, tmp_path):
    """Issue 39: lesson 05's measured-vs-scheduled figure drew the schedule's red outlines over the measured
    cells; a run later than its schedule put an outline's side through a micro-batch number."""
    from parlab.parallel import pipeline as sch
    from parlab.viz import pipeline as vp
    sim = sch.simulate(sch.one_f_one_b(4, 8))
    late = {r: [(t0 * 1.15 + 0.3 * r, t1 * 1.15 + 0.3 * r - 0.1, a) for t0, t1, a in sp]   # a busy machine's run
            for r, sp in enumerate(sim.spans)}
    fig = vp.schedule_timeline(late, overlay=sim.spans, title="measured vs scheduled")
    over = go.Figure(layout=fig.layout)
    over.add_traces(list(fig.data[1:]) + [fig.data[0]])                      # the outline drawn last, on top
    (p_over, p_fig), _ = _problems(browser, tmp_path, over, fig)
    assert any("bar labels crossed by a bar or shape drawn over them" in p for p in p_over), p_over
    assert p_fig == []

def test_checker_finds_text_under_plotlys_toolbar_and_parlabs_top_titles_clear_it(browser, tmp_path):
    """Issue 39: plotly's toolbar (shown on hover at the top right) covered long titles placed at the figure's top:
    the animations' headings and the replay toggles'. Titles from style.top_title start below it, in both
    languages."""
    from parlab.i18n import use_language
    from parlab.parallel import pipeline as sch
    from parlab.viz import pipeline as vp, style
    from parlab.viz.replay import toggle, toggle_figures
    long = "a long title that runs the whole width of the figure, right up to its edge where the toolbar is"
    under = go.Figure(go.Scatter(x=[0, 1], y=[0, 1]))
    under.update_layout(title=dict(text=long, x=0.015, xanchor="left", y=1.0, yref="container", yanchor="top",
                                   pad=dict(t=8)))                                    # the replay toggle's title
    clear = go.Figure(go.Scatter(x=[0, 1], y=[0, 1]))
    clear.update_layout(title=style.top_title(long, x=0.015, xanchor="left"))
    evs = [Event(rank=r, kind="collective", op="all_reduce", start=0.0, end=1.0, group=tuple(range(8)), nbytes=8000,
                 label="grad bucket 0 of the embedding and the first layer") for r in range(8)]   # a long heading
    runs = [Event(rank=r, kind="compute", op="forward", start=0.0, end=1.0 + r) for r in range(2)]
    figs = []
    for lang in ("en", "zh_CN"):
        with use_language(lang):
            panels = {"1F1B": sch.simulate(sch.one_f_one_b(4, 8)).spans, "ZB-H1": sch.simulate(sch.zero_bubble_h1(4, 8)).spans}
            figs += [viz.comm_animation(evs, title="DDP: one update, 21 bucket all-reduces on 4 ranks"),
                     toggle_figures({"this machine (emulated device time)": vp.schedules_figure(panels, title=long),
                                     "replayed: GPT-3 175B on 32 x H100": vp.schedules_figure(panels, title=long)}),
                     toggle(runs, runs, title=long, labels=("here", "there"))]
    (p_under, p_clear, *p_figs), _ = _problems(browser, tmp_path, under, clear, *figs)
    assert any("lies under plotly's toolbar" in p for p in p_under), p_under
    assert p_clear == [] and p_figs == [[]] * len(figs), p_figs

def test_animations_have_a_frame_per_algorithm_step_and_stay_legible(browser, tmp_path):
    evs = [Event(rank=r, kind="collective", op="all_reduce", start=0.0, end=1.0, group=tuple(range(8)), nbytes=8000)
           for r in range(8)]
    fig = viz.comm_animation(evs, title="ring all-reduce on 8 ranks")
    assert len(fig.frames) == 2 * (8 - 1)
    (problems,), _ = _problems(browser, tmp_path, fig)
    assert problems == []
    spec = json.loads(fig.to_json())
    spec["frames"] = spec["frames"][:3]                                # an animation that stops early is caught
    assert figpage._animation_problems(spec) == ["animation has 3 frames, its algorithm 14 steps"]


@pytest.mark.parametrize("lang", ["en", "zh_CN"])
def test_explorer_figure_past_the_gpu_memory_passes_in_chromium(browser, tmp_path, lang):
    """Lesson 07's explorer figure where the bar runs past 80 GB (GPT-3 175B without recomputation) and far past it
    (the same without tp and pp: the 80 GB and usable lines a few pixels apart), in both languages, at the lesson's
    height: nothing overlaps or is cut (the capacity labels beside the plot, the tick labels of the time plot)."""
    import dataclasses

    from parlab.cluster.costs import CLUSTERS, model_preset
    from parlab.cluster.hardware import hardware_preset as hardware
    from parlab.cluster.planner import estimate
    from parlab.i18n import use_language
    from parlab.viz.explorer import layout_figure
    cluster = dataclasses.replace(CLUSTERS["h100-80gb"], nodes=8)
    with use_language(lang):
        figs = [layout_figure(estimate(model_preset("gpt3-175b"), cluster, 128, tp=tp, pp=pp, micro_batch=2,
                                       recompute="none", hardware=hardware("dgx-h100"), precision="fp8",
                                       attention="materialised"), cluster,          # the scores kept, as in 2022
                              height=390) for tp, pp in ((8, 8), (1, 1))]
    assert [f.layout.yaxis.range[1] for f in figs][1] > 1000                 # the lines 8 GB apart on a 1 TB axis
    problems, _ = _problems(browser, tmp_path, *figs)
    assert problems == [[], []], problems


LESSONS = sorted(p.stem for p in (ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))   # every lesson, every figure


@pytest.fixture(scope="module")
def lessons_checked(tmp_path_factory, browser, lesson_kernels):
    """Every lesson executed top to bottom (two at a time) and each figure and widget label checked in Chromium:
    (folder with figures.json, problems). The lessons' only execution in the suite: a cell that
    raises is a problem ("the notebook stopped with an error: ...") and fails its lesson below."""
    out = tmp_path_factory.mktemp("figcheck")
    return out, check.run([ROOT / "lessons" / f"{name}.ipynb" for name in LESSONS], out, jobs=2,
                          screenshots=False, browser=browser, server=lesson_kernels)   # PNGs are for people


@pytest.mark.parametrize("name", LESSONS)
def test_lesson_runs_and_its_figures_pass_in_chromium(lessons_checked, name):
    """Execute the lessons, draw every figure (and each widget's initial figure) and check it from the page."""
    out, problems = lessons_checked
    assert [p for p in problems if p.split("/")[0].split(":")[0] == name] == [], "\n".join(problems)
    shown = json.loads((out / "figures.json").read_text())
    assert sum(f["name"].startswith(name) for f in shown) >= 3, name          # the lesson's figures were seen
    path = ROOT / "lessons" / f"{name}.ipynb"                                  # the tracked notebook stays clean
    assert not any(c.get("outputs") for c in nbformat.read(path, 4).cells if c.cell_type == "code")


@pytest.mark.parametrize("name,check_tables", [("02_data_parallel", lesson_tables.check_lesson_02),
                                               ("07_hybrid_4d", lesson_tables.check_lesson_07)])
def test_lesson_tables_line_up(lessons_checked, name, check_tables):
    """The printed tables of lessons 02 and 07, as executed above (tests/lesson_tables.py)."""
    check_tables(nbformat.read(lessons_checked[0] / f"{name}.ipynb", 4), "en")


def test_every_lesson_figure_and_widget_was_drawn(lessons_checked):
    out, problems = lessons_checked
    assert problems == [], "\n".join(problems)
    shown = json.loads((out / "figures.json").read_text())
    assert any(f["in_widget"] for f in shown)                                 # widgets' figures included
    assert all(f["height"] > 100 for f in shown), [f["name"] for f in shown if f["height"] <= 100]   # drawn


@pytest.fixture(scope="module")
def handout(lessons_checked, tmp_path_factory):
    """Lesson 00, as executed above, exported as a handout (what `parlab course html` writes, without running the
    lesson a second time; the command's own run of a notebook: tests/test_i18n.py)."""
    from parlab import course
    out, _problems = lessons_checked
    page, = course.export_html([out / "00_why_parallel.ipynb"], tmp_path_factory.mktemp("handout"), executed=True)
    return page


def test_handout_reads_offline_math_figures_and_widgets(handout, browser, tmp_path):
    """`parlab course html` pages with the network cut off: formulas typeset (not raw TeX), every figure drawn,
    and each "Try it" widget shown at its initial setting with the figure it drew."""
    page = handout
    text = page.read_text(encoding="utf-8")
    assert "https://cdn" not in "".join(l for l in text.splitlines() if "<script src=" in l)
    remote = []

    def read(tab):
        tab.route("http*://**", lambda route: (remote.append(route.request.url), route.abort()))   # offline
        tab.goto(page.as_uri())
        tab.wait_for_function("() => window.MathJax && MathJax.Hub && MathJax.Hub.queue.pending === 0 && "
                              "document.querySelectorAll('.MathJax, .MathJax_Display').length > 0", timeout=120_000)
        tab.screenshot(path=str(tmp_path / "handout.png"))                # the first screen, for a person
        return tab.evaluate("""() => ({
            math: document.querySelectorAll('.MathJax, .MathJax_Display').length,
            error: document.body.innerText.includes('Math Processing Error'),
            raw: (document.body.innerText.match(/\\$[^$\\n]{1,60}\\$/g) || []).length,
            divs: document.querySelectorAll('.plotly-graph-div').length,
            drawn: document.querySelectorAll('.plotly-graph-div .main-svg').length,
            tryit: Array.from(document.querySelectorAll('.parlab-try-it')).map(e => e.innerText)})""")
    seen = browser.with_page(read)                                        # the suite's Chromium, a page of its own
    figures = text.count('class="plotly-graph-div"')                          # exported figures
    assert remote == [], f"the handout asked the network for {remote[:3]}"
    assert seen["math"] >= 10 and not seen["error"] and seen["raw"] == 0, seen
    assert figures >= 3, "lesson 00 should show its figures outside widgets, so that they export"
    assert seen["divs"] >= 5 and seen["drawn"] >= seen["divs"], seen               # widget figures included
    assert (tmp_path / "handout.png").stat().st_size > 20_000, "the screenshot is blank"
    assert len(seen["tryit"]) == 2 and "params (B) = 5.0" in seen["tryit"][0], seen["tryit"]
