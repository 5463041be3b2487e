"""The notebooks themselves: solutions pass their graders, student notebooks fail every graded cell, and an
executed lesson exported to HTML draws its plotly figures in a real browser (headless Chromium).

Notebooks run under nbval in a subprocess (`pytest --nbval-lax --nbval-current-env`), exactly as a lecturer
grades them (exercises/README.md); the JUnit XML it writes is read back with `parlab.course.scorecard`.
The lessons themselves run in CI as `pytest --nbval-lax --nbval-current-env lessons/` (about a minute each);
here only lesson 00 is executed, for the HTML test.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parlab import course

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "exercises" / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def nbval(paths, junit: Path, cell_timeout: int = 300) -> subprocess.CompletedProcess:
    """Grade notebooks the way exercises/README.md tells lecturers to."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
           f"--nbval-cell-timeout={cell_timeout}", f"--junitxml={junit}", *map(str, paths)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_solution_notebooks_pass_their_graders(tmp_path):
    assert len(SOLUTIONS) >= 2
    out = nbval([p.relative_to(ROOT) for p in SOLUTIONS], tmp_path / "solutions.xml")
    assert out.returncode == 0, out.stdout[-4000:]
    rows = course.scorecard(tmp_path / "solutions.xml", root=ROOT)
    graded = sum(len(course.graded_cells(course.read(p))) for p in SOLUTIONS)
    assert len(rows) == graded and all(r["passed"] for r in rows)


def test_student_notebooks_fail_every_graded_cell(tmp_path):
    assert [p.name for p in EXERCISES] == [p.name for p in SOLUTIONS]
    nbval([p.relative_to(ROOT) for p in EXERCISES], tmp_path / "students.xml")
    rows = course.scorecard(tmp_path / "students.xml", root=ROOT)
    for path in EXERCISES:
        graded = course.graded_cells(course.read(path))
        mine = [r for r in rows if r["file"] == str(path.relative_to(ROOT))]
        assert sorted(r["cell"] for r in mine) == sorted(graded), path.name
        for r in mine:
            assert not r["passed"], f"{path.name} cell {r['cell']} passes without a solution: {r['check']}"
            assert "AssertionError" in r["message"] and "not written yet" in r["message"], r["message"]


@pytest.mark.skipif(CHROMIUM is None, reason="headless browser test needs Debian's `chromium` package "
                                             "(apt-get install -y chromium); .ci/run installs it")
def test_executed_lesson_renders_plotly_figures_in_headless_chromium(tmp_path):
    from parlab import cli

    lesson = ROOT / "lessons" / "00_why_parallel.ipynb"       # exported the way the README tells lecturers
    assert cli.main(["course", "html", str(lesson), "--out", str(tmp_path), "--timeout", "300"]) == 0
    page = tmp_path / "00_why_parallel.html"
    figures = page.read_text(encoding="utf-8").count('class="plotly-graph-div"')   # one div per exported figure
    assert figures >= 3, "lesson 00 should show its figures outside widgets, so that they export"

    def chromium(*args):
        profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"   # a fresh profile per run
        return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1280,4000",
                               "--virtual-time-budget=20000", *args, page.as_uri()],
                              capture_output=True, text=True, timeout=180)

    dom = chromium("--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    drawn = dom.stdout.count('class="main-svg"')          # plotly draws each figure into <svg class="main-svg">
    assert dom.stdout.count("plot-container plotly") == figures, "a plotly figure was not drawn"
    assert drawn >= figures
    shot = tmp_path / "00_why_parallel.png"
    chromium(f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 20_000, "the screenshot is missing or blank"
