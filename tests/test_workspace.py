"""parlab course open: the student works in a git-ignored copy; tracked notebooks stay clean; git pull merges in."""
import json
import platform
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from parlab import cli
from parlab.course import workspace

ROOT = Path(__file__).resolve().parents[1]


def _course(tmp_path) -> Path:
    """A small course checkout: two lessons, one exercise, one solution."""
    root = tmp_path / "repo"
    for rel in ("lessons/00_why_parallel.ipynb", "lessons/01_collectives.ipynb", "exercises/00_ring_allreduce.ipynb",
                "exercises/solutions/00_ring_allreduce.ipynb"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, root / rel)
    return root


def _run_cell(path: Path):
    """What JupyterLab's autosave does after a cell ran: an output and an execution count."""
    nb = nbformat.read(path, 4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.execution_count = 1
    code.outputs = [nbformat.v4.new_output("stream", text="ran\n")]
    nbformat.write(nb, path)


def test_working_copy_has_every_lesson_and_exercise_and_a_start_page(tmp_path):
    root = _course(tmp_path)
    report = workspace.working_copy(root)
    dest = root / workspace.WORKDIR
    assert sorted(report["added"]) == ["exercises/00_ring_allreduce.ipynb", "lessons/00_why_parallel.ipynb",
                                       "lessons/01_collectives.ipynb"]
    assert not (dest / "exercises" / "solutions").exists()
    start = nbformat.read(dest / "START.ipynb", 4).cells[0].source
    for rel in report["added"]:
        assert f"]({rel})" in start and (dest / rel).exists()        # every link resolves inside the copy
    assert "Lesson 01: Collectives and process groups" in start and "git pull" in start


def test_running_in_the_copy_leaves_the_checkout_clean_and_pull_merges(tmp_path):
    root = _course(tmp_path)
    dest = root / workspace.WORKDIR
    workspace.working_copy(root)
    tracked = (root / "lessons" / "00_why_parallel.ipynb").read_bytes()
    _run_cell(dest / "lessons" / "00_why_parallel.ipynb")            # the student ran lesson 00 ...
    edited = dest / "lessons" / "01_collectives.ipynb"               # ... and wrote in lesson 01
    nb = nbformat.read(edited, 4)
    nb.cells.append(nbformat.v4.new_markdown_cell("my notes"))
    nbformat.write(nb, edited)
    assert (root / "lessons" / "00_why_parallel.ipynb").read_bytes() == tracked

    # git pull: both lessons changed upstream, and a new exercise arrived
    for name in ("00_why_parallel", "01_collectives"):
        nb = nbformat.read(root / "lessons" / f"{name}.ipynb", 4)
        nb.cells.append(nbformat.v4.new_markdown_cell("new this week"))
        nbformat.write(nb, root / "lessons" / f"{name}.ipynb")
    shutil.copy(ROOT / "exercises" / "01_process_groups.ipynb", root / "exercises" / "01_process_groups.ipynb")
    report = workspace.working_copy(root)
    assert report["added"] == ["exercises/01_process_groups.ipynb"]
    assert report["updated"] == ["lessons/00_why_parallel.ipynb"]    # only ran: replaced by the new version
    assert report["conflicts"] == ["lessons/01_collectives.ipynb"]   # edited: kept, the new one beside it
    assert nbformat.read(dest / "lessons" / "00_why_parallel.ipynb", 4).cells[-1].source == "new this week"
    assert nbformat.read(edited, 4).cells[-1].source == "my notes"
    assert nbformat.read(edited.with_name("01_collectives.updated.ipynb"), 4).cells[-1].source == "new this week"
    assert workspace.working_copy(root)["added"] == []                 # idempotent
    assert json.loads((dest / ".parlab-origin.json").read_text())


def _as_jupyterlab_saves_after_a_run(path: Path, version: str):
    """A run in JupyterLab: an output, and the kernel's language_info (here another Python) in the metadata."""
    _run_cell(path)
    nb = nbformat.read(path, 4)
    nb.metadata["language_info"] = dict(nb.metadata.get("language_info", {}), version=version)
    nbformat.write(nb, path)


def test_copies_carry_the_kernel_metadata_jupyterlab_would_write_and_running_is_not_editing(tmp_path):
    root = _course(tmp_path)
    dest = root / workspace.WORKDIR
    workspace.working_copy(root)
    kernel = workspace.kernel_metadata()
    assert kernel["language_info"]["version"] == platform.python_version()      # what ipykernel will report
    for rel in ("START.ipynb", "lessons/00_why_parallel.ipynb", "exercises/00_ring_allreduce.ipynb"):
        meta = nbformat.read(dest / rel, 4).metadata
        assert {k: meta[k] for k in kernel} == kernel, rel
    assert nbformat.read(root / "lessons" / "00_why_parallel.ipynb", 4).metadata["language_info"] == {"name": "python"}
    start = (dest / "START.ipynb").stat().st_mtime_ns
    _as_jupyterlab_saves_after_a_run(dest / "lessons" / "00_why_parallel.ipynb", "3.99.0")
    nb = nbformat.read(root / "lessons" / "00_why_parallel.ipynb", 4)            # the course changes it
    nb.cells.append(nbformat.v4.new_markdown_cell("new this week"))
    nbformat.write(nb, root / "lessons" / "00_why_parallel.ipynb")
    report = workspace.working_copy(root)
    assert report["updated"] == ["lessons/00_why_parallel.ipynb"] and report["conflicts"] == []
    assert (dest / "START.ipynb").stat().st_mtime_ns == start           # unchanged: not rewritten under an open tab


def test_a_copy_made_by_an_earlier_version_is_not_taken_for_an_edited_one(tmp_path):
    """.parlab-origin.json files written before the fingerprint ignored kernel metadata hold the older hash."""
    root = _course(tmp_path)
    dest = root / workspace.WORKDIR
    workspace.working_copy(root)
    origin = dest / ".parlab-origin.json"
    old = {rel: workspace._fingerprint(root / rel, kernel_keys=True)
           for rel in ("lessons/00_why_parallel.ipynb", "lessons/01_collectives.ipynb",
                       "exercises/00_ring_allreduce.ipynb")}
    origin.write_text(json.dumps(old))
    for rel in old:                                          # as the earlier version copied them
        shutil.copy(root / rel, dest / rel)
    report = workspace.working_copy(root)
    assert report["conflicts"] == [] and sorted(report["kept"]) == sorted(old)
    assert json.loads(origin.read_text())["fingerprint"] == 2
    assert workspace.working_copy(root)["kept"] == report["kept"]


def test_the_copy_is_git_ignored_and_the_readme_opens_it():
    out = subprocess.run(["git", "check-ignore", "-q", f"{workspace.WORKDIR}/lessons/00_why_parallel.ipynb"],
                         cwd=ROOT, capture_output=True)
    assert out.returncode == 0, "my-course/ must be git-ignored"
    quick = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert "parlab course open" in quick and "git pull" in quick


def test_open_outside_a_checkout_says_where_to_run_it(tmp_path, capsys):
    assert cli.main(["course", "open", "--root", str(tmp_path), "--no-browser"]) == 2
    assert "repository root" in capsys.readouterr().err


@pytest.mark.parametrize("euid,added", [(0, True), (1000, False)])
def test_open_as_root_adds_allow_root_and_says_so(tmp_path, monkeypatch, capsys, euid, added):
    """JupyterLab exits at once as root ("Running as root is not recommended") unless --allow-root: in a container
    the student would see only that. As root, parlab adds the flag and says why."""
    root = _course(tmp_path)
    calls = []
    monkeypatch.setattr(workspace.os, "geteuid", lambda: euid)
    monkeypatch.setattr(workspace, "_run_lab", lambda cmd, cwd, env=None: calls.append(cmd) or 0)
    monkeypatch.setattr(workspace.shutil, "which", lambda name: "/usr/bin/" + name)
    assert workspace.open_course(root, browser=False) == 0
    assert ("--allow-root" in calls[0]) is added
    assert "--LabApp.default_url=/lab/tree/START.ipynb" in calls[0]   # the printed URL opens START (served: my-course/)
    assert ("JupyterLab starts only with --allow-root" in capsys.readouterr().out) is added


def test_stopping_course_open_stops_jupyterlab_too(tmp_path):
    """`parlab course open` waits for JupyterLab and passes a SIGTERM on to it (JupyterLab then stops its kernels);
    before, the parent died alone and JupyterLab with its kernels kept running. Here a stand-in for JupyterLab that
    exits 7 on SIGTERM; the parent must report its exit status."""
    import signal
    import subprocess
    import sys
    import textwrap
    import time
    ready = tmp_path / "ready"
    child = (f"import signal, sys, time, pathlib; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); "
             f"pathlib.Path({str(ready)!r}).write_text('up'); time.sleep(60)")
    parent = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from parlab.course import workspace
        sys.exit(workspace._run_lab([sys.executable, "-c", {child!r}], Path(".")))
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), "the stand-in never started"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 7          # the child got the SIGTERM and its status came back
