"""The course in Chinese: every prose cell and every message translated and current, numbers kept, no English
sentence left, the same code and the same grading metadata as the English course (`parlab.i18n`).

The Chinese lessons are executed and their figures checked in tests/test_viz_browser.py, the Chinese exercises
graded in tests/test_notebooks.py, and a Chinese assignment run through nbgrader in tests/test_nbgrader.py.
"""
import ast
import json
import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest

from parlab import cli
from parlab.course import translated, workspace
from parlab.i18n import _, checks, language, normalize, notebooks, set_language, use_language
from parlab.i18n.catalogue import missing_messages, runtime_messages
from parlab.i18n.review import counts, review

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "exercises" / "solutions").glob("*.ipynb"))


# ---------------------------------------------------------------------- completeness
def test_every_prose_cell_and_display_string_has_a_current_checked_translation():
    found = review(ROOT, "zh_CN")
    assert found == {}, "\n".join(p for v in found.values() for p in v[:20])
    c = counts(ROOT, "zh_CN")
    assert c["cells"] >= 190 and c["translated"] == c["cells"] and c["stale"] == 0, c


def test_every_message_parlab_prints_or_draws_is_translated():
    assert len(runtime_messages()) >= 20
    assert missing_messages("zh_CN") == [], "\n".join(missing_messages("zh_CN")[:30])


def test_a_changed_english_cell_reads_stale_with_its_notebook_and_cell_id(tmp_path):
    """The PO rule: the English of a cell changes, `update` keeps its old translation as fuzzy with the old
    English beside it, and the check names the notebook and the cell until a translator redoes it."""
    (tmp_path / "lessons").mkdir()
    src = ROOT / "lessons" / "00_why_parallel.ipynb"
    nb = nbformat.read(src, 4)
    shutil.copytree(ROOT / "translations", tmp_path / "translations")
    cell = next(c for c in nb.cells if c.cell_type == "markdown")
    cell.source = cell.source.replace("Why", "Why, really,", 1)
    nbformat.write(nb, tmp_path / "lessons" / src.name)
    catalog = notebooks.update(tmp_path / "lessons" / src.name, "zh_CN", tmp_path)
    entry = catalog.get(cell.source, context=cell.id)
    assert entry is not None and entry.fuzzy and entry.string and entry.previous_id
    problems = notebooks.problems(nb, catalog, "lessons/" + src.name)
    assert problems == [f"lessons/{src.name} cell {cell.id}: markdown stale (the English changed; the old one is "
                        f"#| msgid)"]
    zh = notebooks.translate(nb, catalog)                          # a stale cell is shown in English
    assert next(c for c in zh.cells if c.id == cell.id).source == cell.source


# ---------------------------------------------------------------------- what a translation must keep
def test_the_checks_catch_a_lost_number_an_english_sentence_and_a_changed_field():
    terms = checks.glossary_terms(ROOT / "translations" / "GLOSSARY.md")
    assert "pipeline parallelism" in terms and "all-reduce" in terms
    assert checks.lost_numbers("18186 MB against 9,824 MB on 8 GPUs", "主 GPU 用了 18186 MB，其余 9824 MB") == ["8"]
    assert checks.lost_numbers("1,000,000 elements", "1000000 个元素") == []
    assert checks.english_left("数据并行 (data parallelism)：每个 rank 各算一片", terms) == []
    assert checks.english_left("这一步 then each worker sends its slice", terms) == ["then each worker sends its slice"]
    assert checks.english_left("`every rank sends its slice` 与 $a b c d e$，见 \"Reducing Activation "
                               "Recomputation in Large Models\"", terms) == []
    assert notebooks.check_literal('f"{n} ranks sent {mb:.2f} MB"', 'f"{n} 个 rank 共发送 {mb:.2f} MB"') is None
    assert "fields" in notebooks.check_literal('f"{n} ranks sent {mb:.2f} MB"', 'f"{n} 个 rank 共发送 {mb} MB"')
    assert "kind" in notebooks.check_literal('f"{n} ranks"', '"{n} 个 rank"')
    assert "not one Python string literal" in notebooks.check_literal('"a b"', '"a" + b')


def _without_strings(source: str) -> str:
    """The code of a cell with every string literal blanked: what a translation may not change (an f-string's
    fields may come in another order: a Chinese sentence orders its words its own way)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
        if isinstance(node, ast.JoinedStr):
            node.values = sorted((v for v in node.values if isinstance(v, ast.FormattedValue)), key=ast.dump)
    return ast.dump(tree)


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_chinese_lesson_is_the_english_code_with_translated_prose(path):
    en, zh = nbformat.read(path, 4), translated.translated_lesson(path, "zh_CN", ROOT)
    assert [c.id for c in zh.cells] == [c.id for c in en.cells]
    for a, b in zip(en.cells, zh.cells):
        if a.cell_type == "code":
            assert _without_strings(a.source) == _without_strings(b.source), a.id
        elif a.source.strip():
            assert b.source != a.source and re.search(r"[\u4e00-\u9fff]", b.source), a.id
    assert zh.metadata["parlab"]["lang"] == "zh_CN"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_a_chinese_exercise_keeps_every_grade_id_point_lock_and_code_checksum(path):
    from parlab.course.notebooks import make_exercise
    en_source = translated.translated_solution(path, "en", ROOT)
    zh_source = translated.translated_solution(path, "zh_CN", ROOT)
    for en, zh in ((en_source, zh_source), (make_exercise(en_source, path.name), make_exercise(zh_source, path.name))):
        assert [c.id for c in zh.cells] == [c.id for c in en.cells]
        for a, b in zip(en.cells, zh.cells):
            meta_a, meta_b = a.metadata["nbgrader"], b.metadata["nbgrader"]
            if a.cell_type == "code":
                assert a.source == b.source and meta_a == meta_b, a.id          # checksum included
            else:
                assert {k: v for k, v in meta_a.items() if k != "checksum"} == \
                       {k: v for k, v in meta_b.items() if k != "checksum"}, a.id
                assert b.source != a.source, a.id


# ---------------------------------------------------------------------- the language in force
def test_the_language_follows_the_flag_then_parlab_lang_then_the_locale(monkeypatch):
    for var in ("PARLAB_LANG", "LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        monkeypatch.delenv(var, raising=False)
    assert language() == "en"
    monkeypatch.setenv("LANG", "zh_CN.UTF-8")
    assert language() == "zh_CN"
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")             # a locale the course does not speak: English
    assert language() == "en"
    monkeypatch.setenv("PARLAB_LANG", "zh")
    assert language() == "zh_CN"
    with use_language("en"):
        assert language() == "en"
        assert _("lesson") == "lesson"
    assert language() == "zh_CN" and _("lesson") == "课"
    set_language(None)
    assert [normalize(c) for c in ("zh", "zh-CN", "zh_CN.UTF-8", "en_US", "C", "")] == \
           ["zh_CN", "zh_CN", "zh_CN", "en", "en", None]
    for bad, says in (("fr", "not one of the course's"), ("zh-TW", "Simplified Chinese (zh_CN), not zh_TW")):
        with pytest.raises(ValueError, match=re.escape(says)):
            normalize(bad)


def test_cli_refuses_a_language_the_course_does_not_have(capsys, monkeypatch):
    monkeypatch.setenv("PARLAB_LANG", "fr")
    assert cli.main(["course", "i18n", "check"]) == 2
    assert "PARLAB_LANG='fr'" in capsys.readouterr().err
    monkeypatch.delenv("PARLAB_LANG")
    for argv in (["course", "open", "--lang", "fr"], ["course", "html", "--lang", "klingon"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --lang" in err and "en, zh_CN" in err, err


def test_the_working_copy_switches_language_and_never_overwrites_an_edit(tmp_path):
    dest = tmp_path / "my-course"
    added = workspace.working_copy(ROOT, dest, lang="zh")["added"]
    assert len(added) == len(LESSONS) + len(SOLUTIONS)
    start = nbformat.read(dest / "START.ipynb", 4).cells[0].source
    assert start.startswith("# parlab：") and "第 00 课" in start and "GLOSSARY.md" in start, start[:300]
    assert (dest / "GLOSSARY.md").is_file()
    edited = dest / "lessons" / "01_collectives.ipynb"
    nb = nbformat.read(edited, 4)
    nb.cells[1].source += "\n# 我的笔记"
    nbformat.write(nb, edited)
    report = workspace.working_copy(ROOT, dest, lang="en")
    assert report["conflicts"] == ["lessons/01_collectives.ipynb"]
    assert "lessons/00_why_parallel.ipynb" in report["updated"]
    assert "我的笔记" in edited.read_text(encoding="utf-8")                  # the student's edit stays
    assert (dest / "lessons" / "01_collectives.updated.ipynb").is_file()
    assert nbformat.read(dest / "START.ipynb", 4).cells[0].source.startswith("# parlab: distributed")
    assert json.loads((dest / ".parlab-origin.json").read_text())["lang"] == "en"


def test_the_chinese_server_gets_its_own_interface_settings(tmp_path):
    pytest.importorskip("jupyterlab_language_pack_zh_CN", reason="the [zh] extra installs it")
    env = workspace.lab_settings(tmp_path, "zh_CN")
    plugin = Path(env["JUPYTERLAB_SETTINGS_DIR"]) / "@jupyterlab" / "translation-extension" / \
        "plugin.jupyterlab-settings"
    assert json.loads(plugin.read_text()) == {"locale": "zh_CN"}
    # the code font in which a Chinese character is two Latin columns wide, so padded tables line up
    themes = Path(env["JUPYTERLAB_SETTINGS_DIR"]) / "@jupyterlab" / "apputils-extension" / "themes.jupyterlab-settings"
    assert json.loads(themes.read_text())["overrides"]["code-font-family"].startswith("'Noto Sans Mono CJK SC'")
    assert workspace.lab_settings(tmp_path, "en") == {}
    # in every language the course's JupyterLab keeps its workspaces (open tabs) in the working copy: another
    # JupyterLab's workspace once reopened four unrelated notebooks and their kernels in the course
    for lang in ("en", "zh_CN"):
        env = workspace.lab_env(tmp_path, lang)
        assert env["PARLAB_LANG"] == lang
        assert Path(env["JUPYTERLAB_WORKSPACES_DIR"]) == (tmp_path / workspace.WORKDIR / ".jupyterlab-workspaces").resolve()


def test_course_html_runs_the_notebook_with_parlab_speaking_its_language(tmp_path):
    """`parlab course html --lang zh`: the kernel that runs the notebook has parlab speaking Chinese."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from parlab.i18n import _, language\nprint(language(), _('lesson'))")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "probe.ipynb")
    assert cli.main(["course", "html", str(tmp_path / "probe.ipynb"), "--lang", "zh", "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "probe.html").read_text(encoding="utf-8")
    assert "zh_CN 课" in page


# ---------------------------------------------------------------------- the READMEs
READMES = ["README.md", "lessons/README.md", "exercises/README.md", "parlab/labs/README.md"]
SOURCE_MARK = re.compile(r"<!-- translated from (\S+) sha256:([0-9a-f]{12}) -->")


def _blocks(text: str) -> list[str]:
    return re.findall(r"```.*?```", text, flags=re.S)


@pytest.mark.parametrize("english", READMES)
def test_each_readme_has_a_current_chinese_twin_with_the_same_commands(english):
    """README.zh-CN.md beside each README.md: it names the hash of the English it translates (a changed English
    makes it stale, as a PO entry would be), links back, and carries the same code blocks (the Quickstart's
    course-opening command opens the course in Chinese)."""
    import hashlib
    en_path = ROOT / english
    zh_path = en_path.with_name("README.zh-CN.md")
    en, zh = en_path.read_text(encoding="utf-8"), zh_path.read_text(encoding="utf-8")
    mark = SOURCE_MARK.search(zh)
    assert mark and mark.group(1) == en_path.name, f"{zh_path.relative_to(ROOT)} must name its source: " \
        f"<!-- translated from {en_path.name} sha256:... -->"
    digest = hashlib.sha256(en.encode()).hexdigest()[:12]
    assert mark.group(2) == digest, (f"{zh_path.relative_to(ROOT)} is stale: {english} changed since it was "
                                     f"translated; update the translation and its mark to sha256:{digest}")
    assert "[English](README.md)" in zh and "[简体中文](README.zh-CN.md)" in en
    zh_blocks = [b.replace('-e ".[course,zh]" && .venv/bin/parlab course open --lang zh',
                           '-e ".[course]" && .venv/bin/parlab course open') for b in _blocks(zh)]
    assert zh_blocks == _blocks(en)


# ---------------------------------------------------------------------- text tables
def test_pad_counts_a_chinese_character_as_two_columns():
    from parlab.i18n.columns import pad, width
    assert (width("abc"), width("交错 v=2（Megatron）"), width("e\u0301")) == (3, 20, 1)
    assert pad("气泡", 6) == "气泡  " and pad("气泡", 6, ">") == "  气泡" and pad("气泡", 7, "^") == " 气泡  "
    assert pad("a longer text", 4) == "a longer text" and pad(0.25, 6, ">") == "  0.25"


def test_lesson_05_peak_table_lines_up_in_chinese(capsys):
    """Cell dac3e443 prints schedules with their peaks and bubbles: in Chinese (labels of Chinese characters, each two
    columns wide) every '|' still sits in the same display column of every line, and the header is Chinese."""
    from parlab.i18n.columns import pad, width      # pad: imported by the lesson's first cell
    from parlab.parallel import pipeline as sch
    lesson = translated.translated_lesson(ROOT / "lessons" / "05_pipeline_parallel.ipynb", "zh_CN", ROOT)
    source = next(c.source for c in lesson.cells if c.id == "dac3e443")
    quiet = type("Viz", (), {"schedules_figure": staticmethod(lambda *a, **k: None)})
    exec(source, {"sch": sch, "P": 4, "M": 8, "V": 2, "one_f_one_b": sch.one_f_one_b(4, 8), "vp": quiet, "pad": pad})
    lines = capsys.readouterr().out.splitlines()
    bars = {tuple(width(line[:i]) for i, c in enumerate(line) if c == "|") for line in lines}
    assert len(lines) == 4 and len(bars) == 1 and len(bars.pop()) == 2, "\n".join(lines)
    assert re.search(r"[\u4e00-\u9fff]", lines[0]) and "schedule" not in lines[0], lines[0]


def test_lesson_02_figures_name_the_course_labels_in_chinese():
    """The phases, memory categories and DDP spans the course's own code labels (lesson 02's legends and bars) are
    drawn in Chinese; a label the student wrote stays as written, and the figure keeps its English key."""
    from parlab.trace import Event, Trace
    from parlab.viz import data_parallel as dpviz
    from parlab.viz.timeline import timeline
    spans = [Event(rank=0, kind="compute", op="backward", start=0.0, end=1.0, label="until bucket 3 ready"),
             Event(rank=0, kind="compute", op="grad sync", start=1.0, end=2.0, label="wait for buckets"),
             Event(rank=0, kind="compute", op="forward", start=2.0, end=3.0, label="my own span")]
    with use_language("zh_CN"):
        phases = dpviz.phase_bars({"naive": {"scatter inputs": {0: 1.0}, "grad bucket": {0: 2.0}}})
        memory = dpviz.memory_bars({"naive": [{"optimizer state": 1, "output grads": 2}]})
        bars = timeline(Trace(spans), show_labels=True)
    assert [t.name for t in phases.data] == ["切分输入", "梯度桶"]
    assert [t.name for t in memory.data] == ["优化器状态", "输出梯度"]
    assert [t.legendgroup for t in phases.data] == ["scatter inputs", "grad bucket"]
    drawn = [text for t in bars.data for text in (t.text or ())]
    assert sorted(drawn) == sorted(["直到桶 3 就绪", "等待梯度桶", "my own span"]), drawn


def test_exercise_05_prints_the_simulation_in_chinese():
    """Exercise 05 prints `Simulation.summary()` (its code cells cannot be translated): Chinese, numbers kept."""
    from parlab.parallel import pipeline as sch
    sim = sch.simulate(sch.one_f_one_b(4, 6))
    with use_language("zh_CN"):
        text = sim.summary()
    assert "0.333" in text and "0.500" in text and "[4, 3, 2, 1]" in text
    assert [w for w in re.findall(r"[A-Za-z]{3,}", text) if w != "rank"] == [], text   # rank: the glossary keeps it
