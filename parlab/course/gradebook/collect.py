"""Find the submissions in a folder and put each released cell back where the student's notebook lost it.

`collect` accepts any layout: one folder per student (``alice/00_ring_allreduce.ipynb``, nested folders
too) or flat files named ``STUDENT_EXERCISE.ipynb`` (``dave.smith_00_ring_allreduce.ipynb``); names may hold
dots, spaces and non-ASCII letters. The exercise is recognised by its released file name inside the
submission's name (else by its number, ``00``).

`restore` makes grading depend only on the student's answer cells: every graded and read-only cell of the
released exercise (nbgrader metadata ``locked``, matched by ``grade_id``, never by position) is put back
with its released source; a deleted one is re-inserted after the released cell that precedes it; a second
copy of a locked cell is dropped. Each change is reported ("graded cell check_x was edited: restored").
This is what nbgrader's ``OverwriteCells`` preprocessor does, with nbgrader's metadata.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from parlab.i18n import _

__all__ = ["Submission", "collect", "restore", "released_exercises", "exercise_of"]

SEPARATORS = "_- ."


@dataclass
class Submission:
    student: str
    exercise: str                       # the released stem, e.g. "00_ring_allreduce"
    path: Path | None                   # None: missing
    notes: list[str] = field(default_factory=list)


def released_exercises(folder: str | Path) -> dict[str, Path]:
    """{stem: path} of the released exercise notebooks in `folder` (exercises/ of the course)."""
    return {p.stem: p for p in sorted(Path(folder).glob("*.ipynb"))}


def exercise_of(name: str, stems) -> str | None:
    """The released exercise a file name refers to: the longest stem inside it, else a unique number match."""
    base = name[: -len(".ipynb")] if name.endswith(".ipynb") else name
    found = sorted((s for s in stems if s in base), key=len, reverse=True)
    if found:
        return found[0]
    numbers = {s.split("_", 1)[0]: s for s in stems}
    hits = {numbers[n] for n in re.findall(r"(?<!\d)(\d{2})(?!\d)", base) if n in numbers}
    return hits.pop() if len(hits) == 1 else None


def _student_from_file(name: str, exercise: str) -> str:
    base = name[: -len(".ipynb")]
    if exercise in base:
        base = base.replace(exercise, " ", 1)
    else:
        base = re.sub(rf"(?<!\d){exercise.split('_', 1)[0]}(?!\d)\w*", " ", base, count=1)
    return base.strip(SEPARATORS) or "unknown"


def collect(root: str | Path, stems) -> tuple[list[Submission], list[str]]:
    """Every (student, exercise) found under `root`, plus a row 'missing' for each exercise of the batch a
    student did not hand in. Returns (submissions, problems: files that could not be placed)."""
    root = Path(root)
    found: dict[tuple[str, str], list[Path]] = {}
    problems = []
    for path in sorted(root.rglob("*.ipynb")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):          # .ipynb_checkpoints, hidden folders
            continue
        exercise = exercise_of(path.name, stems)
        if exercise is None:
            problems.append(_("{file}: no released exercise matches this file name; rename it to one of "
                              "{stems}").format(file=rel, stems=sorted(stems)))
            continue
        student = rel.parts[0] if len(rel.parts) > 1 else _student_from_file(path.name, exercise)
        found.setdefault((student, exercise), []).append(path)
    subs = []
    for (student, exercise), paths in sorted(found.items()):
        paths.sort(key=lambda p: (os.stat(p).st_mtime, str(p)))
        sub = Submission(student, exercise, paths[-1])
        if len(paths) > 1:
            sub.notes.append(_("{n} files for this exercise; graded the newest, {newest}").format(
                n=len(paths), newest=paths[-1].relative_to(root)))
        subs.append(sub)
    students = sorted({s.student for s in subs})
    exercises = sorted({s.exercise for s in subs})
    have = {(s.student, s.exercise) for s in subs}
    subs += [Submission(st, ex, None, [_("no notebook handed in")]) for st in students for ex in exercises
             if (st, ex) not in have]
    subs.sort(key=lambda s: (s.student, s.exercise))
    return subs, problems


# ---------------------------------------------------------------------- restoring released cells
def _meta(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def _describe(cell) -> str:
    m = _meta(cell)
    if m.get("grade"):
        return _("graded cell {grade_id}").format(grade_id=m.get("grade_id"))
    return _("read-only cell {grade_id}").format(grade_id=m.get("grade_id"))


def restore(submission: nbformat.NotebookNode, released: nbformat.NotebookNode) -> tuple[nbformat.NotebookNode,
                                                                                        list[str]]:
    """The submission with every locked cell of `released` restored; returns (notebook, notes)."""
    notes: list[str] = []
    locked = {_meta(c)["grade_id"]: c for c in released.cells if _meta(c).get("locked")}
    answers = {_meta(c)["grade_id"] for c in released.cells if _meta(c).get("solution")}
    # a cell whose nbgrader metadata was lost (an editor that drops metadata, or the solution notebook itself)
    # is matched by its cell id, which `parlab course build` keeps stable between solution and exercise
    by_id = {c.get("id"): c for c in released.cells if c.get("id") and _meta(c).get("grade_id")}
    cells, seen, relabelled = [], set(), 0
    for cell in submission.cells:
        gid = _meta(cell).get("grade_id")
        if gid is None and cell.get("id") in by_id:
            ref = by_id[cell.get("id")]
            if ref.cell_type == cell.cell_type:
                gid, relabelled = _meta(ref)["grade_id"], relabelled + 1
                cell = nbformat.from_dict(cell)
                cell.setdefault("metadata", {})["nbgrader"] = dict(_meta(ref))
        if gid in locked:
            if gid in seen:
                notes.append(_("{cell} appeared twice: the copy was removed").format(cell=_describe(locked[gid])))
                continue
            seen.add(gid)
            ref = locked[gid]
            if cell.get("source", "") != ref.source or cell.cell_type != ref.cell_type:
                if _meta(ref).get("grade") or ref.cell_type == "code":
                    notes.append(_("{cell} was edited: restored").format(cell=_describe(ref)))
            new = nbformat.from_dict(ref)
            cells.append(new)
        else:
            if gid in answers:
                seen.add(gid)
            cells.append(cell)
    # re-insert deleted locked cells after the released cell that precedes them
    order = [_meta(c).get("grade_id") for c in released.cells]
    for k, gid in enumerate(order):
        if gid not in locked or gid in seen:
            continue
        ref = locked[gid]
        if _meta(ref).get("grade") or ref.cell_type == "code":
            notes.append(_("{cell} was deleted: re-inserted").format(cell=_describe(ref)))
        at = 0
        for prev in reversed(order[:k]):
            idx = next((i for i, c in enumerate(cells) if _meta(c).get("grade_id") == prev), None)
            if idx is not None:
                at = idx + 1
                break
        cells.insert(at, nbformat.from_dict(ref))
        seen.add(gid)
    if relabelled:
        notes.insert(0, _("{n} cells had lost their nbgrader metadata: matched to the release by cell id").format(
            n=relabelled))
    out = nbformat.from_dict(submission)
    out.cells = cells
    for cell in out.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return out, notes
