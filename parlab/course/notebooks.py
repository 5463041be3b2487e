"""The course as files: generate exercises from their solutions, keep notebooks stripped, read scorecards.

The solution notebook is the single source of truth (the approach of the
scikit-learn MOOC, INRIA/scikit-learn-mooc, and nbgrader's markers). In
``exercises/solutions/NN_topic.ipynb`` the lines a student must write sit
between two marker lines::

    def ring_all_gather(chunks):
        ### BEGIN SOLUTION
        for step in range(n - 1):
            ...
        ### END SOLUTION

`make_exercise` replaces every such region by nbgrader's code stub, at the indentation of
its ``BEGIN`` marker::

        # YOUR CODE HERE
        raise NotImplementedError()

and clears all outputs, giving ``exercises/NN_topic.ipynb``. `build` writes
(or, with ``check=True``, only compares) every generated notebook, so CI can
fail when a solution changed and its exercise was not regenerated (the
``git diff --exit-code`` idea of TeachOpenCADD's CI).

Notebooks are committed *stripped*: no outputs, no execution counts, no
widget state (`strip_notebook`, `stripped_problems`).

A *graded cell* is a code cell that calls ``grading.check_...``; it starts
with a docstring saying what it checks (nbgrader's style). `graded_cells`
lists them, and `scorecard` joins them with the JUnit XML that
``pytest --nbval-lax --junitxml=...`` writes, where nbval names code cell k
(0-based, code cells only) ``Cell k``.

Every cell carries nbgrader's metadata (``cell.metadata.nbgrader``, schema 3, see `nbgrader_metadata`):
the cells a student answers in (those with a solution region) are *solution* cells; graded cells are
*grade* cells worth one point each; every other cell is *locked* (read-only). Each has a ``grade_id`` that
stays the same across rebuilds (the check and its argument for a graded cell, the defined name for a
solution cell), which is how ``parlab grade`` restores edited or deleted cells of a submission. `build`
writes that metadata into the solution notebooks too, so each is an nbgrader *source* notebook as it is:
``nbgrader generate_assignment`` with nbgrader's default configuration makes from it the very exercise
`make_exercise` makes (same cells, stub, grade ids, points, locks and checksums; tests/test_nbgrader.py).

Running notebooks (`execute`, `export_html`) lives in `parlab.course.kernel`.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat

__all__ = ["BEGIN", "END", "PLACEHOLDER", "strip_solution", "make_exercise", "strip_notebook", "stripped_problems",
           "graded_cells", "read", "dumps", "build", "strip", "course_notebooks", "scorecard", "ROOT",
           "make_source", "nbgrader_metadata", "nbgrader_checksum", "is_graded"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
PLACEHOLDER = "# YOUR CODE HERE\nraise NotImplementedError()"   # nbgrader's ClearSolutions.code_stub["python"]
ROOT = Path(__file__).resolve().parents[2]            # the repository (lessons/, exercises/ live here)
GENERATED_NOTE = "generated from exercises/solutions/{name} by `parlab course build`; edit the solution instead"


# ---------------------------------------------------------------------- solutions -> exercises
def strip_solution(source: str, where: str = "cell") -> str:
    """Replace each BEGIN/END SOLUTION region of `source` (markers included) by the placeholder lines."""
    out: list[str] = []
    inside = False
    for n, line in enumerate(source.splitlines(), start=1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"{where}, line {n}: '{BEGIN}' inside another solution region; close the first "
                                 f"one with '{END}'")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out.extend(indent + stub for stub in PLACEHOLDER.splitlines())
        elif marker == END:
            if not inside:
                raise ValueError(f"{where}, line {n}: '{END}' without a matching '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: '{BEGIN}' is never closed; add a line '{END}' after the solution")
    return "\n".join(out)


def _has_solution(nb: nbformat.NotebookNode) -> list[bool]:
    return [c.cell_type == "code" and any(l.strip() == BEGIN for l in c.source.splitlines()) for c in nb.cells]


def make_exercise(solution: nbformat.NotebookNode, name: str = "") -> nbformat.NotebookNode:
    """The student notebook: solution regions replaced, outputs stripped, a note saying where it came from. The
    solution's language (``metadata.parlab.lang``, a translated course's) is kept: graders run its kernel in it."""
    lang = solution.metadata.get("parlab", {}).get("lang")
    nb = strip_notebook(solution)
    has_solution = _has_solution(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.source = strip_solution(cell.source, where=f"{name or 'notebook'}, cell {i}")
    nbgrader_metadata(nb, has_solution)
    nb.metadata["parlab"] = {"generated": GENERATED_NOTE.format(name=name), **({"lang": lang} if lang else {})}
    return nb


def make_source(solution: nbformat.NotebookNode, name: str = "") -> nbformat.NotebookNode:
    """The solution notebook as an nbgrader source notebook: every cell given nbgrader's metadata as its
    "Create Assignment" toolbar would (solution / grade with points / read-only), without the checksums and
    locks that nbgrader itself adds when it generates the student version. Raises on unbalanced markers."""
    nb = copy.deepcopy(solution)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            strip_solution(cell.source, where=f"{name or 'notebook'}, cell {i}")      # only to check the markers
    return nbgrader_metadata(nb, _has_solution(nb), release=False)


# ---------------------------------------------------------------------- nbgrader-compatible cell metadata
GRADED_CALL = re.compile(r"\bgrading\.(check_\w+)\(\s*([A-Za-z_][\w.]*)?")


def is_graded(cell) -> bool:
    """A graded cell: a code cell that calls grading.check_..."""
    return cell.cell_type == "code" and GRADED_CALL.search(cell.source) is not None


def _cell_id(cell, is_solution: bool, k: int) -> str:
    if is_graded(cell):
        m = GRADED_CALL.search(cell.source)
        return m.group(1) + (f"-{m.group(2)}" if m.group(2) else "")
    if is_solution:
        m = re.search(r"^(?:def|class)\s+(\w+)", cell.source, flags=re.M)
        if m:
            return f"answer-{m.group(1)}"
    return f"{cell.cell_type}-{k}"


def nbgrader_checksum(cell) -> str:
    """nbgrader's `compute_checksum` (nbgrader/utils.py): md5 over source, type, flags, id and points."""
    meta = cell.metadata["nbgrader"]
    m = hashlib.md5()
    for part in (cell.source, cell.cell_type, str(meta["grade"]), str(meta["solution"]), str(meta["locked"]),
                 meta["grade_id"]):
        m.update(part.encode("utf-8"))
    if meta["grade"]:
        m.update(str(float(meta["points"])).encode("utf-8"))
    return m.hexdigest()


def nbgrader_metadata(nb: nbformat.NotebookNode, has_solution: list[bool],
                      release: bool = True) -> nbformat.NotebookNode:
    """Give every cell nbgrader's metadata, in place: solution cells (had a solution region), graded cells
    (1 point) and read-only cells (everything else). Ids are unique within the notebook.

    With `release` (the student's notebook) each cell also gets nbgrader's checksum and the locks its
    LockCells preprocessor writes with its defaults: graded and read-only cells neither editable nor
    deletable, solution cells not deletable. Without it (the source notebook), neither."""
    seen: dict[str, int] = {}
    for k, (cell, solution) in enumerate(zip(nb.cells, has_solution)):
        old = cell.metadata.get("nbgrader", {})
        gid = old.get("grade_id") or _cell_id(cell, solution, k)
        if gid in seen:
            seen[gid] += 1
            gid = f"{gid}-{seen[gid]}"
        seen.setdefault(gid, 1)
        graded = is_graded(cell)
        meta = {"schema_version": 3, "grade_id": gid, "grade": graded, "solution": solution,
                "locked": not solution}
        if graded:
            meta["points"] = old.get("points", 1)
        cell.metadata["nbgrader"] = meta
        cell.metadata.pop("editable", None)
        cell.metadata.pop("deletable", None)
        if not release:
            continue
        cell.metadata["nbgrader"]["cell_type"] = cell.cell_type   # what nbgrader's ComputeChecksums records
        cell.metadata["nbgrader"]["checksum"] = nbgrader_checksum(cell)
        cell.metadata["deletable"] = False          # what nbgrader's LockCells writes: JupyterLab then refuses
        if meta["locked"]:                          # to delete, and (but for answers) to edit
            cell.metadata["editable"] = False
    return nb


# ---------------------------------------------------------------------- stripping
def strip_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy with no outputs, no execution counts, no per-cell run metadata and no saved widget state."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        for key in ("execution", "collapsed", "scrolled", "ExecuteTime"):
            cell.metadata.pop(key, None)
    return nb


def stripped_problems(nb: nbformat.NotebookNode) -> list[str]:
    """What keeps `nb` from being committed as is (empty when it is stripped)."""
    problems = [f"cell {i} has outputs" for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.outputs]
    problems += [f"cell {i} has execution_count {c.execution_count}" for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and c.execution_count is not None]
    if "widgets" in nb.metadata:
        problems.append("notebook metadata holds saved widget state")
    return problems


def graded_cells(nb: nbformat.NotebookNode) -> dict[int, str]:
    """{nbval cell number: what the cell checks} for the code cells that call grading.check_..."""
    out, k = {}, 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if re.search(r"\bgrading\.check_\w+\(", cell.source):
            try:
                doc = ast.get_docstring(ast.parse(cell.source)) or ""
            except SyntaxError:
                doc = ""
            call = re.search(r"grading\.(check_\w+)", cell.source).group(1)
            out[k] = doc.strip().splitlines()[0] if doc.strip() else call
        k += 1
    return out


# ---------------------------------------------------------------------- files
def read(path: str | Path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def dumps(nb: nbformat.NotebookNode) -> str:
    """The text nbformat.write would put in the file (so comparisons are byte-exact)."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def _write_if_changed(path: Path, text: str, check: bool) -> bool:
    """True when `path` does not hold `text`; writes it unless `check`."""
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    if not check:
        path.write_text(text, encoding="utf-8")
    return True


def build(root: str | Path = ROOT, check: bool = False) -> list[Path]:
    """Generate exercises/NAME.ipynb from every exercises/solutions/NAME.ipynb, after giving the solution
    its nbgrader source metadata (`make_source`).

    Returns the notebooks (solutions or exercises) that were out of date (and, unless `check`, are now rewritten).
    Generated notebooks whose solution no longer exists are reported as stale too."""
    root = Path(root)
    solutions = sorted((root / "exercises" / "solutions").glob("*.ipynb"))
    sources = {s: make_source(read(s), s.name) for s in solutions}
    stale = [s for s in solutions if _write_if_changed(s, dumps(sources[s]), check)]
    stale += [root / "exercises" / s.name for s in solutions
              if _write_if_changed(root / "exercises" / s.name, dumps(make_exercise(sources[s], s.name)), check)]
    names = {s.name for s in solutions}
    stale += [p for p in sorted((root / "exercises").glob("*.ipynb")) if p.name not in names]
    return stale


def course_notebooks(root: str | Path = ROOT) -> list[Path]:
    """Every notebook of the course: lessons/, exercises/ and exercises/solutions/."""
    root = Path(root)
    return sorted(p for folder in ("lessons", "exercises", "exercises/solutions")
                  for p in (root / folder).glob("*.ipynb"))


def strip(root: str | Path = ROOT, check: bool = False) -> list[Path]:
    """Strip outputs from every course notebook; returns the ones that were not stripped."""
    return [p for p in course_notebooks(root) if _write_if_changed(p, dumps(strip_notebook(read(p))), check)]


# ---------------------------------------------------------------------- grading results
def _error_line(report: str) -> str:
    """The exception a cell ended with ("AssertionError: rank 2, chunk 1 ..."), colour codes removed."""
    text = re.sub(r"(\x1b|#x1B)\[[0-9;]*m", "", report)
    found = list(re.finditer(r"^(\w+(Error|Exception|Timeout)): ", text, flags=re.M))
    return text[found[-1].start():].strip() if found else text.strip()


def scorecard(junit_xml: str | Path, root: str | Path = ".") -> list[dict]:
    """One row per graded cell in a JUnit XML written by ``pytest --nbval-lax --junitxml=...``:
    {"file", "cell", "check", "passed", "message"}. Cells that only set up are left out.

    The labels come from the graded notebook itself when it is found under `root` (so a student who added
    cells is still scored right), else from exercises/NAME.ipynb of the course."""
    rows, labels, paths = [], {}, {}
    for case in ET.parse(str(junit_xml)).getroot().iter("testcase"):
        m = re.fullmatch(r"Cell (\d+)", case.get("name", ""))
        classname = case.get("classname", "")          # "submissions.alice.00_ring_allreduce.ipynb"
        if not m or not classname.endswith(".ipynb"):
            continue
        if classname not in labels:
            stem = classname[: -len(".ipynb")]
            paths[classname] = _junit_path(stem, Path(root))
            candidates = [paths[classname], ROOT / "exercises" / (stem.rsplit(".", 1)[-1] + ".ipynb")]
            found = next((p for p in candidates if p is not None and p.exists()), None)
            labels[classname] = graded_cells(read(found)) if found else {}
        cell = int(m.group(1))
        if labels[classname] and cell not in labels[classname]:
            continue
        failure = next((f for f in (case.find("failure"), case.find("error")) if f is not None), None)
        message = "" if failure is None else _error_line(failure.text or failure.get("message") or "")
        where = paths[classname]
        file = (str(where.relative_to(root)) if where is not None else
                classname.replace(".", "/").removesuffix("/ipynb") + ".ipynb")
        rows.append({"file": file, "cell": cell,
                     "check": labels[classname].get(cell, f"Cell {cell}"),
                     "passed": failure is None and case.find("skipped") is None, "message": message})
    return rows


def _junit_path(stem: str, root: Path) -> Path | None:
    """The notebook a junit classname stem names: pytest joins the path's parts with dots, so
    'submissions.dave.smith.00_ring_allreduce' is found by comparing with every notebook's dotted path
    (a folder or file name may itself hold dots)."""
    direct = root / (stem.replace(".", "/") + ".ipynb")
    if direct.exists():
        return direct
    for path in root.rglob("*.ipynb"):
        if ".".join(path.relative_to(root).with_suffix("").parts) == stem:
            return path
    return None

