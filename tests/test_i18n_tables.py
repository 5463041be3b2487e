"""What a Chinese student reads in the printed tables, schedule names and controls of lessons 05 and 07: Chinese
headers and names (no English word left but the names the glossary keeps), and columns that line up by display
width (a Chinese character takes two columns) in both languages. Each test runs the lesson's own cell, as
translated, with the inputs of its earlier cells made small or stubbed (a stub stands in only for what the table
prints). The tables of lessons 02 and 07, whose inputs are the lessons' own runs, are checked in the lessons as
executed (tests/lesson_tables.py, from tests/test_viz_browser.py and tests/test_i18n_browser.py)."""
import re
import types
from pathlib import Path

import pytest

from lesson_tables import english          # English words of 3+ letters left, but rank, GPipe and GPT
from parlab.course import translated
from parlab.i18n import use_language
from parlab.i18n.columns import pad, width

ROOT = Path(__file__).resolve().parents[1]


def _cells(lesson: str, lang: str) -> dict[str, str]:
    path = ROOT / "lessons" / lesson
    nb = translated.translated_lesson(path, lang, ROOT) if lang != "en" else __import__("nbformat").read(path, 4)
    return {c.id: c.source for c in nb.cells}


def _bars(lines: list[str]) -> set[tuple[int, ...]]:
    """The display columns of the '|' of each line (one tuple per distinct layout)."""
    return {tuple(width(line[:i]) for i, c in enumerate(line) if c == "|") for line in lines}


def _right_edges(lines: list[str]) -> set[int]:
    return {width(line.rstrip()) for line in lines}


def _lesson_05_inputs(P=4, M=8, V=2):
    """What cells 875bc42c and 5348769c read from the cells before them, on simulated schedules: traces and
    replays stubbed by simulations (F = 1, B = 2, ZB-H1's I = 1.2 and W = 0.8 as replayed on GPUs, the last
    stage's F 2% longer)."""
    from parlab.cluster.costs import model_preset
    from parlab.cluster.hardware import hardware_preset
    from parlab.cluster.scaleup import Layout
    from parlab.parallel import pipeline as sch
    from parlab.viz import pipeline as vp
    schedules = {"naive": sch.naive(P, M), "GPipe": sch.gpipe(P, M), "1F1B": sch.one_f_one_b(P, M),
                 "interleaved 1F1B (v=2)": sch.interleaved_1f1b(P, M, V), "ZB-H1": sch.zero_bubble_h1(P, M)}
    sims = {k: sch.simulate(s) for k, s in schedules.items()}
    sends = {k: 2 * (s.stages - 1) * M + 2 for k, s in schedules.items()}
    runs = {k: {"trace": types.SimpleNamespace(count=lambda op, n=sends[k]: n, bubble=sims[k].bubble_fraction)}
            for k in schedules}

    def real(s):
        base = {"F": 1.0, "B": 2.0, "I": 1.2, "W": 0.8}
        return sch.simulate(s, costs=lambda a: base[a.kind] / s.chunks * (1.02 if a.kind == "F" and
                                                                           a.stage == s.stages - 1 else 1))
    return dict(P=P, M=M, V=V, sch=sch, vp=vp, pad=pad, SCHEDULES=schedules, runs=runs,
                measured={k: None for k in schedules}, step_time={k: s.makespan for k, s in sims.items()},
                measured_bubble=lambda t: t.bubble if isinstance(t, types.SimpleNamespace) else t.bubble_fraction,
                PANELS=("GPipe", "1F1B", "interleaved 1F1B (v=2)", "ZB-H1"),
                replayed={k: real(schedules[k]) for k in ("GPipe", "1F1B", "interleaved 1F1B (v=2)", "ZB-H1")},
                measured_spans=lambda sim: dict(enumerate(sim.spans)), replayed_step=lambda sim: sim.makespan,
                H100=hardware_preset("dgx-h100"), GPT3=model_preset("gpt3-175b"), LAYOUT=Layout(tp=8, pp=P))


@pytest.mark.parametrize("lang", ["en", "zh_CN"])
def test_lesson_05_tables_line_up_and_name_the_schedules_in_the_course_language(lang, capsys):
    """Cells 875bc42c (measured and simulated bubbles), 5348769c (replayed bubbles) and 8066f7c6 (two conventions):
    every '|' of a table in one display column, the right-aligned last column ending in one column; in Chinese
    the headers and the schedules' names ("naive", "interleaved 1F1B (v=2)") are Chinese."""
    cells, ns = _cells("05_pipeline_parallel.ipynb", lang), _lesson_05_inputs()
    tables = {}
    with use_language(lang):
        for cid, first, last in (("875bc42c", 0, 6), ("5348769c", 1, 6), ("8066f7c6", 0, 7)):
            exec(cells[cid], ns)
            tables[cid] = capsys.readouterr().out.splitlines()[first:last]
    for cid, lines in tables.items():
        bars = _bars(lines)
        assert len(bars) == 1 and len(bars.pop()) == (1 if cid == "5348769c" else 2), "\n".join(lines)
        assert len(_right_edges(lines)) == 1, "\n".join(lines)
    text = "\n".join(tables["875bc42c"] + tables["5348769c"] + tables["8066f7c6"][:1])
    if lang == "zh_CN":
        assert english(text) == [], text
        assert "朴素流水线" in text and "交错 1F1B (v=2)" in text, text
    else:
        assert "naive" in text and "interleaved 1F1B (v=2)" in text and "pipeline schedule" in text


def test_lesson_05_figures_title_the_schedules_in_chinese_and_keep_their_keys():
    """The subplot titles (figure annotations) of cells 73a84801 and 019d82cd and the peak bars' legend show the
    schedules' Chinese names; the keys the cells look schedules up by stay English."""
    from parlab.parallel import pipeline as sch
    from parlab.viz import pipeline as vp
    spans = sch.simulate(sch.one_f_one_b(2, 2)).spans
    keys = ("naive", "interleaved 1F1B (v=2)", "1F1B", "my schedule")
    with use_language("zh_CN"):
        fig = vp.schedules_figure({k: spans for k in keys})
        bars = vp.peak_bars({"naive": [1, 1], "GPipe": [2, 2]})
    assert [a.text for a in fig.layout.annotations] == ["朴素流水线", "交错 1F1B (v=2)", "1F1B", "my schedule"]
    assert [t.name for t in bars.data] == ["朴素流水线", "GPipe"]
    assert [a.text for a in vp.schedules_figure({k: spans for k in keys}).layout.annotations] == list(keys)


@pytest.fixture(scope="module")
def lesson_07():
    """Lesson 07's imports and seed 000's grid: what the explorers' cells read (its tables are checked in the
    lesson as executed: tests/lesson_tables.py)."""
    cells = {lang: _cells("07_hybrid_4d.ipynb", lang) for lang in ("en", "zh_CN")}
    ns: dict = {}
    exec(cells["en"]["7f30cb6f"], ns)
    exec(cells["en"]["6261c0ab"], ns)                              # seed 000's grid
    return cells, ns


# ---------------------------------------------------------------------- the exercises' locked demonstration cells
#: exercise -> its locked cell that demonstrates the student's code (byte-identical in every language)
DEMOS = {"00_ring_allreduce": "ex00-14", "03_zero": "5f813254", "04_tensor_parallel": "e78b8be3",
         "06_ring_attention": "ef13699d", "08_ulysses": "c45356d3"}


def _printed_literals(source: str) -> list[str]:
    """The string literals (f-strings included) a cell passes to print() with a word of 3+ letters in them (a
    subscript's key left out)."""
    import ast
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            for arg in node.args:
                keys = {id(k) for sub in ast.walk(arg) if isinstance(sub, ast.Subscript) for k in ast.walk(sub.slice)}
                for sub in ast.walk(arg):
                    if id(sub) in keys:                 # rows["payload"]: a key, not a word shown
                        continue
                    text = sub.value if isinstance(sub, ast.Constant) and isinstance(sub.value, str) else ""
                    if re.search(r"[A-Za-z]{3,}", text):
                        out.append(text)
    return out


@pytest.mark.parametrize("exercise", sorted(DEMOS))
def test_locked_demo_cells_print_no_english_of_their_own(exercise):
    """A locked cell cannot be translated: what it prints comes from parlab (through gettext), never from an
    English literal of its own, in the solution and in the student's copy alike."""
    import nbformat
    for path in (ROOT / "exercises" / "solutions" / f"{exercise}.ipynb", ROOT / "exercises" / f"{exercise}.ipynb"):
        cell = next(c for c in nbformat.read(path, 4).cells if c.id == DEMOS[exercise])
        assert cell.metadata["nbgrader"]["locked"] and not cell.metadata["nbgrader"]["grade"]
        assert _printed_literals(cell.source) == [], f"{path.name}: {_printed_literals(cell.source)}"


def test_what_the_demo_cells_print_reads_chinese():
    """The reports those cells print (and `Trace.summary()`, which exercises 00 and 04 print) in Chinese: numbers
    kept, no English word but identifiers (comm.all_reduce, all-to-all, MLP) and the glossary's rank."""
    from parlab.course.grading import reports
    from parlab.trace import Event, Trace
    evs = [Event(rank=r, kind="collective", op="all_reduce", start=0.0, end=1.0, group=(0, 1), nbytes=4_000_000)
           for r in (0, 1)]
    with use_language("zh_CN"):
        text = "\n".join([reports.ring_traffic(True, {0: 6e6, 1: 6e6}, 6e6), Trace(evs).summary(),
                          reports.zero_fit("ZeRO-3", None, 1.4e9), reports.zero_fit("ZeRO-3", 64, 1.4e9),
                          reports.same_as_dense(False), reports.causal_ring_report(1.2e-16, [([0, 7], [1.0, 0.5])]),
                          reports.ulysses_traffic(1_048_576, 262_144)])
    words = [w for w in re.findall(r"[A-Za-z][\w.\-]*", re.sub(r"comm\.all_reduce|all-to-all|all_reduce", "", text))
             if len(re.sub(r"[^A-Za-z]", "", w)) >= 3 and w not in {"rank", "MLP", "ZeRO-3", "GPU", "size"}]
    assert words == [], text
    for number in ("6,000,000", "4.00 MB", "1.4 GB", "64", "1.2e-16", "[0, 7]", "[1.0, 0.5]", "1,048,576", "262,144"):
        assert number in text, (number, text)
    with use_language("zh_CN"):
        lines = Trace(evs).summary().splitlines()
    assert len({width(line) for line in lines}) == 1, "\n".join(lines)      # the Chinese header lines up


@pytest.mark.parametrize("lang", ["en", "zh_CN"])
def test_lesson_05_explorer_speaks_the_course_language(lang, capsys):
    """Cell 5e21698b, the schedule explorer: its controls are described in the course's language (their names
    were the parameter names, "microbatches"), the schedules listed by `schedule_label` with the English names as
    values, a schedule that cannot be built says why in Chinese (ScheduleError through gettext), and the figures'
    title and axis are Chinese. Cell 45e07ca4's losses name the schedules as the tables do."""
    import ipywidgets
    import plotly.graph_objects as go
    from parlab.parallel import pipeline as sch
    from parlab.viz import pipeline as vp
    cells = _cells("05_pipeline_parallel.ipynb", lang)
    shown = []
    ns = dict(sch=sch, vp=vp, go=go, widgets=ipywidgets, display=shown.append, pad=pad)
    with use_language(lang):
        exec(cells["5e21698b"], ns)
        capsys.readouterr()
        ns["explore"]("interleaved", 4, 6, 2)                       # 6 micro-batches: not a multiple of p = 4
        ns["explore"]("DualPipeV", 4, 6, 2)
        impossible = capsys.readouterr().out
        ns["explore"]("interleaved", 4, 8, 2)
        runs = {"naive": {"loss": 3.5}, "interleaved 1F1B (v=2)": {"loss": 3.5}}
        exec(cells["45e07ca4"][cells["45e07ca4"].index("for name, r in runs.items()"):].split("\n    assert")[0],
             dict(runs=runs, vp=vp, pad=pad))
        losses = capsys.readouterr().out
    options = ns["schedule_w"].options
    assert [v for _, v in options] == ["naive", "GPipe", "1F1B", "interleaved", "interleaved (memory-optimised)",
                                       "ZB-H1", "DualPipeV"]
    descriptions = [ns["schedule_w"].description, ns["chunks_w"].description]
    text = "\n".join([*descriptions, *(label for label, _ in options), impossible, losses,
                      shown[0].layout.title.text, shown[1].layout.yaxis.title.text])
    assert "6" in impossible and "8" in impossible and len(impossible.splitlines()) == 2, impossible
    if lang == "zh_CN":
        assert english(re.sub(r"microbatches|<[^>]*>", "", text)) == ["DualPipeV"] * 2, text
        assert "交错" in text and "平均损失" in losses, text
    else:
        assert "micro-batches" in impossible and "interleaved (memory-optimised)" in text and "mean loss" in losses


@pytest.mark.parametrize("lang", ["en", "zh_CN"])
def test_lesson_05_explorer_chunks_slider_is_live_only_for_interleaved_schedules(lang):
    """Issue 39: "the chunks slider stays live for schedules without chunks". Cell 5e21698b opens on 1F1B with
    the slider disabled, and only the two interleaved schedules (chosen by their key, in either language)
    enable it."""
    import ipywidgets
    import plotly.graph_objects as go
    from parlab.parallel import pipeline as sch
    from parlab.viz import pipeline as vp
    ns = dict(sch=sch, vp=vp, go=go, widgets=ipywidgets, display=lambda *a, **k: None, pad=pad)
    with use_language(lang):
        exec(_cells("05_pipeline_parallel.ipynb", lang)["5e21698b"], ns)
        schedule_w, chunks_w = ns["schedule_w"], ns["chunks_w"]
        live = {}
        assert schedule_w.value == "1F1B" and chunks_w.disabled
        for _label, key in schedule_w.options:
            schedule_w.value = key
            live[key] = not chunks_w.disabled
    assert live == {k: k.startswith("interleaved") for _l, k in schedule_w.options}, live

def test_lesson_07_controls_and_messages_speak_chinese(lesson_07, capsys):
    """Cells 76e8e641, 69a7e5fa and e0ba6dd5: every control of the three explorers has a translated description
    (interact otherwise shows the parameter's name: world_size, gpus_per_node, model_name, gpu_mem_gb); an
    invalid layout says why in Chinese (ParallelGrid's ValueError through gettext)."""
    import ipywidgets
    cells, ns = lesson_07[0]["zh_CN"], dict(lesson_07[1])
    controls = {}
    ns["widgets"] = types.SimpleNamespace(**{k: getattr(ipywidgets, k) for k in dir(ipywidgets) if k[0].isupper()},
                                          interact=lambda fn, **kw: controls.update(kw))
    with use_language("zh_CN"):
        exec(cells["850eafca"], ns)
        for cid in ("76e8e641", "69a7e5fa", "e0ba6dd5"):
            exec(cells[cid], ns)
        capsys.readouterr()
        ns["draw_grid"](world_size=16, gpus_per_node=8, tp=8, pp=4)
        ns["draw_grid"](world_size=4, gpus_per_node=8, tp=1, pp=1)
        invalid = capsys.readouterr().out
    names = {k: w.description for k, w in controls.items() if k not in ("tp", "pp", "cp")}
    assert set(names) == {"world_size", "gpus_per_node", "order", "highlight", "model_name", "global_batch",
                          "nodes", "gpu_mem_gb"}, names
    assert english(re.sub(r"world size|GB|GPU", "", " ".join(names.values()))) == [], names
    assert len(invalid.splitlines()) == 2 and "32" in invalid and "不能被" in invalid, invalid
    assert english(re.sub(r"world_size|tp\*pp\*cp|gpus_per_node|GPU", "", invalid)) == [], invalid


def test_lesson_09_bytes_by_label_names_the_expert_calls_in_chinese():
    # lesson 09 cell 9a1e0012 stacks the bytes of an EP step by label: the title and every legend entry the course's
    # own calls make read Chinese (they read "by label" and "ep dispatch backward" before)
    from parlab import viz
    from parlab.trace import Event, Trace
    labels = ["ep counts", "ep dispatch", "ep combine", "ep dispatch backward", "ep combine backward", "ep grads dense"]
    tr = Trace([Event(r, "collective", "all_to_all", 0.0, 1.0, group=(0, 1), nbytes=64, label=lab)
                for r in (0, 1) for lab in labels])
    with use_language("zh_CN"):
        fig = viz.bytes_bars(tr, by="label")
    names = [d.name for d in fig.data]
    assert len(names) == len(labels) and "标签" in fig.layout.title.text
    for text in (*names, fig.layout.title.text):
        assert not re.search(r"\b(?!EP\b|token\b|rank\b)[A-Za-z]{3,}\b", text), text
