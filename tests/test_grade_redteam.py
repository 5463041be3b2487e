"""Red team: submissions written to pass without doing the work get no points for what they cheat, and the
right status; answered exercises get full marks, blank ones zero (blank notebooks of every exercise: also
tests/test_notebooks.py).

The submissions are made here from the released exercises and their solutions (so they follow the course as it
is): a lecturer's folder of notebooks for exercises 00, 01 and 05, graded by ``parlab grade --jobs 2`` exactly as
exercises/README.md says. Calling parlab's own answer is also tried against every exercise's checks (00-10)
in process (`test_calling_the_reference_fails_in_every_exercise`); the cheats specific to exercises 02-10 (another
route to parlab's answer, untraced torch.distributed, one-rank computation from public inputs, hard-coded answers,
rebound tolerances) are a table in tests/test_grade_redteam_checks.py, also in process (a notebook each would cost
~30 s).
"""
import csv
import json
from pathlib import Path

import nbformat
import pytest
import torch

from parlab import cli, course
from parlab.course.gradebook.collect import collect, released_exercises

ROOT = Path(__file__).resolve().parents[1]
# CPU seconds per check and rank: an honest check's rank used at most 0.115 (measured beside test_hybrid and test_zero,
# whose 8-rank runs keep both cores busy); the looping submission's ranks are stopped at it (at 2 s: 11 CPU s more)
CPU_LIMIT = 0.5


# ---------------------------------------------------------------------- making submissions
def answered(stem: str) -> nbformat.NotebookNode:
    """The released exercise with the solution's code in every answer cell (what a good student hands in)."""
    ex = course.read(ROOT / "exercises" / f"{stem}.ipynb")
    sol = course.read(ROOT / "exercises" / "solutions" / f"{stem}.ipynb")
    for cell, done in zip(ex.cells, sol.cells):
        if cell.metadata["nbgrader"]["solution"]:
            cell.source = done.source
    return ex


def blank(stem: str) -> nbformat.NotebookNode:
    return course.read(ROOT / "exercises" / f"{stem}.ipynb")


def cell(nb, grade_id: str):
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def set_answer(nb, name: str, source: str):
    cell(nb, f"answer-{name}").source = source
    return nb


def add_after_imports(nb, source: str):
    k = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells.insert(k + 1, nbformat.v4.new_code_cell(source))
    return nb


def wrap_graded_in_try(nb):
    for c in nb.cells:
        if c.metadata.get("nbgrader", {}).get("grade"):
            c.source = "try:\n" + "\n".join("    " + l for l in c.source.splitlines()) + "\nexcept Exception:\n    pass"
    return nb


def delete_graded(nb, grade_id: str):
    nb.cells.remove(cell(nb, grade_id))
    return nb


RS, AG, AR = "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"
CALLS_REFERENCE = f"""def {RS}(chunks):
    n, r = comm.get_world_size(), comm.get_rank()
    full = sum(grading.rank_input(k, n, 24) for k in range(n))     # the grader's own inputs, summed
    chunks[r].copy_(full.chunk(n)[r])
"""
HARD_CODED = f"""def {AG}(chunks):
    n, r = comm.get_world_size(), comm.get_rank()
    def public(k):                                                 # the old public fixed-seed input, by hand
        g = torch.Generator().manual_seed(1000 * n + k)
        return torch.randint(-50, 50, (24,), generator=g).to(torch.float64)
    full = sum(public(k) for k in range(n))
    for j, c in enumerate(chunks):
        c.copy_(full.chunk(n)[j])
"""
LOOP = f"""def {RS}(chunks):
    while True:
        pass
"""
DEADLOCK = f"""def {RS}(chunks):
    rank, n = comm.get_rank(), comm.get_world_size()
    for step in range(n - 1):                                      # every rank sends first: nobody receives
        comm.send(chunks[(rank - 1 - step) % n], dst=(rank + 1) % n)
        buf = torch.empty_like(chunks[0])
        comm.recv(buf, src=(rank - 1) % n)
        chunks[(rank - 2 - step) % n] += buf
"""
HOG = f"""def {RS}(chunks):
    hog = torch.empty(2 ** 32)                                     # 16 GiB at once, far over the grader's limit
"""
GRID = """def {name}(world_size, tp, pp):
    from parlab.parallel.topology import ParallelGrid
    return ParallelGrid(world_size, tp=tp, pp=pp).groups("{dim}")
"""
LOCAL_SUM = """def all_reduce_in_dp_group(x, tp, pp):
    world, r = comm.get_world_size(), comm.get_rank()
    dp = world // (tp * pp)
    first = r % tp + (r // (tp * dp)) * tp * dp                    # computes the dp sum without communicating
    x.fill_(sum(2.0 ** (first + tp * d) for d in range(dp)))
    return x
"""

E0, E1, E5, E7 = "00_ring_allreduce", "01_process_groups", "05_pipeline_schedules", "07_hybrid_layout"
GRADED0 = [c.metadata["nbgrader"]["grade_id"] for c in blank(E0).cells if c.metadata["nbgrader"]["grade"]]
TOTAL = {ex: sum(bool(c.metadata.get("nbgrader", {}).get("grade")) for c in blank(ex).cells) for ex in (E0, E1, E5, E7)}

# student -> (exercise, notebook, expected status, expected points, text the feedback must contain)
SUBMISSIONS = {
    "alice": (E0, lambda: wrap_graded_in_try(delete_graded(answered(E0), GRADED0[1])), "ok", 4,
              "was deleted: re-inserted"),
    "bob": (E5, lambda: blank(E5), "ok", 0, "not written yet"),
    # answered in the flat layout of parlab before its packages (tests/notebooks/old_layout): still runs
    "olga": (E5, lambda: course.read(ROOT / "tests" / "notebooks" / "old_layout" / f"{E5}.ipynb"), "ok", TOTAL[E5],
             "PASS"),
    "pavel ": (E7, lambda: course.read(ROOT / "tests" / "notebooks" / "old_layout" / f"{E7}.ipynb"), "ok", TOTAL[E7],
              "PASS"),
    "carol": (E0, lambda: wrap_graded_in_try(set_answer(set_answer(blank(E0), RS, CALLS_REFERENCE), AG, HARD_CODED)),
              "ok", 0, "you called parlab's rank_input; write your own"),
    "dave.smith": (E0, lambda: add_after_imports(answered(E0), "grading.check_ring_all_reduce = lambda *a, **k: None\n"
                                                               "grading.check_ring_all_reduce_traffic = print"),
                   "tampered", 0, "tampered"),
    "eve": (E0, lambda: set_answer(answered(E0), RS, LOOP), "timeout", 1, "CPU time"),
    "frank": (E0, lambda: set_answer(answered(E0), RS, DEADLOCK), "ok", 1, "deadlocked"),
    "grace": (E0, lambda: add_after_imports(answered(E0), "import os\nos._exit(3)"), "crashed", 0, "kernel died"),
    "heidi": (E0, lambda: set_answer(answered(E0), RS, HOG), "crashed", 1, "memory limit"),
    "Zoë Müller": (E1, lambda: answered(E1), "ok", 4, "PASS"),
    "carol ": (E1, lambda: set_answer(set_answer(set_answer(set_answer(
        blank(E1), "tp_groups", GRID.format(name="tp_groups", dim="tp")), "pp_groups",
        GRID.format(name="pp_groups", dim="pp")), "dp_groups", GRID.format(name="dp_groups", dim="dp")),
        "all_reduce_in_dp_group", LOCAL_SUM), "ok", 0, "made no comm.all_reduce over its dp group"),
}


def _write(folder: Path):
    for student, (ex, make, *_rest) in SUBMISSIONS.items():
        name = student.strip()
        if student.endswith(" "):                       # flat layout: STUDENT_EXERCISE.ipynb
            path = folder / f"{name}_{ex}.ipynb"
        else:                                           # a folder per student
            path = folder / name / f"{ex}.ipynb"
        path.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(make(), str(path))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    subs = tmp_path_factory.mktemp("submissions")
    out = tmp_path_factory.mktemp("grades")
    _write(subs)
    rc = cli.main(["grade", str(subs), "--out", str(out), "--jobs", "2", "--cpu-limit", str(CPU_LIMIT),
                   "--memory-gb", "3", "--cell-timeout", "120", "--wall", "400"])
    assert rc == 0
    rows = list(csv.DictReader(open(out / "gradebook.csv", encoding="utf-8")))
    return out, {(r["student"], r["exercise"]): r for r in rows}


def test_layouts_and_names_are_recognised(tmp_path):
    _write(tmp_path)
    subs, problems = collect(tmp_path, released_exercises(ROOT / "exercises"))
    found = {(s.student, s.exercise) for s in subs if s.path is not None}
    assert found == {(st.strip(), ex) for st, (ex, *_r) in SUBMISSIONS.items()} and not problems
    missing = {(s.student, s.exercise) for s in subs if s.path is None}
    assert ("alice", E1) in missing and ("Zoë Müller", E0) in missing      # every student, every exercise


@pytest.mark.parametrize("student", list(SUBMISSIONS), ids=[s.strip() for s in SUBMISSIONS])
def test_each_submission_gets_its_status_and_points(graded, student):
    out, rows = graded
    ex, _make, status, points, says = SUBMISSIONS[student]
    row = rows[student.strip(), ex]
    assert (row["status"], int(row["passed"]), row["total"]) == (status, points, str(TOTAL[ex])), row
    feedback = (out / "feedback" / f"{student.strip()}.md").read_text(encoding="utf-8")
    assert says in feedback, feedback[:3000]


def test_missing_exercises_count_zero_against_the_released_total(graded):
    out, rows = graded
    row = rows["alice", E1]
    assert (row["status"], row["passed"], row["total"], row["points"]) == ("missing", "0", str(TOTAL[E1]), "0")


def test_summary_and_json_record(graded):
    out, _ = graded
    page = (out / "summary.html").read_text(encoding="utf-8")
    assert "plotly" in page and "Pass rate per check" in page
    record = json.loads((out / "gradebook.json").read_text(encoding="utf-8"))
    eve = next(r for r in record if r["student"] == "eve")
    assert any("Traceback" in c["traceback"] for c in eve["checks"] if not c["passed"])   # full traceback kept


# ---------------------------------------------------------------------- calling parlab's answer, every exercise
def _cheats():
    from parlab.parallel.zero import memory
    from parlab.parallel.context import ring as ring_attention
    from parlab.parallel import pipeline as schedules
    from parlab.parallel.data import assign_buckets
    from parlab.parallel.zero import FullyShardedDataParallel
    from parlab.course.grading import (context_parallel, data_parallel, expert, fsdp, hybrid, pipeline,
                                sequence_parallel, tensor_parallel, zero)
    from parlab.models import load_balancing_loss
    from parlab.parallel.context import seq_to_head
    from parlab.parallel.tensor import vocab_parallel_cross_entropy
    from parlab.parallel.topology import ParallelGrid
    import parlab.course.grading as g0

    class CE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, targets, group):
            return vocab_parallel_cross_entropy(logits, targets, group).detach()

    return [
        ("00", lambda: g0.check_ring_all_gather(lambda ch: None if not ch else
                                                [c.copy_(g0.rank_input(0, len(ch))[:c.numel()]) for c in ch]),
         "rank_input"),
        ("01", lambda: g0.check_groups(lambda w, tp, pp: ParallelGrid(w, tp=tp, pp=pp).groups("dp"), "dp"),
         "ParallelGrid"),
        ("02", lambda: data_parallel.check_make_buckets(lambda nb, cap: assign_buckets(nb, ["x"] * len(nb), cap)),
         "assign_buckets"),
        ("03", lambda: zero.check_memory_formulas(lambda *a: memory.model_state_bytes(*a)), "model_state_bytes"),
        ("04", lambda: tensor_parallel.check_vocab_parallel_cross_entropy(CE, tp_sizes=(2,)),
         "vocab_parallel_cross_entropy"),
        ("05", lambda: pipeline.check_1f1b_reference(lambda p, m, r: schedules.one_f_one_b(p, m).actions[r]),
         "one_f_one_b"),
        ("06", lambda: context_parallel.check_merge_partials(ring_attention.merge_partials), "merge_partials"),
        ("07", lambda: hybrid.check_groups_4d(lambda w, tp, cp, pp: {
            d: ParallelGrid(w, tp=tp, cp=cp, pp=pp).groups(d) for d in ("tp", "cp", "dp", "pp")}), "ParallelGrid"),
        ("08", lambda: sequence_parallel.check_seq_to_head(seq_to_head), "seq_to_head"),
        ("09", lambda: fsdp.check_gather_full(lambda shard: FullyShardedDataParallel(torch.nn.Linear(2, 2))),
         "FullyShardedDataParallel"),
        ("10", lambda: expert.check_load_balancing_loss(load_balancing_loss), "load_balancing_loss"),
    ]


@pytest.mark.parametrize("k", range(11), ids=[f"exercise {k:02d}" for k in range(11)])
def test_calling_the_reference_fails_in_every_exercise(k):
    ex, run_check, name = _cheats()[k]
    with pytest.raises(AssertionError, match=f"you called parlab's {name}; write your own"):
        run_check()


def test_rebinding_parlab_internals_is_reported_as_tampered():
    import parlab.course.grading as g0
    from parlab import comm as parlab_comm
    original = torch.equal, parlab_comm.isend
    for target, name in ((torch, "equal"), (parlab_comm, "isend")):
        setattr(target, name, lambda *a, **k: True)
        try:
            with pytest.raises(AssertionError, match=f"tampered: .*{name}") as err:
                g0.check_groups(lambda w, tp, pp: [[0]], "tp")
            assert err.value.kind == "tampered"
        finally:
            torch.equal, parlab_comm.isend = original
    g0.check_groups(lambda w, tp, pp: [list(range(s, s + tp)) for s in range(0, w, tp)], "tp")   # clean again


def test_cells_that_lost_their_metadata_are_matched_by_cell_id():
    """An answered notebook whose nbgrader metadata was dropped (some editors do; or a solution notebook handed in)
    keeps its answers and its graded cells: they are matched to the release by the stable cell id."""
    from parlab.course.gradebook.collect import restore
    stem = "00_ring_allreduce"
    released = course.read(ROOT / "exercises" / f"{stem}.ipynb")
    sub = answered(stem)
    for c in sub.cells:
        c.metadata.pop("nbgrader", None)
    out, notes = restore(sub, released)
    assert not any("deleted" in n for n in notes), notes
    assert any("matched to the release by cell id" in n for n in notes)
    want = answered(stem)
    assert [c.source for c in out.cells] == [c.source for c in want.cells]
    assert [c.metadata.get("nbgrader", {}).get("grade_id") for c in out.cells] == \
        [c.metadata.get("nbgrader", {}).get("grade_id") for c in released.cells]
