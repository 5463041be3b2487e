"""The course machinery: exercise generation, stripping, the CLI, and graders that reject wrong answers.

The wrong answers below are the mistakes students make: an off-by-one chunk or rank, an average instead of
a sum, chunks stored in the wrong slot, a phase left out, the whole tensor sent at every step, a collective
where point-to-point was asked, a blocking ring that deadlocks. Each must fail its check with a message
that names the problem.
"""
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

from parlab import cli, comm, course
from parlab.cluster import formulas
from parlab.course import grading, kernel, notebooks

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- exercise generation
SOLUTION = """\
def f(x):
    y = x + 1
    ### BEGIN SOLUTION
    for i in range(3):
        y = y * 2
    ### END SOLUTION
    return y"""


def test_strip_solution_replaces_each_region_at_its_indentation():
    assert course.strip_solution(SOLUTION) == (
        "def f(x):\n    y = x + 1\n    # YOUR CODE HERE\n    raise NotImplementedError()\n    return y")
    assert course.strip_solution("a = 1") == "a = 1"


@pytest.mark.parametrize("bad, says", [
    ("### BEGIN SOLUTION\nx = 1", "never closed"),
    ("x = 1\n### END SOLUTION", "without a matching"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "inside another"),
])
def test_strip_solution_rejects_unbalanced_markers(bad, says):
    with pytest.raises(ValueError, match=says):
        course.strip_solution(bad, where="demo.ipynb, cell 3")


def _notebook(source=SOLUTION):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(source)
    cell.outputs = [nbformat.v4.new_output("stream", text="hello\n")]
    cell.execution_count = 7
    nb.cells = [nbformat.v4.new_markdown_cell("# title"), cell]
    nb.metadata["widgets"] = {"state": {}}
    return nb


def test_make_exercise_strips_solutions_and_outputs_and_keeps_the_solution_untouched():
    sol = _notebook()
    ex = course.make_exercise(sol, "demo.ipynb")
    assert "    # YOUR CODE HERE\n    raise NotImplementedError()" in ex.cells[1].source
    assert "range(3)" not in ex.cells[1].source
    assert course.stripped_problems(ex) == []
    assert "demo.ipynb" in ex.metadata["parlab"]["generated"]
    assert "range(3)" in sol.cells[1].source and sol.cells[1].outputs  # the input is not modified
    assert course.stripped_problems(sol) == ["cell 1 has outputs", "cell 1 has execution_count 7",
                                             "notebook metadata holds saved widget state"]


def test_graded_cells_are_found_with_their_docstring():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_markdown_cell("text"),
                nbformat.v4.new_code_cell('"""Graded: the sum is right."""\ngrading.check_sum(f)'),
                nbformat.v4.new_code_cell("grading.check_other(g)")]
    assert course.graded_cells(nb) == {1: "Graded: the sum is right.", 2: "check_other"}


@pytest.mark.parametrize("path", course.course_notebooks(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_notebooks_are_stripped(path):
    assert course.stripped_problems(course.read(path)) == [], f"run `parlab course strip` ({path.name})"


def test_every_exercise_has_graded_cells():
    solutions = sorted((ROOT / "exercises" / "solutions").glob("*.ipynb"))
    assert len(solutions) >= 2
    for s in solutions:  # every exercise is graded by several independent checks, not one all-or-nothing cell
        assert len(course.graded_cells(course.read(s))) >= 3, s.name


# ---------------------------------------------------------------------- the parlab command
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "parlab.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_build_check_passes_on_the_committed_tree():
    out = _cli("course", "build", "--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_build_check_fails_when_a_solution_changes(tmp_path, capsys):
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises")
    solution = tmp_path / "exercises" / "solutions" / "00_ring_allreduce.ipynb"
    nb = course.read(solution)
    nb.cells[0].source += "\n\nA new sentence."
    nbformat.write(nb, str(solution))
    assert cli.main(["course", "build", "--check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "stale" in out and "00_ring_allreduce.ipynb" in out and "01_process_groups" not in out
    assert cli.main(["course", "build", "--root", str(tmp_path)]) == 0       # regenerate ...
    assert cli.main(["course", "build", "--check", "--root", str(tmp_path)]) == 0   # ... and it is current
    assert "A new sentence." in course.read(tmp_path / "exercises" / "00_ring_allreduce.ipynb").cells[0].source


def test_strip_command_strips_and_check_reports(tmp_path):
    (tmp_path / "lessons").mkdir()
    nbformat.write(_notebook(), str(tmp_path / "lessons" / "99_demo.ipynb"))
    assert cli.main(["course", "strip", "--check", "--root", str(tmp_path)]) == 1
    assert cli.main(["course", "strip", "--root", str(tmp_path)]) == 0
    assert course.stripped_problems(course.read(tmp_path / "lessons" / "99_demo.ipynb")) == []
    assert cli.main(["course", "strip", "--check", "--root", str(tmp_path)]) == 0


def test_sliced_wait_finds_a_message_whose_wake_up_was_lost():
    # nbclient#312: the kernel's reply sits on the socket but the waiting coroutine is never woken, so an
    # unbounded wait never returns and a bounded one returns only at its timeout (where pyzmq looks again).
    # The fake channel behaves like that: a message "arrives" at t = 0.1 s, but only a wait that times out
    # after that moment sees it.
    import asyncio
    import time
    from queue import Empty

    t0 = time.monotonic()

    async def lossy_get_msg(timeout=None):
        if timeout is None:
            await asyncio.sleep(3600)                   # never woken
        await asyncio.sleep(timeout)
        if time.monotonic() - t0 >= 0.1:
            return {"msg_type": "execute_reply"}
        raise Empty

    get = kernel._sliced(lossy_get_msg, poll=0.05)
    msg = asyncio.run(asyncio.wait_for(get(timeout=None), 5))
    assert msg["msg_type"] == "execute_reply" and time.monotonic() - t0 < 30   # ~0.1 s, not 3600 s (generous: busy machines)
    t0 = time.monotonic() + 3600                          # a message that never comes: the timeout still holds
    start = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(get(timeout=0.2))
    assert 0.2 <= time.monotonic() - start < 30


@pytest.fixture
def first_kernel_loses_its_port(monkeypatch):
    """The race of jupyter_client#154, made to happen: once the first kernel's connection file is written, another
    socket takes its shell port (as a rank's gloo socket can on a busy machine), so that kernel dies on start."""
    from jupyter_client.connect import ConnectionFileMixin
    write, taken = ConnectionFileMixin.write_connection_file, []

    def write_and_steal(self, **kw):
        write(self, **kw)
        if not taken:
            s = socket.socket()
            s.bind((self.ip, self.shell_port))
            s.listen()
            taken.append(s)
    monkeypatch.setattr(ConnectionFileMixin, "write_connection_file", write_and_steal)
    yield taken
    for s in taken:
        s.close()


@pytest.mark.parametrize("blocking", [False, True], ids=["execute", "setup_kernel"])
def test_a_kernel_that_dies_starting_is_started_again(first_kernel_loses_its_port, tmp_path, blocking):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 6 * 7\nprint(x)")])
    if blocking:                                          # the grader's way: setup_kernel, then cell by cell
        c = kernel.client(nb, timeout=60, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
        with c.setup_kernel():
            c.execute_cell(nb.cells[0], 0)
    else:
        kernel.execute(nb, tmp_path, timeout=60)
    assert first_kernel_loses_its_port, "the first kernel's port was not taken: the race was not provoked"
    assert nb.cells[0].outputs[0]["text"] == "42\n"


def test_html_command_rejects_a_missing_notebook(tmp_path, capsys):
    assert cli.main(["course", "html", str(tmp_path / "nope.ipynb"), "--out", str(tmp_path)]) == 2
    assert "no such notebook" in capsys.readouterr().err


def test_grid_command_prints_the_seed_000_groups(capsys):
    assert cli.main(["grid", "--world", "16", "--tp", "2", "--pp", "4", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "[0, 2] [1, 3]" in out and "[0, 4, 8, 12]*" in out
    assert cli.main(["grid", "--world", "6", "--tp", "4"]) == 2
    assert "not divisible" in capsys.readouterr().err
    assert "expert layers" not in out                                   # no --ep: the dense grid only
    assert cli.main(["grid", "--world", "16", "--tp", "2", "--pp", "2", "--ep", "4", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "ExpertGrid(world=16: etp=2 ep=4 edp=1 pp=2" in out and "ep: 4 group(s) of 4" in out
    assert cli.main(["grid", "--world", "16", "--tp", "2", "--pp", "2", "--ep", "6"]) == 2
    assert "not divisible by etp*ep*pp = 24" in capsys.readouterr().err
    assert cli.main(["grid", "--world", "16", "--ep", "0"]) == 2
    assert "--ep must be a positive integer" in capsys.readouterr().err


def test_scorecard_reads_a_junit_file(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="exercises.00_ring_allreduce.ipynb" name="Cell 0"/>'
        '<testcase classname="exercises.00_ring_allreduce.ipynb" name="Cell 2"><failure message="x">'
        "Traceback...\n#x1B[31mAssertionError#x1B[39m: rank 1, chunk 0 is wrong</failure></testcase>"
        '<testcase classname="exercises.00_ring_allreduce.ipynb" name="Cell 4"/>'
        "</testsuite></testsuites>")
    rows = course.scorecard(xml, root=ROOT)
    assert [(r["cell"], r["passed"]) for r in rows] == [(2, False), (4, True)]   # cell 0 only sets up
    assert rows[0]["message"] == "AssertionError: rank 1, chunk 0 is wrong"
    assert rows[0]["check"].startswith("Graded:")



def test_scorecard_command_shows_each_reason_whole(tmp_path, capsys):
    """The command prints a failure's first line wrapped, not cut at 100 characters (mid-word, before the hint)."""
    reason = "rank 1, chunk 0 holds the sum of ranks [1, 2] only; " * 4 + "send before you receive"
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="exercises.00_ring_allreduce.ipynb" name="Cell 2">'
                   f'<failure message="x">Traceback...\nAssertionError: {reason}</failure></testcase>'
                   "</testsuite></testsuites>")
    assert cli.main(["course", "scorecard", str(xml)]) == 1
    shown = capsys.readouterr().out
    reason_lines = [line for line in shown.splitlines() if line.startswith(" " * 6)]
    assert " ".join(shown.split()).count(reason) == 1 and max(map(len, reason_lines)) <= 110


# ---------------------------------------------------------------------- the formulas lesson 00 quotes
def test_lesson_00_figures():
    assert formulas.weights_memory(175e9) == 350e9
    assert round(formulas.speedup(58, 9.5), 1) == 6.1
    assert round(formulas.efficiency(formulas.speedup(58, 9.5), 8), 2) == 0.76
    years = formulas.device_seconds(formulas.training_flops(175e9, 300e9), 28e12) / formulas.SECONDS_PER_YEAR
    assert 350 < years < 360                      # the seed's "355 years": 3.14e23 FLOPs at 28 TFLOP/s
    assert round(formulas.wall_clock_days(1_022_362, 2048)) == 21   # LLaMA-65B on 2048 A100s
    assert formulas.ring_all_reduce_bytes(4e6, 4) == 6e6


# ---------------------------------------------------------------------- exercise 00: ring all-reduce
def _ring(rank_offset_send=-1, rank_offset_recv=-2):
    """A reduce-scatter with configurable chunk indices (the correct one is (-1, -2))."""
    def reduce_scatter(chunks):
        r, n = comm.get_rank(), comm.get_world_size()
        for s in range(n - 1):
            buf = torch.empty_like(chunks[(r + rank_offset_recv - s) % n])
            req = comm.isend(chunks[(r + rank_offset_send - s) % n], dst=(r + 1) % n)
            comm.recv(buf, src=(r - 1) % n)
            req.wait()
            chunks[(r + rank_offset_recv - s) % n] += buf
    return reduce_scatter


ring_reduce_scatter = _ring()


def ring_all_gather(chunks, slot_offset=-1, add=False):
    r, n = comm.get_rank(), comm.get_world_size()
    for s in range(n - 1):
        req = comm.isend(chunks[(r - s) % n], dst=(r + 1) % n)
        if add:
            buf = torch.empty_like(chunks[0])
            comm.recv(buf, src=(r - 1) % n)
            chunks[(r + slot_offset - s) % n] += buf
        else:
            comm.recv(chunks[(r + slot_offset - s) % n], src=(r - 1) % n)
        req.wait()


def ring_all_reduce(x):
    chunks = list(x.chunk(comm.get_world_size()))
    ring_reduce_scatter(chunks)
    ring_all_gather(chunks)
    return x


def test_ring_checks_accept_a_correct_ring():
    grading.check_ring_reduce_scatter(ring_reduce_scatter)
    grading.check_ring_all_gather(ring_all_gather)
    grading.check_ring_all_reduce(ring_all_reduce)
    grading.check_ring_all_reduce_traffic(ring_all_reduce)


def all_gather_wrong_slot(chunks):
    ring_all_gather(chunks, slot_offset=+1)


def all_gather_adds(chunks):
    ring_all_gather(chunks, add=True)


def all_reduce_average(x):
    return ring_all_reduce(x) / comm.get_world_size()


def all_reduce_without_all_gather(x):
    ring_reduce_scatter(list(x.chunk(comm.get_world_size())))
    return x


def all_reduce_one_step_short(x):
    n = comm.get_world_size()
    chunks = list(x.chunk(n))
    r = comm.get_rank()
    for s in range(n - 2):                       # off by one: N-2 steps
        buf = torch.empty_like(chunks[0])
        req = comm.isend(chunks[(r - 1 - s) % n], dst=(r + 1) % n)
        comm.recv(buf, src=(r - 1) % n)
        req.wait()
        chunks[(r - 2 - s) % n] += buf
    ring_all_gather(chunks)
    return x


def all_reduce_with_collective(x):
    comm.all_reduce(x)
    return x


def all_reduce_untraced(x):
    dist.all_reduce(x)
    return x


def all_reduce_whole_tensor(x):
    r, n = comm.get_rank(), comm.get_world_size()
    total, msg, buf = x.clone(), x.clone(), torch.empty_like(x)
    for _ in range(n - 1):                       # pass whole tensors around the ring: (N-1) x size per rank
        req = comm.isend(msg, dst=(r + 1) % n)
        comm.recv(buf, src=(r - 1) % n)
        req.wait()
        total += buf
        msg = buf.clone()
    return total


def all_reduce_via_root(x):
    r, n = comm.get_rank(), comm.get_world_size()
    if r == 0:
        buf = torch.empty_like(x)
        for src in range(1, n):
            comm.recv(buf, src=src)
            x += buf
        for dst in range(1, n):
            comm.send(x, dst=dst)
    else:
        comm.send(x, dst=0)
        comm.recv(x, src=0)
    return x


def all_reduce_blocking(x):
    r, n = comm.get_rank(), comm.get_world_size()
    comm.send(x, dst=(r + 1) % n)                # every rank sends first: nobody receives
    comm.recv(x, src=(r - 1) % n)
    return x


WRONG_RINGS = [
    ("reduce-scatter sends the wrong chunk", grading.check_ring_reduce_scatter, _ring(0, -1), "chunk"),
    ("all-gather stores into the wrong slot", grading.check_ring_all_gather, all_gather_wrong_slot,
     "wrong order"),
    ("all-gather adds instead of copying", grading.check_ring_all_gather, all_gather_adds, "not the sum"),
    ("average instead of sum", grading.check_ring_all_reduce, all_reduce_average, "average"),
    ("all-gather phase missing", grading.check_ring_all_reduce, all_reduce_without_all_gather, "nothing was received"),
    ("one step short", grading.check_ring_all_reduce, all_reduce_one_step_short, "nothing was received|missing"),
    ("uses comm.all_reduce", grading.check_ring_all_reduce_traffic, all_reduce_with_collective,
     "called comm.all_reduce"),
    ("untraced torch.distributed", grading.check_ring_all_reduce_traffic, all_reduce_untraced, "torch.distributed.all_reduce directly"),
    ("whole tensor each step", grading.check_ring_all_reduce_traffic, all_reduce_whole_tensor, r"2\(N-1\)/N x size"),
    ("everyone talks to rank 0", grading.check_ring_all_reduce_traffic, all_reduce_via_root, "one"),
]


@pytest.mark.parametrize("name, check, wrong, says", WRONG_RINGS, ids=[w[0] for w in WRONG_RINGS])
def test_ring_checks_reject_wrong_answers(name, check, wrong, says):
    with pytest.raises(AssertionError, match=says):
        check(wrong)


def test_a_deadlocked_ring_fails_within_the_timeout():
    with pytest.raises(AssertionError, match="deadlock(.|\n)*start the send with req = comm.isend"):
        grading.check_ring_all_reduce(all_reduce_blocking, world_sizes=(2,), timeout=3)


def test_a_missing_solution_says_not_written_yet():
    def todo(chunks):
        raise NotImplementedError
    with pytest.raises(AssertionError, match="not written yet"):
        grading.check_ring_reduce_scatter(todo)


# ---------------------------------------------------------------------- exercise 01: process groups
def tp_groups(world, tp, pp):
    return [list(range(s, s + tp)) for s in range(0, world, tp)]


def pp_groups(world, tp, pp):
    return [list(range(s, world, world // pp)) for s in range(world // pp)]


def dp_groups(world, tp, pp):
    dp = world // (tp * pp)
    return [[st * tp * dp + t + tp * d for d in range(dp)] for st in range(pp) for t in range(tp)]


def test_group_checks_accept_correct_groups_in_any_order():
    grading.check_groups(tp_groups, "tp")
    grading.check_groups(lambda *a: list(reversed(pp_groups(*a))), "pp")
    grading.check_groups(lambda *a: [sorted(g, reverse=True) for g in dp_groups(*a)], "dp")


WRONG_GROUPS = [
    ("dp returns the tp groups", "dp", tp_groups, "you returned the tp groups"),
    ("off-by-one start", "tp", lambda w, tp, pp: [list(range(s + 1, s + tp + 1)) for s in range(0, w, tp)],
     "rank"),
    ("dp stride 1 instead of tp", "dp", lambda w, tp, pp: [list(range(s, s + w // (tp * pp)))
                                                          for s in range(0, w, w // (tp * pp))], "rank"),
    ("pp stride tp instead of tp*dp", "pp",
     lambda w, tp, pp: [[s + tp * k for k in range(pp)] for s in range(w // pp)], "rank"),
]


@pytest.mark.parametrize("name, dim, wrong, says", WRONG_GROUPS, ids=[w[0] for w in WRONG_GROUPS])
def test_group_checks_reject_wrong_groups(name, dim, wrong, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_groups(wrong, dim)


def dp_sum(x, tp, pp):
    mine = None
    for ranks in dp_groups(comm.get_world_size(), tp, pp):
        g = dist.new_group(ranks)
        mine = g if comm.get_rank() in ranks else mine
    comm.all_reduce(x, group=mine)
    return x


def world_sum(x, tp, pp):
    comm.all_reduce(x)
    return x


def tp_sum(x, tp, pp):
    mine = None
    for ranks in tp_groups(comm.get_world_size(), tp, pp):
        g = dist.new_group(ranks)
        mine = g if comm.get_rank() in ranks else mine
    comm.all_reduce(x, group=mine)
    return x


def test_dp_all_reduce_check():
    grading.check_dp_all_reduce(dp_sum)
    with pytest.raises(AssertionError, match=r"sum over ranks \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        grading.check_dp_all_reduce(world_sum)
    with pytest.raises(AssertionError, match=r"expected the sum over its dp group \[0, 2\]"):
        grading.check_dp_all_reduce(tp_sum)


def test_locked_cells_are_locked_in_jupyterlab_as_nbgrader_leaves_them():
    """generate_assignment's LockCells (default settings) marks every locked cell editable and deletable false
    and an answer cell deletable false; the released exercises do the same, so a student cannot change a
    graded cell or the task text, nor delete the cell to answer in, by accident. The solutions (nbgrader's
    source notebooks) stay editable."""
    for path in sorted((ROOT / "exercises").glob("*.ipynb")):
        for cell in course.read(path).cells:
            locked = cell.metadata["nbgrader"]["locked"]
            assert cell.metadata.get("editable", True) is (not locked), (path.name, cell.metadata)
            assert cell.metadata.get("deletable", True) is False, (path.name, cell.metadata)
    for path in sorted((ROOT / "exercises" / "solutions").glob("*.ipynb")):
        for cell in course.read(path).cells:
            assert "editable" not in cell.metadata and "deletable" not in cell.metadata, (path.name, cell.metadata)
            assert "checksum" not in cell.metadata["nbgrader"], path.name


def _all_reduce_on_rank_0_only(chunks):
    from parlab import comm
    if comm.get_rank() == 0:
        comm.all_reduce(chunks[0])


def test_a_collective_on_one_rank_gets_the_collective_hint_not_the_send_recv_one():
    """Rank 0 all-reduces alone: the deadlock message says the other ranks returned without calling it."""
    with pytest.raises(AssertionError) as err:
        grading.check_ring_reduce_scatter(_all_reduce_on_rank_0_only, world_sizes=(2,))
    msg = str(err.value)
    assert "Ranks [1] returned without calling it" in msg and "comm.isend" not in msg, msg


def test_not_written_yet_names_the_function_when_another_cell_calls_it():
    """A blank answer called from a later cell: the line says which function is unwritten, not 'line 4 of this
    cell' about a cell the student is not looking at; raised in the cell itself, it gives the line."""
    from parlab.course.grading.guard import not_written_where
    env = {}
    exec(compile("def one_f_one_b_rank(p, m, r):\n    '''doc'''\n    # YOUR CODE HERE\n    raise NotImplementedError()\n",
                 "<cell-3>", "exec"), env)
    for source, says in (("one_f_one_b_rank(4, 6, 0)\n", " in one_f_one_b_rank (line 4 of the cell that defines it)"),
                         ("x = 1\nraise NotImplementedError()\n", " (line 2 of this cell)")):
        with pytest.raises(NotImplementedError) as err:
            exec(compile(source, "<cell-5>", "exec"), env)
        assert not_written_where(err.value.__traceback__) == says
