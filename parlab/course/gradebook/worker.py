"""Run one restored submission in a fresh kernel and record every graded cell
(``python -m parlab.course.gradebook.worker``).

`parlab.course.gradebook.grade` starts this module once per notebook, in its own process with a memory limit
(``RLIMIT_AS``, inherited by the kernel and its ranks); the parent enforces the wall-time limit. Here:

1. a hidden first cell configures `parlab.course.grading.guard` in the kernel: where to append the checks' records
   (a file in this run's folder) and the CPU-time limit of the student's code;
2. every cell up to the last graded one runs with nbclient (the demonstrations after it score nothing), errors
   allowed, each cell bounded by `cell_timeout` seconds (the kernel is interrupted and the notebook goes on);
3. after each graded cell a hidden cell asks the guard whether grading or parlab was rebound;
4. a graded cell passes when it raised nothing **and** the check it calls left a passing record (a check
   rebound to a no-op leaves none), and nothing was found rebound.

The result is one JSON file: status, and per graded cell: grade_id, passed, kind, message, traceback.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import nbformat

from parlab.i18n.args import ArgumentParser
from parlab.i18n import _

__all__ = ["grade_notebook", "main", "TAMPER_PROBE", "tampered_names", "tampered_message"]

MARK = "__parlab_grader__"
# run in the student's kernel after each graded cell (here and in `nbgrader_execute`): what the guard finds rebound
TAMPER_PROBE = f"import json as _j, parlab.course.grading.guard as _g\nprint('{MARK}' + _j.dumps(_g.tampered()))"


def tampered_names(printed: str) -> list[str]:
    """The rebound names `TAMPER_PROBE` printed; a probe that printed nothing counts as tampering too."""
    for line in printed.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return [_("parlab.course.grading.guard (the tamper probe printed nothing)")]


def tampered_message(what: str) -> str:
    return _("tampered: {what}; the grading code or parlab was rebound in this notebook, so this check "
             "does not count").format(what=what)


def _hidden(source: str):
    return nbformat.v4.new_code_cell(source)


def _error_of(cell) -> dict | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return out
    return None


def _text_of(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
    return "".join(parts)


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _out_of_memory(text: str) -> bool:
    """Did this error come from the memory limit? Python says MemoryError; torch's CPU allocator raises a
    RuntimeError ("DefaultCPUAllocator: can't allocate memory") when RLIMIT_AS refuses its request."""
    return "MemoryError" in text or "can't allocate memory" in text


def grade_notebook(nb: nbformat.NotebookNode, workdir: Path, cell_timeout: float, cpu_limit: float,
                   server: str = "") -> dict:
    """Execute `nb` (restored) in a kernel started in `workdir` (forked by the kernel server at `server`, if
    given); return the record of every graded cell."""
    from nbclient.exceptions import DeadKernelError

    from parlab.course.kernel import client as notebook_client

    results = workdir / "checks.jsonl"
    results.write_text("")
    timed_out = _("this cell ran longer than {seconds:g} s and was interrupted").format(seconds=cell_timeout)
    client = notebook_client(nb, 0.5, server=server, timeout=cell_timeout, kernel_name="python3", allow_errors=True,
                             interrupt_on_timeout=True,
                             error_on_timeout={"ename": "CellTimeout", "evalue": timed_out, "traceback": []},
                             resources={"metadata": {"path": str(workdir)}})
    cells: list[dict] = []
    status, tampered, crash = "ok", set(), ""
    offset = 0

    def new_records() -> list[dict]:
        nonlocal offset
        text = results.read_text(encoding="utf-8")
        lines = text[offset:].splitlines()
        offset = len(text)
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def verify(index: int) -> list[str]:
        probe = _hidden(TAMPER_PROBE)
        client.execute_cell(probe, index)
        return tampered_names(_text_of(probe))

    with client.setup_kernel():
        try:
            pre = _hidden(f"import parlab.course.grading.guard as _g\n_g.configure(results_path={str(results)!r}, "
                          f"cpu_limit_s={cpu_limit!r})\nimport parlab.course.grading\ndel _g")
            client.execute_cell(pre, 0)
            if _error_of(pre):
                raise RuntimeError(_("the grader's set-up cell failed: {error}").format(
                    error=_error_of(pre).get("evalue", "")))
            new_records()
            last = max((i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade")), default=-1)
            for index, cell in enumerate(nb.cells[:last + 1]):     # cells after the last graded one score nothing
                if cell.cell_type != "code":
                    continue
                meta = cell.metadata.get("nbgrader", {})
                start = time.monotonic()
                client.execute_cell(cell, index)
                err = _error_of(cell)
                if err and err.get("ename") in ("CellTimeout", "KeyboardInterrupt"):
                    status = "timeout" if status == "ok" else status
                if err and _out_of_memory(f"{err.get('ename')}: {err.get('evalue')}") and status in ("ok", "timeout"):
                    status, crash = "crashed", _("cell {index} hit the grader's memory limit").format(index=index)
                if not meta.get("grade"):
                    new_records()
                    continue
                records = new_records()
                bad = verify(index)
                tampered.update(bad)
                check = re.search(r"grading\.(check_\w+)", cell.source)
                check = check.group(1) if check else ""
                mine = [r for r in records if r.get("check") == check]
                passed = err is None and bool(mine) and all(r["passed"] for r in mine) and not bad
                kinds = [r["kind"] for r in mine if not r["passed"]]
                kind = "ok" if passed else (kinds[0] if kinds else ("tampered" if bad else "error"))
                if bad or (err is None and not mine):
                    kind = "tampered"
                    what = ", ".join(sorted(bad)) or _("{check} left no record").format(check=check)
                    msg = tampered_message(what)
                elif any(not r["passed"] for r in mine):         # the check's own message, without a class name
                    msg = next(r["message"] for r in mine if not r["passed"])
                elif err is not None:
                    msg = _strip_ansi(f"{err.get('ename')}: {err.get('evalue')}")
                    if err.get("ename") == "CellTimeout":
                        kind = "timeout"
                else:
                    msg = ""
                tb = "\n".join(r.get("traceback", "") for r in mine if not r["passed"])
                if err is not None and not tb:
                    tb = _strip_ansi("\n".join(err.get("traceback", [])))
                if kind == "cpu" and status == "ok":
                    status = "timeout"
                if not passed and _out_of_memory(msg + tb):
                    kind, status = "memory", "crashed" if status in ("ok", "timeout") else status
                    msg += "\n" + _("(the notebook hit the grader's memory limit)")
                cells.append({"grade_id": meta.get("grade_id"), "check": check, "passed": passed, "kind": kind,
                              "message": msg, "traceback": tb, "seconds": round(time.monotonic() - start, 2)})
        except DeadKernelError as e:
            status, crash = "crashed", _("the kernel died ({error}); a cell called os._exit, or ran out of "
                                         "memory").format(error=e)
        except Exception as e:                           # the kernel died in another way, or nbclient failed
            status, crash = "crashed", f"{type(e).__name__}: {e}"
        if status != "crashed":
            try:
                tampered.update(verify(len(nb.cells)))
            except Exception:
                pass
    if tampered:
        status = "tampered"
    return {"status": status, "cells": cells, "tampered": sorted(tampered), "crash": crash}


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m parlab.course.gradebook.worker")
    p.add_argument("notebook", type=Path)
    p.add_argument("result", type=Path)
    p.add_argument("--cell-timeout", type=float, default=300.0)
    p.add_argument("--cpu-limit", type=float, default=60.0)
    p.add_argument("--kernel-server", default="", help="address of a parlab kernel server to fork the kernel")
    a = p.parse_args(argv)
    nb = nbformat.read(str(a.notebook), as_version=4)
    out = grade_notebook(nb, a.notebook.parent, a.cell_timeout, a.cpu_limit, a.kernel_server)
    a.result.write_text(json.dumps(out), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
