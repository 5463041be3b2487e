"""The exercises themselves: solutions pass their graders, student notebooks fail every graded cell.

Notebooks run under nbval in a subprocess (`pytest --nbval-lax --nbval-current-env`), exactly as a lecturer
grades them (exercises/README.md); the JUnit XML it writes is read back with `parlab.course.scorecard`. This is
the suite's only run of the solutions; the two folders are graded at once (two nbval processes side by side: each
mostly waits on its kernel). The lessons are executed in tests/test_viz_browser.py, which checks their figures.

The kernels are forked by a warm kernel server (`parlab.course.kernel_server`, as `parlab grade`'s are): nbval
is told `--nbval-kernel-name parlab-warm`, a kernel spec (on JUPYTER_PATH) of this environment's Python whose
provisioner asks the server; the same kernel, 2-3.5 s less CPU to start each of the 23.

The Chinese course (`parlab.course.translated`) is graded the same way beside them, with parlab speaking Chinese
(PARLAB_LANG=zh_CN): its blanks fail every graded cell with Chinese feedback, and its solutions pass. The solutions
run in Chinese only: a Chinese exercise's code cells are the English ones byte for byte (tests/test_i18n.py checks
it, nbgrader checksums included), and in English every message is its own msgid, so the English solutions run the
very code that passes here (and `parlab grade` passes English solutions in tests/test_grade_redteam.py).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parlab import course
from parlab.course.kernel import write_kernel_spec

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "exercises" / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
# The Chinese blanks graded: three kinds of exercise (ranks and collectives, pure schedules, FSDP's units). Their
# code cells are the English ones byte for byte (tests/test_i18n.py), so what differs is only the language of the
# feedback, which every message's translation decides (tests/test_i18n.py checks each one's fields); all ten
# would cost seven more kernels for no other check.
ZH_BLANKS = [p for p in EXERCISES if p.stem.startswith(("00_", "05_", "09_"))]


def _env(lang: str = "en", jupyter: Path | None = None) -> dict:
    return {**os.environ, "PARLAB_LANG": lang,            # tests/nbval_kernel_retry.py, on the plugin path
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
            **({"JUPYTER_PATH": str(jupyter)} if jupyter else {})}


def nbval(paths, junit: Path, cell_timeout: int = 300, cwd: Path = ROOT, lang: str = "en",
          jupyter: Path | None = None) -> subprocess.Popen:
    """Grade notebooks the way exercises/README.md tells lecturers to (started, not waited for); pytest's own
    output goes to `junit` with the suffix .txt. The one addition, tests/nbval_kernel_retry.py, starts a kernel
    again when it dies before running anything (a port raced away by the rest of the suite); the
    `-p parlab._deferred_imports` of pyproject.toml is named again for the runs in the Chinese course's folder.
    With `jupyter` (a `write_kernel_spec` folder) the kernels are the warm ``parlab-warm`` ones."""
    kernel = ["--nbval-kernel-name", "parlab-warm"] if jupyter else ["--nbval-current-env"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "nbval_kernel_retry",
           "-p", "parlab._deferred_imports",        # pyproject.toml's addopts, which the Chinese course's folder lacks
           "--nbval-lax", *kernel,
           f"--nbval-cell-timeout={cell_timeout}", f"--junitxml={junit}", *map(str, paths)]
    with open(junit.with_suffix(".txt"), "w") as log:
        return subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env=_env(lang, jupyter))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """{"solutions"|"students"|"students_zh": (exit code, pytest's output, JUnit XML path), "zh_root": the
    Chinese course}: the Chinese solutions, the English blanks and the Chinese blanks graded side by side."""
    from parlab.course.kernel_server import KernelServer
    from parlab.course.translated import write_course
    tmp = tmp_path_factory.mktemp("graded")
    zh = write_course(ROOT, "zh_CN", tmp / "course-zh")
    server = KernelServer(env=_env())                  # the nested runs' PYTHONPATH, so that it serves them
    assert server.ready
    jupyter = write_kernel_spec(tmp / "jupyter", server.address, name="parlab-warm")
    procs = {"students": nbval([p.relative_to(ROOT) for p in EXERCISES], tmp / "students.xml", jupyter=jupyter)}
    procs.update({k: nbval([Path(folder) / p.name for p in paths], tmp / f"{k}.xml", cwd=zh, lang="zh_CN",
                           jupyter=jupyter)
                  for k, folder, paths in (("solutions", "exercises/solutions", SOLUTIONS),
                                           ("students_zh", "exercises", ZH_BLANKS))})
    try:
        out = {k: (p.wait(timeout=900), (tmp / f"{k}.txt").read_text(), tmp / f"{k}.xml") for k, p in procs.items()}
        out["zh_root"] = zh
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        server.close()


def test_solution_notebooks_pass_their_graders(graded):
    """The solutions (in Chinese, see the module's docstring) pass every graded cell."""
    assert len(SOLUTIONS) >= 2
    code, out, xml = graded["solutions"]
    assert code == 0, out[-4000:]
    rows = course.scorecard(xml, root=graded["zh_root"])
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


def test_chinese_blanks_fail_every_graded_cell_in_chinese(graded):
    """The same blanks in Chinese: the same checks fail, with Chinese feedback."""
    zh = graded["zh_root"]
    assert len(ZH_BLANKS) == 3
    blanks = course.scorecard(graded["students_zh"][2], root=zh)
    english = [r for r in course.scorecard(graded["students"][2], root=ROOT)
               if any(r["file"].endswith(p.name) for p in ZH_BLANKS)]
    assert sorted((r["file"], r["cell"]) for r in blanks) == sorted((r["file"], r["cell"]) for r in english)
    for r in blanks:
        assert not r["passed"] and "AssertionError" in r["message"], r
        assert re.search(r"[\u4e00-\u9fff]", r["message"]), f"feedback not in Chinese: {r['message'][:300]}"
