"""``parlab grade``: grade a folder of submissions into a gradebook, per-student feedback and a class summary.

    parlab grade SUBMISSIONS [--out DIR] [--jobs N] [--wall S] [--cell-timeout S] [--cpu-limit S] [--memory-gb G]
                             [--lang {en,zh}]

For each submission (`collect`: any layout, names with dots, spaces, non-ASCII):

1. **restore** every graded and read-only cell from the released exercise by its nbgrader ``grade_id``
   (`collect.restore`), noting each edit or deletion: wrapping a graded cell in ``try/except``, editing it
   or deleting it changes nothing but the report;
2. **run** it in its own process (`worker`) with a wall-time limit (the whole process group, kernel and
   ranks, is killed after `wall` seconds), a memory limit (``RLIMIT_AS``, inherited by the kernel and the
   ranks), a per-cell limit and a CPU-time limit for the student's code inside each check; `jobs`
   notebooks run side by side, and one runaway submission never stops the batch;
3. **score** every graded cell of the *released* exercise (a deleted one still counts, as failed if it
   could not run), with a status per notebook: ok, missing, timeout (a cell or the notebook ran out of
   time, or a check hit the CPU limit), crashed (the kernel died: ``os._exit``, memory), tampered
   (grading or parlab rebound; no check of that notebook counts).

Outputs in `out`: ``gradebook.csv`` (one row per student and exercise; per-check pass/fail columns),
``gradebook.json`` (everything, with full tracebacks), ``feedback/<student>.md`` and ``summary.html``
(pass rate per check, a plotly figure). See `report`.

``--lang`` (default: ``PARLAB_LANG``, else the locale, else English) is the language of the feedback: the
kernels that grade run with ``PARLAB_LANG`` set to it, so every check explains itself in it, and the reports
are written in it. The gradebook's codes (statuses, ``pass``/``fail``, column names) stay as they are.

Like otter-grader, grading runs the notebook afresh in a separate process; like nbgrader, it trusts the
released cells, not the submitted ones. Run it in a throw-away container: a submission is arbitrary code.

A course graded by nbgrader instead gets the same tamper check from `nbgrader_execute.GuardedExecute`, which the
shipped ``exercises/nbgrader_config.py`` puts in place of nbgrader's Execute step, and feedback pages without a
copy of plotly.js each from `nbgrader_feedback.PlotlyFromCDN`.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from parlab.i18n.args import ArgumentParser
from parlab.i18n import _, language, normalize, use_language
from parlab.course.gradebook.collect import Submission, collect, released_exercises, restore
from parlab.course.kernel_server import KernelServer

__all__ = ["Limits", "Result", "grade", "grade_one", "worker_env", "main"]


@dataclass
class Limits:
    wall: float = 900.0            # seconds for one notebook, kernel start included
    cell_timeout: float = 300.0    # seconds for one cell (the kernel is interrupted, the notebook goes on)
    cpu_limit: float = 60.0        # CPU seconds the student's code may use inside one check (per rank)
    memory_gb: float = 8.0         # address space of the notebook's processes (RLIMIT_AS), GiB


@dataclass
class Result:
    student: str
    exercise: str
    status: str                                            # ok / missing / timeout / crashed / tampered
    checks: list[dict] = field(default_factory=list)       # one per graded cell of the released exercise
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> int:
        return sum(c["passed"] for c in self.checks)

    @property
    def points(self) -> float:
        return sum(c["points"] for c in self.checks if c["passed"])

    @property
    def max_points(self) -> float:
        return sum(c["points"] for c in self.checks)


def _graded(released: nbformat.NotebookNode, exercise: str = "") -> list[dict]:
    """The graded cells of a released exercise: grade id, points, and what each checks (its docstring, in the
    language in force: `parlab.i18n.notebooks.docstring_translation`)."""
    from parlab.course.notebooks import ROOT
    from parlab.i18n.notebooks import cell_docstring, docstring_translation
    out = []
    for cell in released.cells:
        m = cell.metadata.get("nbgrader", {})
        if m.get("grade"):
            doc = cell_docstring(cell.source)
            label = docstring_translation(ROOT, language(), exercise, cell.get("id", ""), doc) if doc else None
            out.append({"grade_id": m["grade_id"], "label": label or m["grade_id"],
                        "points": float(m.get("points", 1))})
    return out


def _limit_memory(gb: float):
    def apply():
        os.setsid()                                        # its own process group: killed as one on timeout
        if gb:
            limit = int(gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


def worker_env() -> dict:
    """The environment of a grading worker, its kernel and the kernel's ranks: parlab importable from anywhere,
    and speaking the reports' language."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[3]),
                                                                     os.environ.get("PYTHONPATH")])),
                PARLAB_LANG=language())


def grade_one(sub: Submission, released_path: Path, limits: Limits, server: str = "") -> Result:
    """Restore, run and score one submission (its kernel forked by the kernel server at `server`, if given)."""
    released = nbformat.read(str(released_path), as_version=4)
    graded = _graded(released, sub.exercise)
    blank = [{**g, "passed": False, "kind": "missing", "message": "", "traceback": ""} for g in graded]
    if sub.path is None:
        return Result(sub.student, sub.exercise, "missing", blank, list(sub.notes))
    notes = list(sub.notes)
    try:
        nb = nbformat.read(str(sub.path), as_version=4)
    except Exception as e:
        for c in blank:
            c.update(kind="crashed", message=_("the notebook file could not be read: {error}").format(error=e))
        return Result(sub.student, sub.exercise, "crashed", blank,
                      notes + [_("unreadable notebook: {error}").format(error=e)])
    nb, restored = restore(nb, released)
    notes += restored
    work = Path(tempfile.mkdtemp(prefix="parlab-grade-"))
    t0 = time.monotonic()
    try:
        nbformat.write(nb, str(work / "submission.ipynb"))
        cmd = [sys.executable, "-m", "parlab.course.gradebook.worker", str(work / "submission.ipynb"),
               str(work / "result.json"), "--cell-timeout", str(limits.cell_timeout),
               "--cpu-limit", str(limits.cpu_limit), *(["--kernel-server", server] if server else [])]
        proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=_limit_memory(limits.memory_gb), env=worker_env())
        try:
            log = proc.communicate(timeout=limits.wall)[0]
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)            # the worker, its kernel and the kernel's ranks
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait()
        if timed_out:
            log = ""
        try:
            out = json.loads((work / "result.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            status = "timeout" if timed_out else "crashed"
            if timed_out:
                why = _("the notebook did not finish within {seconds:g} s").format(seconds=limits.wall)
            elif log.strip():
                why = _("the grading process died: {error}").format(error=log.strip().splitlines()[-1])
            else:
                why = _("the grading process died")
            for c in blank:
                c.update(kind=status, message=why)
            return Result(sub.student, sub.exercise, status, blank, notes + [why], time.monotonic() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by_id = {c["grade_id"]: c for c in out["cells"]}
    checks = []
    for g in graded:
        c = by_id.get(g["grade_id"])
        if c is None:
            c = {"passed": False, "kind": out["status"], "message": out.get("crash") or _("this cell did not run"),
                 "traceback": ""}
        checks.append({**g, **{k: c[k] for k in ("passed", "kind", "message", "traceback")}})
    status = out["status"]
    if status == "tampered":
        notes.append(_("tampered: {names} rebound; no check of this notebook counts").format(
            names=", ".join(out["tampered"])))
        for c in checks:
            c["passed"] = False
    if out.get("crash"):
        notes.append(out["crash"])
    return Result(sub.student, sub.exercise, status, checks, notes, time.monotonic() - t0)


def grade(submissions: str | Path, out: str | Path, exercises: str | Path | None = None, jobs: int = 1,
          limits: Limits | None = None, progress=print, lang: str | None = None, server: str = "") -> list[Result]:
    """Grade every submission under `submissions` against the released exercises; write the reports to `out`.
    `lang` ("en", "zh", ...; default: the language in force) is the language of the checks' messages (the kernels
    run with PARLAB_LANG set to it) and of the reports. `server`: the address of a running
    `parlab.course.kernel_server.KernelServer` (``KernelServer(env=worker_env())``) to fork the kernels from, for
    a caller that grades several folders; by default this call starts its own."""
    from parlab.course.gradebook import report
    from parlab.course import ROOT

    limits = limits or Limits()
    with use_language(normalize(lang) or language()):
        released = released_exercises(exercises or ROOT / "exercises")
        if not released:
            raise ValueError(_("no released exercises (*.ipynb) in {folder}").format(
                folder=exercises or ROOT / "exercises"))
        subs, problems = collect(submissions, released)
        for p in problems:
            progress(_("skipped: {problem}").format(problem=p))
        results: list[Result] = []

        # every kernel forked from one warm server (parlab.course.kernel_server): 2-3.5 s less CPU each. It
        # takes on the worker's memory limit, and dies with the worker when a timeout kills that
        own = not server and len(subs) > 1
        with KernelServer(env=worker_env()) if own else contextlib.nullcontext() as started:
            address = started.address if started else server

            def one(sub):
                r = grade_one(sub, released[sub.exercise], limits, address)
                progress(f"{r.status:>8}  {r.points:g}/{r.max_points:g}  {r.student} / {r.exercise}  "
                         f"({r.seconds:.0f} s)")
                return r

            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                results = list(pool.map(one, subs))
        report.write_all(results, Path(out), problems)
    return results


def main(argv=None) -> int:
    import argparse
    p = ArgumentParser(prog="parlab grade", description="grade a folder of exercise submissions")
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


def _language(code: str) -> str:
    """argparse type for --lang: "zh", "zh-CN", "zh_CN" -> "zh_CN", "en" -> "en"; else an error naming both."""
    import argparse
    try:
        return normalize(code) or "en"
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p) -> None:
    d = Limits()
    p.add_argument("submissions", type=Path, help=_("folder of submissions (a folder per student, or "
                                                    "STUDENT_EXERCISE.ipynb files)"))
    p.add_argument("--out", type=Path, default=Path("grades"), help=_("folder for the reports (default: ./grades)"))
    p.add_argument("--exercises", type=Path, default=None, help=_("released exercises (default: this course's)"))
    p.add_argument("--jobs", type=int, default=1, help=_("notebooks graded side by side (default: 1)"))
    p.add_argument("--wall", type=float, default=d.wall,
                   help=_("seconds per notebook (default: {seconds:g})").format(seconds=d.wall))
    p.add_argument("--cell-timeout", type=float, default=d.cell_timeout,
                   help=_("seconds per cell (default: {seconds:g})").format(seconds=d.cell_timeout))
    p.add_argument("--cpu-limit", type=float, default=d.cpu_limit,
                   help=_("CPU seconds of student code per check and rank (default: {seconds:g})").format(
                       seconds=d.cpu_limit))
    p.add_argument("--memory-gb", type=float, default=d.memory_gb,
                   help=_("memory per notebook, GiB (default: {gb:g})").format(gb=d.memory_gb))
    p.add_argument("--lang", type=_language, default=None,
                   help=_("the language of the feedback and the reports: en or zh (default: PARLAB_LANG, else the "
                          "locale, else en)"))


def run_from_args(args) -> int:
    lang = getattr(args, "lang", None) or language()
    with use_language(lang):
        if not args.submissions.is_dir():
            print(_("parlab grade: {path} is not a folder of submissions").format(path=args.submissions),
                  file=sys.stderr)
            return 2
        limits = Limits(wall=args.wall, cell_timeout=args.cell_timeout, cpu_limit=args.cpu_limit,
                        memory_gb=args.memory_gb)
        try:
            results = grade(args.submissions, args.out, args.exercises, args.jobs, limits, lang=lang)
        except ValueError as e:
            print(f"parlab grade: {e}", file=sys.stderr)
            return 2
        print(_("graded {n} notebooks: {gradebook}, {summary}, {feedback}/").format(
            n=len(results), gradebook=args.out / "gradebook.csv", summary=args.out / "summary.html",
            feedback=args.out / "feedback"))
    return 0
