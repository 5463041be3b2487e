"""nbgrader as a client: a course that already runs on nbgrader takes parlab's solution notebooks as its
*source* notebooks, and nbgrader's own commands release and grade them exactly as parlab does.

The lecturer's steps (nbgrader 0.9's documented layout, ``source/<assignment>/``, the course's
``exercises/nbgrader_config.py`` copied in, as exercises/README.md says):

1. ``nbgrader generate_assignment`` on all ten solutions: every released notebook has the very cells of
   parlab's ``exercises/NN.ipynb`` (sources with nbgrader's stub, grade ids, points, locks and checksums);
2. ``nbgrader autograde`` on two exercises, each handed in three ways by the same three students:
   exercise 05 (pure schedules, with figures): the solution; the blank with two answers written and one graded
   cell edited to pass; a blank whose answer cell rebinds every check to a no-op. Exercise 00 (ranks and
   messages, run by `parlab.run` inside nbgrader's kernel): the solution; the two ring phases written and
   ring_all_reduce done with the library's all-reduce (the built-in collective its traffic check refuses); a
   solution whose answer cell rebinds every check to a no-op. nbgrader's score for every graded cell equals the
   one ``parlab grade`` gives the same notebooks, the cheats 0 from both
   (`parlab.course.gradebook.nbgrader_execute`). (A blank scores 0 under nbval: tests/test_notebooks.py.)

3. the same in Chinese, in the same assignment (one nbgrader run each): the Chinese source notebooks
   (`parlab.course.translated`, named NAME_zh) are released as the Chinese exercises parlab builds, and exercise
   05's three hand-ins in Chinese get the same scores.
"""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from parlab import course
from parlab.course import gradebook, translated
from parlab.course.kernel_server import KernelServer

# nbgrader (and its database layer) is imported by the fixture, not when every pytest worker collects the suite
pytestmark = pytest.mark.skipif(importlib.util.find_spec("nbgrader") is None,
                                reason='nbgrader is not installed: pip install -e ".[nbgrader]" (the test command does)')

ROOT = Path(__file__).resolve().parents[1]
EX = "05_pipeline_schedules"
RANKS = "00_ring_allreduce"        # an exercise whose checks run ranks (parlab.run) inside the grader's kernel


def _nbgrader(course_dir: Path, *args: str) -> subprocess.CompletedProcess:
    # nbgrader runs `alembic` (its database migrations) by name: the environment's scripts must be on PATH
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args, "--CourseDirectory.root=" + str(course_dir)],
                          cwd=course_dir, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _by_id(nb) -> dict:
    return {c.metadata["nbgrader"]["grade_id"]: c for c in nb.cells}


CHECKS = ("check_1f1b_valid", "check_1f1b_reference", "check_1f1b_bubble", "check_bubble_of_step",
          "check_bubble_over_ideal")


def _submissions(lang: str = "en") -> dict[str, nbformat.NotebookNode]:
    """The three hand-ins: the solution notebook itself, an edited partial answer (two of three functions
    written, a graded cell edited), and a blank whose answer cell rebinds every check to a no-op, in `lang`."""
    solution = translated.translated_solution(ROOT / "exercises" / "solutions" / f"{EX}.ipynb", lang)
    edited = course.make_exercise(solution, f"{EX}.ipynb")
    done, cells = _by_id(solution), _by_id(edited)
    cells["answer-bubble_of_step"].source = done["answer-bubble_of_step"].source   # two answers written
    cells["check_1f1b_valid-one_f_one_b_rank"].source = "print('all good')"   # a graded cell edited to pass
    cheat = course.make_exercise(solution, f"{EX}.ipynb")
    answer = _by_id(cheat)["answer-one_f_one_b_rank"]
    answer.source += "\n" + "\n".join(f"grading.{name} = lambda *a, **k: None" for name in CHECKS)
    return {"solution": solution, "edited": edited, "cheat": cheat}


RANK_CHECKS = ("check_ring_reduce_scatter", "check_ring_all_gather", "check_ring_all_reduce",
               "check_ring_all_reduce_traffic")


def _rank_submissions() -> dict[str, nbformat.NotebookNode]:
    """Exercise 00 handed in by the same three students: the solution; the ring phases written and the all-reduce
    left to the library (``comm.all_reduce``: a right sum, not a ring); the solution with every check rebound."""
    solution = translated.translated_solution(ROOT / "exercises" / "solutions" / f"{RANKS}.ipynb", "en")
    builtin = course.make_exercise(solution, f"{RANKS}.ipynb")
    done, cells = _by_id(solution), _by_id(builtin)
    for part in ("ring_reduce_scatter", "ring_all_gather"):
        cells[f"answer-{part}"].source = done[f"answer-{part}"].source
    cells["answer-ring_all_reduce"].source = "def ring_all_reduce(x):\n    comm.all_reduce(x)\n    return x\n"
    cheat = nbformat.from_dict(solution)
    _by_id(cheat)["answer-ring_all_reduce"].source += "\n" + "\n".join(
        f"grading.{name} = lambda *a, **k: None" for name in RANK_CHECKS)
    return {"solution": solution, "edited": builtin, "cheat": cheat}


@pytest.fixture(scope="module")
def nbgrader_course(tmp_path_factory):
    """A course directory released and autograded by nbgrader, and the same hand-ins graded by parlab."""
    root = tmp_path_factory.mktemp("nbgrader-course")
    plain = root.parent / (root.name + "-parlab")                     # parlab grade's folder: <student>/NN.ipynb
    hand_ins = [("en", f"{EX}.ipynb", _submissions("en")), ("zh_CN", f"{EX}_zh.ipynb", _submissions("zh_CN")),
                ("en", f"{RANKS}.ipynb", _rank_submissions())]
    for lang, name, notebooks in hand_ins:
        for student, nb in notebooks.items():
            (root / "submitted" / student / "all").mkdir(parents=True, exist_ok=True)   # the notebooks handed in
            nbformat.write(nb, str(root / "submitted" / student / "all" / name))
            folder = plain / ("en" if lang == "en" else "zh") / student
            folder.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, str(folder / name.replace("_zh", "")))
    zh_course = translated.write_course(ROOT, "zh_CN", root.parent / (root.name + "-zh"))
    # parlab grades while nbgrader works, both languages' kernels forked from one warm server
    with KernelServer(env=gradebook.worker_env()) as server, ThreadPoolExecutor(1) as pool:
        parlab_grades = pool.submit(gradebook.grade, plain / "en", root / "parlab-gradebook", jobs=2,
                                    progress=lambda line: None, server=server.address)
        parlab_grades_zh = pool.submit(gradebook.grade, plain / "zh", root / "parlab-gradebook-zh", jobs=2,
                                       progress=lambda line: None, lang="zh_CN",
                                       exercises=zh_course / "exercises", server=server.address)
        (root / "source" / "all").mkdir(parents=True)
        for sol in sorted((ROOT / "exercises" / "solutions").glob("*.ipynb")):
            shutil.copy(sol, root / "source" / "all" / sol.name)
            shutil.copy(zh_course / "exercises" / "solutions" / sol.name, root / "source" / "all" / f"{sol.stem}_zh.ipynb")
        shutil.copy(ROOT / "exercises" / "nbgrader_config.py", root / "nbgrader_config.py")   # as README says
        _nbgrader(root, "generate_assignment", "all")
        _nbgrader(root, "autograde", "all")
        _nbgrader(root, "generate_feedback", "all")
        ours, ours_zh = {}, {}                                          # {student: {grade id: points}}
        for mine, grades in ((ours, parlab_grades), (ours_zh, parlab_grades_zh)):
            for r in grades.result():                                   # one Result per (student, exercise)
                mine.setdefault(r.student, {}).update({c["grade_id"]: c["points"] * c["passed"] for c in r.checks})
    from nbgrader import api as nbgrader_api
    theirs, theirs_zh = {}, {}
    with nbgrader_api.Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        for student in ("solution", "edited", "cheat"):
            theirs[student] = {g.name: g.score for ex in (EX, RANKS)
                               for g in gb.find_submission_notebook(ex, "all", student).grades}
            theirs_zh[student] = {g.name: g.score for g in gb.find_submission_notebook(f"{EX}_zh", "all", student).grades}
    return root, theirs, ours, theirs_zh, zh_course, ours_zh


@pytest.mark.parametrize("lang", ["en", "zh_CN"])
def test_nbgrader_releases_from_the_solutions_exactly_the_exercises_parlab_builds(nbgrader_course, lang):
    root, zh_course = nbgrader_course[0], nbgrader_course[4]
    suffix = "_zh" if lang == "zh_CN" else ""
    released = sorted(p for p in (root / "release" / "all").glob("*.ipynb") if p.stem.endswith("_zh") == bool(suffix))
    assert [p.name for p in released] == sorted(p.stem + suffix + ".ipynb" for p in (ROOT / "exercises").glob("*.ipynb"))
    for path in released:
        built = (ROOT if lang == "en" else zh_course) / "exercises" / (path.stem.removesuffix(suffix) + ".ipynb")
        theirs, ours = course.read(path), course.read(built)
        for k, (a, b) in enumerate(zip(theirs.cells, ours.cells)):
            assert (a.cell_type, a.source, dict(a.metadata)) == (b.cell_type, b.source, dict(b.metadata)), \
                f"{path.name}, cell {k}: nbgrader releases it differently"
        assert len(theirs.cells) == len(ours.cells), path.name


def test_nbgrader_autograde_scores_every_check_as_parlab_grade_does(nbgrader_course):
    _, theirs, ours, theirs_zh, zh_course, ours_zh = nbgrader_course
    assert theirs == ours, {(student, k): (v, ours.get(student, {}).get(k)) for student, scores in theirs.items()
                            for k, v in scores.items() if ours.get(student, {}).get(k) != v}
    graded05 = {c.metadata["nbgrader"]["grade_id"] for c in course.read(ROOT / "exercises" / f"{EX}.ipynb").cells
                if c.metadata.get("nbgrader", {}).get("grade")}
    of05 = {student: {k: v for k, v in scores.items() if k in graded05} for student, scores in theirs.items()}
    assert theirs_zh == of05                   # the same hand-ins in Chinese: the same scores, from nbgrader
    assert ours_zh == of05                     # and from parlab grade --lang zh against the Chinese release
    reports = zh_course.parent / zh_course.name.removesuffix("-zh") / "parlab-gradebook-zh"
    for page in [reports / "summary.html", *(reports / "feedback").glob("*.md")]:
        assert re.search(r"[\u4e00-\u9fff]", page.read_text(encoding="utf-8")), f"{page.name} is not in Chinese"
    edited = (reports / "feedback" / "edited.md").read_text(encoding="utf-8")      # each check named in Chinese
    assert edited.count("### ") == 5 and edited.count("评分：") == 5, edited
    total = {student: (sum(v for k, v in scores.items() if k in graded05),
                       sum(v for k, v in scores.items() if k not in graded05)) for student, scores in ours.items()}
    # the edited graded cell was restored by both (it checks the unwritten one_f_one_b_rank, so it fails),
    # and the cell holding the two bubble functions passes their two checks only; the checks rebound to no-ops
    # earn nothing from either (nbgrader with the course's nbgrader_config.py: plain nbgrader gave it 5 of 5)
    # exercise 00: the ring phases earn their two checks; an all-reduce by the library is a right sum but not a
    # ring, and both of ring_all_reduce's checks refuse it
    assert total == {"solution": (5, 4), "edited": (2, 2), "cheat": (0, 0)}, total


def test_nbgrader_runs_a_chinese_notebook_in_chinese_and_its_figures_pass_in_chromium(nbgrader_course, tmp_path):
    """A Chinese notebook (metadata parlab.lang) is autograded with parlab speaking Chinese, whatever the language
    of the shell running nbgrader (`GuardedExecute`): the failing check's message, and the figure exercise 05
    draws from the student's schedule, are in Chinese. The figures nbgrader drew (exercise 05, both languages: the
    exercises' only executed figures with outputs kept in the suite) pass the browser figure check."""
    from parlab.course import figcheck
    root = nbgrader_course[0]
    autograded = root / "autograded"
    errors = [o for c in course.read(autograded / "edited" / "all" / f"{EX}_zh.ipynb").cells
              for o in c.get("outputs", []) if o.get("output_type") == "error" and o["ename"] != "NotImplementedError"]
    assert errors and all(re.search(r"[\u4e00-\u9fff]", o["evalue"]) for o in errors), [o["evalue"][:200] for o in errors]
    if figcheck.chromium_path() is None:
        pytest.skip("needs Debian's chromium (apt-get install -y chromium); .ci/run installs it")
    solved = [autograded / "solution" / "all" / f"{EX}{suffix}.ipynb" for suffix in ("", "_zh")]
    problems = figcheck.run(solved, tmp_path)
    assert problems == [], "\n".join(problems)
    shown = json.loads((tmp_path / "figures.json").read_text())
    assert sorted(f["name"].split("/")[0] for f in shown) == [EX, f"{EX}_zh"], shown


def test_nbgrader_feedback_loads_plotly_js_once_from_its_cdn_instead_of_a_copy_per_page(nbgrader_course):
    # the notebook renderer puts the 4.8 MB plotly.js bundle into each notebook; the course's config makes each
    # feedback page load it from plotly's CDN instead (parlab.course.gradebook.nbgrader_feedback; 5.0 MB before)
    import plotly.offline
    root = nbgrader_course[0]
    pages = sorted((root / "feedback").glob("*/all/*.html"))
    assert len(pages) == 9                          # 3 students x (05 in English and Chinese, 00 in English)
    cdn = f"cdn.plot.ly/plotly-{plotly.offline.get_plotlyjs_version()}.min.js"
    for page in pages:
        html = page.read_text(encoding="utf-8")
        assert page.stat().st_size < 1_000_000, f"{page}: {page.stat().st_size} bytes"
        assert "plotly.js v" not in html                          # no bundle left inline
    # the pages whose notebook ran the renderer's set-up cell load plotly.js from the CDN instead
    assert sum(cdn in page.read_text(encoding="utf-8") for page in pages) >= 2

