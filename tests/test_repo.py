"""Repository invariants: CI runs the README's test command; notebooks are committed stripped."""
import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quick, flags=re.S)


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    assert len(commands) == 2, "the Quickstart has exactly two commands: open the course, run the tests"
    course, tests = commands
    assert "parlab course open" in course and "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, ".ci/run must run the README's test command verbatim"


def test_notebooks_are_committed_stripped():
    dirty = []
    for path in sorted(ROOT.glob("lessons/*.ipynb")) + sorted(ROOT.glob("exercises/**/*.ipynb")):
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
                dirty.append(str(path.relative_to(ROOT)))
                break
    assert not dirty, f"strip these notebooks (parlab course strip): {dirty}"


def test_import_is_quiet():
    out = subprocess.run([sys.executable, "-W", "error", "-c", "import parlab, parlab.viz"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_course_maps_list_every_lesson_and_exercise():
    lessons_readme = (ROOT / "lessons" / "README.md").read_text()
    top = (ROOT / "README.md").read_text()
    exercises_readme = (ROOT / "exercises" / "README.md").read_text()
    for nb in sorted(ROOT.glob("lessons/*.ipynb")):
        assert f"]({nb.name})" in lessons_readme, f"lessons/README.md does not link {nb.name}"
        assert f"](lessons/{nb.name})" in top, f"README.md's course map does not link {nb.name}"
    for nb in sorted(ROOT.glob("exercises/*.ipynb")):
        assert f"](../exercises/{nb.name})" in lessons_readme, f"lessons/README.md does not link exercise {nb.name}"
        assert f"]({nb.name})" in exercises_readme, f"exercises/README.md does not list {nb.name}"


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_script_loads_and_says_how_to_run_it(script, capsys):
    """The benchmarks are not run by the suite (their figures live in benchmarks/README.md), but each must still
    import what it uses from parlab: `--help` runs the script's imports and argument parser, in process."""
    import runpy
    import sys
    argv = sys.argv
    sys.argv = [script, "--help"]
    try:
        with pytest.raises(SystemExit) as stop:
            runpy.run_path(str(ROOT / "benchmarks" / script), run_name="__main__")
    finally:
        sys.argv = argv
    assert stop.value.code == 0 and "usage" in capsys.readouterr().out.lower()
