"""nbgrader as a client: a course that already runs on nbgrader takes parlab's solution notebooks as its
*source* notebooks, and nbgrader's own commands release and grade them exactly as parlab does.

The lecturer's steps (nbgrader 0.9's documented layout, ``source/<assignment>/``, default configuration):

1. ``nbgrader generate_assignment`` on all ten solutions: every released notebook has the very cells of
   parlab's ``exercises/NN.ipynb`` (sources with nbgrader's stub, grade ids, points, locks and checksums);
2. ``nbgrader autograde`` on exercise 05 handed in two ways (the solution, and the blank with two answers
   written and one graded cell edited to pass): nbgrader's score for every graded cell equals the one
   ``parlab grade`` gives the same two notebooks. (A blank scores 0 under nbval: tests/test_notebooks.py.)

Exercise 05 is the one autograded because its checks are pure (no ranks), so its kernels start and finish in
seconds; the restoring of edited cells it exercises is the same for every exercise.
"""
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from parlab import course
from parlab.course import grader

nbgrader_api = pytest.importorskip("nbgrader.api", reason='nbgrader is not installed: pip install -e ".[nbgrader]" (the test command does)')

ROOT = Path(__file__).resolve().parents[1]
EX = "05_pipeline_schedules"


def _nbgrader(course_dir: Path, *args: str) -> subprocess.CompletedProcess:
    # nbgrader runs `alembic` (its database migrations) by name: the environment's scripts must be on PATH
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args, "--CourseDirectory.root=" + str(course_dir)],
                          cwd=course_dir, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _by_id(nb) -> dict:
    return {c.metadata["nbgrader"]["grade_id"]: c for c in nb.cells}


def _submissions() -> dict[str, nbformat.NotebookNode]:
    """The two hand-ins: the solution notebook itself, and an edited partial answer (two of three functions
    written, a graded cell edited)."""
    solution = course.read(ROOT / "exercises" / "solutions" / f"{EX}.ipynb")
    edited = course.read(ROOT / "exercises" / f"{EX}.ipynb")
    done, cells = _by_id(solution), _by_id(edited)
    cells["answer-bubble_of_step"].source = done["answer-bubble_of_step"].source   # two answers written
    cells["check_1f1b_valid-one_f_one_b_rank"].source = "print('all good')"   # a graded cell edited to pass
    return {"solution": solution, "edited": edited}


@pytest.fixture(scope="module")
def nbgrader_course(tmp_path_factory):
    """A course directory released and autograded by nbgrader, and the same hand-ins graded by parlab."""
    root = tmp_path_factory.mktemp("nbgrader-course")
    plain = root.parent / (root.name + "-parlab")                     # parlab grade's folder: <student>/NN.ipynb
    for student, nb in _submissions().items():
        (root / "submitted" / student / "all").mkdir(parents=True)     # the one notebook handed in
        nbformat.write(nb, str(root / "submitted" / student / "all" / f"{EX}.ipynb"))
        (plain / student).mkdir(parents=True)
        nbformat.write(nb, str(plain / student / f"{EX}.ipynb"))
    with ThreadPoolExecutor(1) as pool:                                 # parlab grades while nbgrader works
        parlab_grades = pool.submit(grader.grade, plain, root / "parlab-gradebook", jobs=2, progress=lambda line: None)
        (root / "source" / "all").mkdir(parents=True)
        for sol in sorted((ROOT / "exercises" / "solutions").glob("*.ipynb")):
            shutil.copy(sol, root / "source" / "all" / sol.name)
        _nbgrader(root, "generate_assignment", "all", "--create")
        _nbgrader(root, "autograde", "all", "--create")
        ours = {r.student: {c["grade_id"]: c["points"] * c["passed"] for c in r.checks}
                for r in parlab_grades.result()}
    theirs = {}
    with nbgrader_api.Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        for student in ("solution", "edited"):
            nb = gb.find_submission_notebook(EX, "all", student)
            theirs[student] = {g.name: g.score for g in nb.grades}
    return root, theirs, ours


def test_nbgrader_releases_from_the_solutions_exactly_the_exercises_parlab_builds(nbgrader_course):
    root, _, _ = nbgrader_course
    released = sorted((root / "release" / "all").glob("*.ipynb"))
    assert [p.name for p in released] == sorted(p.name for p in (ROOT / "exercises").glob("*.ipynb"))
    for path in released:
        theirs, ours = course.read(path), course.read(ROOT / "exercises" / path.name)
        for k, (a, b) in enumerate(zip(theirs.cells, ours.cells)):
            assert (a.cell_type, a.source, dict(a.metadata)) == (b.cell_type, b.source, dict(b.metadata)), \
                f"{path.name}, cell {k}: nbgrader releases it differently"
        assert len(theirs.cells) == len(ours.cells), path.name


def test_nbgrader_autograde_scores_every_check_as_parlab_grade_does(nbgrader_course):
    _, theirs, ours = nbgrader_course
    assert theirs == ours
    total = {student: sum(scores.values()) for student, scores in ours.items()}
    # the edited graded cell was restored by both (it checks the unwritten one_f_one_b_rank, so it fails),
    # and the cell holding the two bubble functions passes their two checks only
    assert total == {"solution": 5, "edited": 2}, total
