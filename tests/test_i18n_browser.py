"""The Chinese course as a student sees it: every lesson run top to bottom in Chinese (PARLAB_LANG=zh_CN), each
figure drawn in headless Chromium and checked like the English ones (`parlab.course.figcheck`: nothing overlaps
or is cut, and no character lacks a glyph), and a Chinese handout read offline.

The English lessons run in tests/test_viz_browser.py; the two files are one unit of work on one pytest worker
(tests/conftest.py, `BROWSER`), sharing its Chromium page and warm kernel server. Needs Debian's chromium and a
CJK font (fonts-noto-cjk), both installed by .ci/run.
"""
import json
import re
from pathlib import Path

import nbformat
import pytest

import lesson_tables
from parlab.course import figcheck as check
from parlab.course.translated import write_course

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted(p.stem for p in (ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))
pytestmark = pytest.mark.skipif(check.chromium_path() is None,
                                reason="needs Debian's chromium (apt-get install -y chromium); .ci/run installs it")


@pytest.fixture(scope="module")
def browser(chromium):
    """The Chromium of the English lessons' checks (tests/conftest.py `chromium`, the same worker): the figure
    check's page, and a page for the handout."""
    return chromium


@pytest.fixture(scope="module")
def chinese_lessons(tmp_path_factory, browser, lesson_kernels):
    """The Chinese course written out (`write_course`), its lessons executed two at a time in Chinese and every
    figure checked: (folder with figures.json, problems)."""
    course = write_course(ROOT, "zh_CN", tmp_path_factory.mktemp("course-zh"))
    out = tmp_path_factory.mktemp("figcheck-zh")
    return out, check.run([course / "lessons" / f"{name}.ipynb" for name in LESSONS], out, jobs=2, lang="zh_CN",
                          screenshots=False, browser=browser, server=lesson_kernels)   # PNGs are for people


def test_the_glyph_check_finds_a_character_no_font_draws():
    assert check.missing_glyphs("数据并行 all-reduce") == []          # the CJK font .ci/run installs
    assert check.missing_glyphs("\ue000 a") == ["\ue000"]              # a private-use code point: no font has it


@pytest.mark.parametrize("name", LESSONS)
def test_chinese_lesson_runs_and_its_figures_pass_in_chromium(chinese_lessons, name):
    out, problems = chinese_lessons
    assert [p for p in problems if p.split("/")[0].split(":")[0] == name] == [], "\n".join(problems)
    shown = json.loads((out / "figures.json").read_text())
    assert sum(f["name"].startswith(name) for f in shown) >= 3, name


@pytest.mark.parametrize("name,check_tables", [("02_data_parallel", lesson_tables.check_lesson_02),
                                               ("07_hybrid_4d", lesson_tables.check_lesson_07)])
def test_chinese_lesson_tables_line_up_and_read_chinese(chinese_lessons, name, check_tables):
    """The printed tables of lessons 02 and 07, as executed above in Chinese (tests/lesson_tables.py)."""
    check_tables(nbformat.read(chinese_lessons[0] / f"{name}.ipynb", 4), "zh_CN")


def test_every_chinese_figure_was_drawn(chinese_lessons):
    out, problems = chinese_lessons
    assert problems == [], "\n".join(problems)
    shown = json.loads((out / "figures.json").read_text())
    assert all(f["height"] > 100 for f in shown), [f["name"] for f in shown if f["height"] <= 100]   # drawn


def test_chinese_handout_reads_offline_with_every_glyph(chinese_lessons, browser, tmp_path):
    """The Chinese lesson 00, as executed above, exported as a handout (what `parlab course html --lang zh`
    writes, without running the lesson a second time): Chinese prose, formulas typeset, figures drawn, offline,
    every glyph drawn."""
    from parlab import course
    out, _problems = chinese_lessons
    page, = course.export_html([out / "00_why_parallel.ipynb"], tmp_path, executed=True)

    def read(tab):
        tab.route("http*://**", lambda route: route.abort())
        tab.goto(page.as_uri())
        tab.wait_for_function("() => window.MathJax && MathJax.Hub && MathJax.Hub.queue.pending === 0",
                              timeout=120_000)
        tab.screenshot(path=str(tmp_path / "handout-zh.png"))           # the first screen, for a person
        return (tab.evaluate("() => document.body.innerText"),
                tab.evaluate("() => document.querySelectorAll('.plotly-graph-div .main-svg').length"))
    text, drawn = browser.with_page(read)                               # the suite's Chromium, a page of its own
    assert "第 00 课" in text and len(re.findall(r"[\u4e00-\u9fff]", text)) > 500, text[:300]
    assert drawn >= 3
    assert check.missing_glyphs(text) == []
