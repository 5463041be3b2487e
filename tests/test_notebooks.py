"""The exercises themselves: solutions pass their graders, student notebooks fail every graded cell.

Notebooks run under nbval in a subprocess (`pytest --nbval-lax --nbval-current-env`), exactly as a lecturer
grades them (exercises/README.md); the JUnit XML it writes is read back with `parlab.course.scorecard`. This is
the suite's only run of the solutions; the two folders are graded at once (two nbval processes side by side: each
mostly waits on its kernel). The lessons are executed in tests/test_viz_browser.py, which checks their figures.
"""
import subprocess
import sys
from pathlib import Path

import pytest

from parlab import course

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "exercises" / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def nbval(paths, junit: Path, cell_timeout: int = 300) -> subprocess.Popen:
    """Grade notebooks the way exercises/README.md tells lecturers to (started, not waited for); pytest's own
    output goes to `junit` with the suffix .txt."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
           f"--nbval-cell-timeout={cell_timeout}", f"--junitxml={junit}", *map(str, paths)]
    with open(junit.with_suffix(".txt"), "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{"solutions"|"students": (exit code, pytest's output, JUnit XML path)}, both folders graded side by side."""
    tmp = tmp_path_factory.mktemp("graded")
    procs = {k: nbval([p.relative_to(ROOT) for p in paths], tmp / f"{k}.xml")
             for k, paths in (("solutions", SOLUTIONS), ("students", EXERCISES))}
    try:
        return {k: (p.wait(timeout=900), (tmp / f"{k}.txt").read_text(), tmp / f"{k}.xml") for k, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def test_solution_notebooks_pass_their_graders(graded):
    assert len(SOLUTIONS) >= 2
    code, out, xml = graded["solutions"]
    assert code == 0, out[-4000:]
    rows = course.scorecard(xml, root=ROOT)
    graded = sum(len(course.graded_cells(course.read(p))) for p in SOLUTIONS)
    assert len(rows) == graded and all(r["passed"] for r in rows)


def test_student_notebooks_fail_every_graded_cell(graded):
    assert [p.name for p in EXERCISES] == [p.name for p in SOLUTIONS]
    rows = course.scorecard(graded["students"][2], root=ROOT)
    for path in EXERCISES:
        graded = course.graded_cells(course.read(path))
        mine = [r for r in rows if r["file"] == str(path.relative_to(ROOT))]
        assert sorted(r["cell"] for r in mine) == sorted(graded), path.name
        for r in mine:
            assert not r["passed"], f"{path.name} cell {r['cell']} passes without a solution: {r['check']}"
            assert "AssertionError" in r["message"] and "not written yet" in r["message"], r["message"]
