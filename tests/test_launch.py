"""The launcher: results in rank order, faults reported (never a hang), no orphan processes."""
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab import RankError, RankKilled, RankTimeout


def _rank_info(offset):
    return dist.get_rank() + offset, dist.get_world_size(), dist.get_backend()


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_results_in_rank_order(world_size):
    res = parlab.run(_rank_info, world_size, 100)
    assert res.results == [(100 + r, world_size, "gloo") for r in range(world_size)]
    assert len(res) == world_size and res[0][0] == 100


def _seeded():
    return torch.rand(3)


def test_seeds_same_across_ranks_unless_asked():
    same = parlab.run(_seeded, 3).results
    assert all(torch.equal(same[0], t) for t in same)
    again = parlab.run(_seeded, 3).results
    assert torch.equal(same[0], again[0]), "the seed must be deterministic from run to run"
    diff = parlab.run(_seeded, 3, seed_per_rank=True).results
    assert not torch.equal(diff[0], diff[1])


def _talk():
    print(f"hello from {dist.get_rank()}")
    return None


def test_output_captured_in_rank_order(capsys):
    res = parlab.run(_talk, 4)
    assert [o.strip() for o in res.outputs] == [f"hello from {r}" for r in range(4)]
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"[rank {r}] hello from {r}" for r in range(4)]


def _fail_on_two():
    if dist.get_rank() == 2:
        raise ValueError("bad shard size")
    t = torch.ones(1)
    dist.all_reduce(t)  # the others wait here for rank 2, which never comes
    return t


def test_exception_names_rank_and_carries_traceback():
    # RankError, not RankTimeout: the ranks blocked in all_reduce are stopped, not waited for
    with pytest.raises(RankError) as info:
        parlab.run(_fail_on_two, 4, timeout=120, echo=False)
    err = info.value
    assert err.rank == 2 and err.exc_type == "ValueError" and "bad shard size" in str(err)
    assert "_fail_on_two" in err.traceback and "raise ValueError" in err.traceback


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(60)
    return os.getpid()


def test_hang_becomes_timeout_naming_the_ranks():
    t = time.perf_counter()
    with pytest.raises(RankTimeout) as info:
        parlab.run(_hang_on_rank_one, 3, timeout=2, echo=False)
    assert info.value.unfinished == [1]
    assert time.perf_counter() - t < 50, "the hung rank (60 s) must be stopped at the timeout, not waited for"


def _kill_self():
    dist.barrier()  # make sure every rank finished connecting before one of them dies
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def test_killed_rank_is_reported():
    with pytest.raises(RankKilled, match="rank 1 was killed by signal SIGKILL"):
        parlab.run(_kill_self, 2, timeout=20, echo=False)


def _report_pid_then_hang(path):
    with open(f"{path}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    if dist.get_rank() == 0:
        raise RuntimeError("stop")
    time.sleep(60)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it has exited and holds no resources
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("how", ["error", "timeout"])
def test_no_child_survives(tmp_path, how):
    path = str(tmp_path / "pid")
    fn = _report_pid_then_hang if how == "error" else _hang_forever_with_pid
    with pytest.raises((RankError, RankTimeout)):
        parlab.run(fn, 4, path, timeout=3, echo=False)
    pids = [int(open(f"{path}.{r}").read()) for r in range(4)]
    assert not any(_alive(p) for p in pids)


def _hang_forever_with_pid(path):
    with open(f"{path}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def _slow_sum(n):
    t = torch.full((n,), float(dist.get_rank()))
    for _ in range(20):
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return dist.get_world_size()


def test_two_concurrent_runs_do_not_collide():
    out = {}

    def go(key, ws):
        out[key] = parlab.run(_slow_sum, ws, 10_000, echo=False).results

    threads = [threading.Thread(target=go, args=(k, ws)) for k, ws in (("a", 4), ("b", 3))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert out == {"a": [4] * 4, "b": [3] * 3}


def test_notebook_style_function_runs():
    # a function whose code lives in no importable module, like one typed into a notebook cell
    ns = {}
    exec("import torch.distributed as dist\ndef g(k):\n    return k * dist.get_rank()\n", ns)
    assert parlab.run(ns["g"], 3, 7).results == [0, 7, 14]


def test_spawn_path_ships_function_by_value():
    ns = {}
    exec("import torch, torch.distributed as dist\n"
         "def g(k):\n    t = torch.ones(1) * k\n    dist.all_reduce(t)\n    return t.item()\n", ns)
    assert parlab.run(ns["g"], 2, 5, start_method="spawn", timeout=120).results == [10.0, 10.0]


def _ctx():
    c = parlab.init()
    return c.rank, c.world_size, c.local_rank, str(c.device), c.backend


def test_init_describes_the_group_run_made():
    assert parlab.run(_ctx, 2).results == [(0, 2, 0, "cpu", "gloo"), (1, 2, 1, "cpu", "gloo")]


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        parlab.run(_ctx, 0)
    with pytest.raises(TypeError, match="world_size must be a positive integer"):
        parlab.run(_ctx, True)
    with pytest.raises(ValueError, match="backend must be"):
        parlab.run(_ctx, 2, backend="mpi")
    with pytest.raises(TypeError, match="needs a function"):
        parlab.run(3, 2)


def _unpicklable():
    return lambda: 1


def test_unpicklable_result_is_explained():
    with pytest.raises(RankError, match="cannot be sent back"):
        parlab.run(_unpicklable, 2, echo=False)


TORCHRUN_SCRIPT = """
import torch, parlab
from parlab import comm
ctx = parlab.init()
t = torch.tensor([float(ctx.rank + 1)])
comm.all_reduce(t)
print(f"rank {ctx.rank}/{ctx.world_size} local {ctx.local_rank} {ctx.device} {ctx.backend} sum {t.item()}")
"""


def test_same_code_runs_under_torchrun(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # the two ranks share one stdout pipe, so their lines may interleave: pick them out by pattern
    import re
    lines = sorted(re.findall(r"rank \d/2 local \d cpu gloo sum [\d.]+", out.stdout))
    assert lines == ["rank 0/2 local 0 cpu gloo sum 3.0", "rank 1/2 local 1 cpu gloo sum 3.0"]


def test_init_without_torchrun_is_a_world_of_one(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "solo.py"
    script.write_text(TORCHRUN_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "rank 0/1 local 0 cpu gloo sum 1.0"


CRASH_SCRIPT = """
import torch, parlab
from parlab import comm
ctx = parlab.init()
t = torch.ones(1)
comm.all_reduce(t)
if ctx.rank == 1:
    import sys, time
    print(f"crash at {time.time()}", file=sys.stderr, flush=True)
    raise ValueError("rank 1 gives up")
"""


def test_a_crashing_torchrun_rank_ends_the_job_promptly(tmp_path):
    # The exit rendezvous (launch._destroy_at_exit) must not make a crashed job wait for the rank
    # that will never arrive: the crashed rank skips it and torchrun stops the healthy one.
    import re
    import subprocess
    import sys
    import time
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script)], capture_output=True, text=True, timeout=300)
    ended = time.time()
    assert out.returncode != 0
    assert "rank 1 gives up" in out.stderr
    took = ended - float(re.search(r"crash at ([\d.]+)", out.stderr)[1])   # from the crash, not from start-up
    assert took < 25, f"a crashed job took {took:.1f} s to end after the crash (the exit rendezvous waits 30 s)"


@pytest.mark.parametrize("env,expected", [
    ({"LOCAL_WORLD_SIZE": "8"}, 8),                               # torchrun
    ({"SLURM_STEP_TASKS_PER_NODE": "4(x2)"}, 4),                   # srun -N 2 --ntasks-per-node 4
    ({"SLURM_STEP_TASKS_PER_NODE": "4,3"}, 4),                     # uneven: the first node's
    ({"SLURM_NTASKS_PER_NODE": "2"}, 2),
    ({"SLURM_STEP_TASKS_PER_NODE": "garbage"}, 16),                # unreadable: the default
    ({}, 16),
])
def test_local_world_size_under_torchrun_and_srun(env, expected):
    from parlab.launch import local_world_size
    assert local_world_size(env, default=16) == expected


def _not_written(n):
    raise NotImplementedError


def test_a_rank_error_shows_a_notebook_the_raising_line_not_25_lines_of_frames():
    """IPython renders `_render_traceback_`: a student whose ring is not written yet sees what and where in a few
    lines (issue 32: 25 lines of parlab's and torch's frames); `.traceback` keeps everything."""
    with pytest.raises(parlab.RankError) as e:
        parlab.run(_not_written, 2, 3)
    lines = e.value._render_traceback_()
    text = "\n".join(lines)
    assert lines[0].endswith("raised NotImplementedError") and "raise NotImplementedError" in text
    assert "test_launch.py" in text and "parlab/launch" not in text and len(text.splitlines()) <= 6, text
    assert "parlab/launch/child.py" in e.value.traceback                      # the whole story is still there
