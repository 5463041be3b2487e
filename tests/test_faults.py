"""The fault matrix: each way a user can break a run, misuse an argument or the command line, one case per
line, with the clear error (or the correct behaviour) each one must give. No case asserts a duration: where
the point is "stops instead of hanging", the bounds are generous subprocess timeouts."""
import math
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab import RankError, RankKilled, RankTimeout, cli, launch
from parlab.launch import child
from parlab.parallel.data import DistributedDataParallel

from forked_ranks import start_forked
from net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _noop():
    return dist.get_rank()


def _left_behind(folder) -> list[str]:
    """What a run left in its temporary folder, less torch's own compile cache folder (`torchinductor_USER`,
    made by any process that imports torch._dynamo, as parlab.run does once before forking ranks)."""
    return [n for n in os.listdir(folder) if not n.startswith("torchinductor_")]


def _ddp(**kw):
    return DistributedDataParallel(torch.nn.Linear(2, 2), **kw)


def _column_zero():
    from parlab.parallel.tensor import ColumnParallelLinear
    return ColumnParallelLinear(0, 4)


def _row_zero():
    from parlab.parallel.tensor import RowParallelLinear
    return RowParallelLinear(4, 0)


def _embedding_negative():
    from parlab.parallel.tensor import VocabParallelEmbedding
    return VocabParallelEmbedding(8, -1)


def _in_one_rank(make):
    """Build something that needs a process group, in a world of one (the error is raised before any comm)."""
    return parlab.run(make, 1, echo=False)


# ---------------------------------------------------------------------- bad arguments, refused up front
BAD_ARGS = [  # (case, call, exception, message)
    ("run timeout=None", lambda: parlab.run(_noop, 2, timeout=None), TypeError, "timeout must be a number of seconds"),
    ("run timeout=inf", lambda: parlab.run(_noop, 2, timeout=math.inf), ValueError, "positive, finite"),
    ("run timeout=0", lambda: parlab.run(_noop, 2, timeout=0), ValueError, "positive, finite"),
    ("run timeout=-5", lambda: parlab.run(_noop, 2, timeout=-5), ValueError, "positive, finite"),
    ("run timeout=nan", lambda: parlab.run(_noop, 2, timeout=math.nan), ValueError, "positive, finite"),
    ("run timeout='60'", lambda: parlab.run(_noop, 2, timeout="60"), TypeError, "number of seconds"),
    ("run world_size=True", lambda: parlab.run(_noop, True), TypeError, "world_size must be a positive integer"),
    ("run world_size=2.0", lambda: parlab.run(_noop, 2.0), TypeError, "world_size must be a positive integer"),
    ("run world_size=0", lambda: parlab.run(_noop, 0), ValueError, "world_size must be a positive integer"),
    ("run world_size=-2", lambda: parlab.run(_noop, -2), ValueError, "world_size must be a positive integer"),
    ("run threads=0", lambda: parlab.run(_noop, 2, threads=0), ValueError, "threads must be a positive integer"),
    ("run seed=1.5", lambda: parlab.run(_noop, 2, seed=1.5), TypeError, "seed must be an integer"),
    ("run start_method='forkserver'", lambda: parlab.run(_noop, 2, start_method="forkserver"), ValueError,
     "start_method must be"),
    ("run backend='mpi'", lambda: parlab.run(_noop, 2, backend="mpi"), ValueError, "backend must be"),
    ("run fn=3", lambda: parlab.run(3, 2), TypeError, "needs a function"),
    ("init timeout=None", lambda: parlab.init(timeout=None), TypeError, "timeout must be a number of seconds"),
    ("init timeout=inf", lambda: parlab.init(timeout=math.inf), ValueError, "positive, finite"),
    ("init backend='mpi'", lambda: parlab.init(backend="mpi"), ValueError, "backend must be"),
    ("DDP bucket_cap_mb=inf", lambda: _ddp(bucket_cap_mb=math.inf), ValueError, "bucket_cap_mb must be a positive"),
    ("DDP bucket_cap_mb=nan", lambda: _ddp(bucket_cap_mb=math.nan), ValueError, "bucket_cap_mb must be a positive"),
    ("DDP bucket_cap_mb=0", lambda: _ddp(bucket_cap_mb=0), ValueError, "bucket_cap_mb must be a positive"),
    ("DDP bucket_cap_mb=-1", lambda: _ddp(bucket_cap_mb=-1), ValueError, "bucket_cap_mb must be a positive"),
    ("DDP bucket_cap_mb=True", lambda: _ddp(bucket_cap_mb=True), ValueError, "bucket_cap_mb must be a positive"),
    ("schedule microbatches=0", lambda: __import__("parlab.parallel.pipeline.schedules").parallel.pipeline.gpipe(2, 0), ValueError,
     "microbatches must be a positive integer"),
    ("schedule stages=-1", lambda: __import__("parlab.parallel.pipeline.schedules").parallel.pipeline.one_f_one_b(-1, 4), ValueError,
     "stages must be a positive integer"),
    ("GPTConfig n_layer=0", lambda: parlab.models.GPTConfig(n_layer=0), ValueError, "n_layer must be a positive"),
    ("BatchSampler batch_size=0", lambda: parlab.corpus.BatchSampler(torch.arange(100), 0, 8), ValueError,
     "batch_size must be a positive integer, got 0"),
    ("BatchSampler batch_size=True", lambda: parlab.corpus.BatchSampler(torch.arange(100), True, 8), ValueError,
     "batch_size must be a positive integer, got True"),
    ("BatchSampler seq_len=8.0", lambda: parlab.corpus.BatchSampler(torch.arange(100), 4, 8.0), ValueError,
     "seq_len must be a positive integer, got 8.0"),
    ("ParallelGrid tp=0", lambda: parlab.parallel.topology.ParallelGrid(4, tp=0), ValueError, "tp must be a positive int"),
    ("ColumnParallelLinear in_features=0", lambda: _in_one_rank(_column_zero), RankError,
     "in_features must be a positive integer, got 0"),
    ("RowParallelLinear out_features=0", lambda: _in_one_rank(_row_zero), RankError,
     "out_features must be a positive integer, got 0"),
    ("VocabParallelEmbedding embedding_dim=-1", lambda: _in_one_rank(_embedding_negative), RankError,
     "embedding_dim must be a positive integer, got -1"),
]


@pytest.mark.parametrize("case,call,exc,message", BAD_ARGS, ids=[c[0] for c in BAD_ARGS])
def test_bad_argument_is_refused_up_front(case, call, exc, message):
    import parlab.corpus  # noqa: F401  (the cases reach these modules through the parlab package)
    import parlab.models  # noqa: F401
    import parlab.parallel.topology  # noqa: F401
    with pytest.raises(exc, match=message):
        call()


# ---------------------------------------------------------------------- a rank that breaks: who is blamed
def _exit_code(code):
    dist.barrier()                   # everyone connected: the others are now talking to the rank that leaves
    if dist.get_rank() == 1:
        os._exit(code)
    t = torch.ones(1000)
    for _ in range(1000):
        dist.all_reduce(t)


def _slow_exit():
    """Rank 1's connections close a while before it is seen to exit (an exiting process descheduled on a busy
    machine): its peers see the broken connection and report it first. Its sockets are closed under gloo, whose
    epoll then forgets them without an event, so this rank's own gloo thread does not abort it."""
    dist.barrier()
    if dist.get_rank() == 1:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    os.close(int(fd))
            except OSError:
                pass
        time.sleep(0.3)
        os._exit(0)
    t = torch.ones(1000)
    for _ in range(1000):
        dist.all_reduce(t)


def _signal_self(sig):
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), sig)
        time.sleep(60)
    t = torch.ones(1000)
    for _ in range(1000):
        dist.all_reduce(t)


def _raise_on_two():
    if dist.get_rank() == 2:
        raise ValueError("bad shard size")
    t = torch.ones(1)
    dist.all_reduce(t)


def _sys_exit_on_one():
    if dist.get_rank() == 1:
        sys.exit(4)
    t = torch.ones(1)
    dist.all_reduce(t)


RANK_FAULTS = [  # (case, fn, args, exception, blamed rank, message)
    ("os._exit(3) on rank 1", _exit_code, (3,), RankKilled, 1, "exited with code 3 without reporting"),
    ("os._exit(0) on rank 1", _exit_code, (0,), RankKilled, 1, "exited with code 0 without reporting"),
    ("os._exit(0) seen late on rank 1", _slow_exit, (), RankKilled, 1, "exited with code 0 without reporting"),
    ("SIGKILL on rank 1", _signal_self, (signal.SIGKILL,), RankKilled, 1, "killed by signal SIGKILL"),
    ("SIGTERM on rank 1", _signal_self, (signal.SIGTERM,), RankKilled, 1, "killed by signal SIGTERM"),
    ("exception on rank 2", _raise_on_two, (), RankError, 2, "ValueError: bad shard size"),
    ("sys.exit(4) on rank 1", _sys_exit_on_one, (), RankError, 1, "SystemExit: 4"),
]


@pytest.mark.parametrize("case,fn,args,exc,rank,message", RANK_FAULTS, ids=[c[0] for c in RANK_FAULTS])
def test_the_rank_at_fault_is_blamed(case, fn, args, exc, rank, message):
    # several tries: the peers that see the broken connection fail at about the same moment as the culprit
    for _ in range(3):
        with pytest.raises(exc, match=message) as info:
            parlab.run(fn, 3, *args, timeout=120, echo=False)
        assert info.value.rank == rank


def _hang_one():
    if dist.get_rank() == 1:
        time.sleep(3600)
    return 0


def test_a_hung_rank_is_named_by_the_timeout():
    with pytest.raises(RankTimeout) as info:
        parlab.run(_hang_one, 3, timeout=3, echo=False)
    assert info.value.unfinished == [1]
    # the ranks that were done are named too: what rank 1 might wait for, they will never send
    assert info.value.returned == [0, 2] and "ranks [0, 2] had already returned" in str(info.value)


# ---------------------------------------------------------------------- temporary files, every exit path
def _exit_path(how):
    if how == "error" and dist.get_rank() == 1:
        raise RuntimeError("stop")
    if how == "killed" and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit" and dist.get_rank() == 1:
        os._exit(1)
    if how == "timeout":
        time.sleep(3600)
    return 1


@pytest.mark.parametrize("how", ["ok", "error", "killed", "exit", "timeout"])
def test_no_temporary_file_is_left_behind(how, tmp_path, monkeypatch):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if how == "ok":
        assert parlab.run(_exit_path, 2, how, echo=False).results == [1, 1]
    else:
        with pytest.raises((RankError, RankKilled, RankTimeout)):
            parlab.run(_exit_path, 2, how, timeout=3, echo=False)
    assert _left_behind(tmp_path) == []


# ---------------------------------------------------------------------- run after init, nested run
AFTER_INIT = """
import torch, torch.distributed as dist, parlab
ctx = parlab.init()
def f(k):
    t = torch.ones(1) * (dist.get_rank() + k)
    dist.all_reduce(t)
    return t.item()
def outer():
    inner = parlab.run(f, 2, 10 * (dist.get_rank() + 1), echo=False).results    # a run inside a rank
    t = torch.ones(1)
    dist.all_reduce(t)                                                         # the rank's own group still works
    return inner, t.item()
print("after init", parlab.run(f, 2, 1, echo=False).results)
print("nested", parlab.run(outer, 2, echo=False).results)
t = torch.ones(1) * 5
dist.all_reduce(t)
print("own group", t.item(), ctx.world_size)
"""


def test_run_after_init_and_nested_run_work(tmp_path):
    script = tmp_path / "after_init.py"
    script.write_text(AFTER_INIT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=ENV,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["after init [3.0, 3.0]", "nested [([21.0, 21.0], 2.0), ([41.0, 41.0], 2.0)]",
                                       "own group 5.0 1"]


# ---------------------------------------------------------------------- Ctrl-C on a hung run
CTRL_C = """
import os, signal, sys, time
import torch, torch.distributed as dist, parlab
signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a terminal or a notebook kernel
def hang(path):
    print(f"rank {dist.get_rank()} got this far", flush=True)
    with open(f"{path}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    if dist.get_rank() == 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)                                       # the others wait here for rank 1
parlab.run(hang, 3, sys.argv[1], timeout=3600)
"""


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"    # a zombie has exited
    except FileNotFoundError:
        return True


def test_ctrl_c_stops_every_rank_and_shows_their_output(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(CTRL_C)
    env = dict(ENV, TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    pid = str(tmp_path / "pid")
    proc = subprocess.Popen([sys.executable, str(script), pid], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        for _ in range(1200):   # wait until every rank is inside fn (up to 2 minutes on a busy machine)
            if all(os.path.exists(f"{pid}.{r}") and os.path.getsize(f"{pid}.{r}") for r in range(3)):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the ranks never started")
        ranks = [int(open(f"{pid}.{r}").read()) for r in range(3)]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in out
    assert all(_gone(r) for r in ranks)
    for r in range(3):
        assert f"[rank {r}] rank {r} got this far" in out
    assert "interrupted; stopped all 3 ranks" in out
    assert _left_behind(tmp_path / "tmp") == []              # the parlab-run-* folder went too


# ---------------------------------------------------------------------- the NCCL paths, checked without a GPU
def test_run_defaults_to_gloo_even_with_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert launch.choose_backend(2, "auto") == "nccl"       # 'auto' is an explicit choice
    assert parlab.run(_noop, 2, echo=False).backend == "gloo"


_order = []


def _record(what):
    _order.append(what)
    return what


class _Probe:
    def __reduce__(self):
        return (_record, ("unpickled",))


def test_nccl_rank_sets_its_device_before_unpickling_the_arguments(monkeypatch):
    _order.clear()
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: _order.append(f"set_device {d}"))
    device, payload = child._prepare(3, "nccl", pickle.dumps((_noop, (_Probe(),), {})))
    assert _order == ["set_device 3", "unpickled"] and device == torch.device("cuda", 3)
    _order.clear()
    assert child._prepare(3, "gloo", pickle.dumps((_noop, (_Probe(),), {})))[0] is None
    assert _order == ["unpickled"]


def test_results_are_moved_to_the_cpu(monkeypatch):
    from collections import OrderedDict, namedtuple
    moved = []

    class FakeCuda(torch.Tensor):   # a tensor that says it is on a GPU, to check where to_cpu looks
        @property
        def device(self):
            return torch.device("cuda", 0)

        def cpu(self):
            moved.append(1)
            return torch.Tensor(self.as_subclass(torch.Tensor))

    P = namedtuple("P", "a b")
    g = torch.ones(2).as_subclass(FakeCuda)
    out = launch.to_cpu({"x": [g, (g, 3)], "y": OrderedDict(z=P(g, "s")), "n": None})
    assert len(moved) == 3 and type(out["y"]) is OrderedDict and type(out["y"]["z"]) is P
    assert type(out["x"][0]) is torch.Tensor and out["x"][1][1] == 3 and out["y"]["z"].b == "s"


# ---------------------------------------------------------------------- init under srun without torchrun

SRUN_SCRIPT = """
import torch, parlab
from parlab import comm
ctx = parlab.init()
t = torch.tensor([float(ctx.rank + 1)])
comm.all_reduce(t)
print(f"rank {ctx.rank}/{ctx.world_size} local {ctx.local_rank} sum {t.item()} {ctx.extra} "
      f"threads {torch.get_num_threads()}")
"""


def _slurm_env(**kw):
    env = {k: v for k, v in ENV.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE",
                                                              "LOCAL_RANK", "OMP_NUM_THREADS"))}   # as srun leaves it
    env.update({k: str(v) for k, v in kw.items()})
    return env


def _script(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SRUN_SCRIPT)
    return [sys.executable, str(script)]


def test_plain_python_in_a_multi_task_slurm_job_stops_with_a_message(tmp_path):
    out = subprocess.run(_script(tmp_path), capture_output=True, text=True, timeout=120,
                         env=_slurm_env(SLURM_NTASKS=4, SLURM_PROCID=0, SLURM_JOB_ID=7))
    assert out.returncode != 0
    assert "SLURM_NTASKS=4" in out.stderr and "not started by srun" in out.stderr


@pytest.mark.parametrize("task", [0, 1])
def test_a_lab_under_srun_without_master_addr_says_so_once_without_a_traceback(task, tmp_path):
    """The first task prints the message; the others exit quietly, so a job of 16 tasks shows it once."""
    out = subprocess.run([sys.executable, "-m", "parlab.labs.data_parallel", "--steps", "1", "--no-trace"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=_slurm_env(SLURM_NTASKS=2, SLURM_STEP_NUM_TASKS=2, SLURM_PROCID=task, SLURM_LOCALID=task,
                                        MASTER_ADDR=""))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    if task == 0:
        assert out.stderr.startswith("error: parlab.init(): started by srun with several tasks but MASTER_ADDR is "
                                     "empty") and "export MASTER_ADDR" in out.stderr, out.stderr
    else:
        assert out.stderr == "", out.stderr


def test_srun_without_master_addr_stops_with_a_message(tmp_path):
    out = subprocess.run(_script(tmp_path), capture_output=True, text=True, timeout=120,
                         env=_slurm_env(SLURM_NTASKS=2, SLURM_STEP_NUM_TASKS=2, SLURM_PROCID=1, SLURM_LOCALID=1))
    assert out.returncode != 0 and "MASTER_ADDR is not set" in out.stderr and "export MASTER_ADDR" in out.stderr


def _srun_tasks(tmp_path, n, job, **env):
    """Run SRUN_SCRIPT as the `n` tasks of an srun step (rendezvous on a free local port): (stdout, stderr) of
    each task, after checking that each one exited 0 and left without C++ noise. Under srun rank 0's process hosts
    the store; leaving first, it made a peer still polling print a "recvValue failed" stack trace at exit (2 runs
    in 8 before rank 0 waited for the others), so every srun run of this file checks for that noise, as does every
    step under a real srun in tests/test_slurm.py."""
    port = free_port()
    procs = [subprocess.Popen(_script(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_slurm_env(SLURM_NTASKS=n, SLURM_STEP_NUM_TASKS=n, SLURM_PROCID=r, SLURM_LOCALID=r,
                                             SLURM_JOB_ID=job, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env))
             for r in range(n)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * n, [o[1][-2000:] for o in outs]
    noise = [o[1] for o in outs if "recvValue" in o[1] or "Exception raised" in o[1] or "terminate" in o[1]]
    assert noise == [], noise[0][-1500:]
    return outs


def test_srun_tasks_form_one_world(tmp_path):
    outs = _srun_tasks(tmp_path, 2, 42)
    assert [o[0].strip() for o in outs] == [f"rank {r}/2 local {r} sum 3.0 {{'launcher': 'srun'}} threads 1"
                                            for r in range(2)]
    assert "each srun task computes with 1 torch thread (as torchrun does)" in outs[0][1]   # said once, by rank 0
    assert "OMP_NUM_THREADS" not in outs[1][1]


@pytest.mark.parametrize("threads_env,expected", [({"OMP_NUM_THREADS": 2}, 2), ({"SLURM_CPUS_PER_TASK": 2}, 2)])
def test_srun_tasks_keep_the_threads_the_job_chose(tmp_path, threads_env, expected):
    outs = _srun_tasks(tmp_path, 2, 43, **threads_env)
    assert all(o[0].strip().endswith(f"threads {expected}") for o in outs), outs


def test_srun_with_an_empty_master_addr_stops_with_a_message(tmp_path):
    out = subprocess.run(_script(tmp_path), capture_output=True, text=True, timeout=120,
                         env=_slurm_env(SLURM_NTASKS=2, SLURM_STEP_NUM_TASKS=2, SLURM_PROCID=1, SLURM_LOCALID=1,
                                        MASTER_ADDR=""))
    assert out.returncode != 0 and "MASTER_ADDR is empty" in out.stderr and "export MASTER_ADDR" in out.stderr


def test_a_world_of_one_leaves_no_store_file(tmp_path):
    (tmp_path / "tmp").mkdir()
    out = subprocess.run(_script(tmp_path), capture_output=True, text=True, timeout=120,
                         env=_slurm_env(TMPDIR=str(tmp_path / "tmp")))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("rank 0/1 local 0 sum 1.0")
    assert _left_behind(tmp_path / "tmp") == []


# ---------------------------------------------------------------------- the command line
CLI_FAULTS = [  # (case, argv, message on stderr or stdout)
    ("course build --check on a missing root", ["course", "build", "--check", "--root", "/nonexistent/parlab"],
     "no such folder"),
    ("course strip --check on a missing root", ["course", "strip", "--check", "--root", "/nonexistent/parlab"],
     "no such folder"),
    ("course build on a missing root", ["course", "build", "--root", "/nonexistent/parlab"], "no such folder"),
    ("course scorecard on a missing file", ["course", "scorecard", "/nonexistent/results.xml"], "no such file"),
    ("plan --global-batch 0", ["plan", "--global-batch", "0"], "--global-batch must be a positive integer"),
    ("plan --global-batch -4", ["plan", "--global-batch", "-4"], "--global-batch must be a positive integer"),
    ("plan --layers 0", ["plan", "--layers", "0"], "--layers must be a positive integer"),
    ("plan --top 0", ["plan", "--top", "0"], "--top must be a positive integer"),
    ("plan --top -3", ["plan", "--top", "-3"], "--top must be a positive integer"),
    ("plan --nodes 100000", ["plan", "--nodes", "100000"], "at most"),
    ("plan --nodes 0", ["plan", "--nodes", "0"], "--nodes must be a positive integer"),
    ("grid --world 100000000", ["grid", "--world", "100000000"], "at most"),
    ("grid --world 0", ["grid", "--world", "0"], "--world must be a positive integer"),
]


@pytest.mark.parametrize("case,argv,message", CLI_FAULTS, ids=[c[0] for c in CLI_FAULTS])
def test_command_line_fault_gives_one_line_and_fails(case, argv, message, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as e:     # argparse's own errors exit 2
        code = e.code
    out = capsys.readouterr()
    text = out.err + out.out
    assert code not in (0, None), text
    assert message in text, text
    assert "Traceback" not in text


def test_a_broken_solution_notebook_gives_one_line(tmp_path, capsys):
    (tmp_path / "exercises" / "solutions").mkdir(parents=True)
    (tmp_path / "exercises" / "solutions" / "01_broken.ipynb").write_text("{ not json")
    assert cli.main(["course", "build", "--check", "--root", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "01_broken.ipynb" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------- a torchrun lab whose worker stops
@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stopped_lab_worker_is_named_by_the_survivors(stopped, tmp_path):
    """A lab's two ranks as torchrun starts them (its worker environment, the rendezvous store in a process of its
    own, as in torchrun's agent: tests/forked_ranks.py; torchrun itself: tests/test_labs.py, test_launch.py), one
    stopped with SIGSTOP once training runs: the other says which rank stopped answering and exits with an error."""
    argv = ["--steps", "1000000", "--layers", "1", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--batch", "4",
            "--quiet", "--no-trace", "--timeout", "5"]
    survivor = 1 - stopped
    host, procs = start_forked("parlab.labs.data_parallel", argv, 2, tmp_path)
    logs = [tmp_path / f"rank{r}.out" for r in range(2)]
    text = lambda r: logs[r].read_text() if logs[r].exists() else ""       # noqa: E731
    try:
        for _ in range(1800):   # until rank 0 said it is set up (3 min at most)
            if "rows per rank" in text(0) or not all(p.is_alive() for p in procs):
                break
            time.sleep(0.1)
        assert all(p.is_alive() for p in procs), text(0)[-3000:] + text(1)[-3000:]
        os.kill(procs[stopped].pid, signal.SIGSTOP)
        procs[survivor].join(180)   # the survivor's collective times out after 5 s, then it reports and exits
        assert f"[rank {survivor}] rank {stopped} stopped answering" in text(survivor), text(survivor)[-3000:]
        assert f"[rank {survivor}] a collective failed" in text(survivor)
        assert "Traceback" not in text(survivor), text(survivor)[-3000:]       # the diagnosis alone (issue 39)
        assert procs[survivor].exitcode not in (0, None)
    finally:
        for p in procs + [host]:
            if p.is_alive():
                p.kill()        # SIGKILL reaches a stopped process too
            p.join()


# A stopped rank 0 under srun (its process holds the rendezvous store; the other rank once waited forever, 136 s
# of silence until killed): tests/test_slurm.py stops rank 0 and rank 1 of a step under a real srun.


def test_a_process_that_initialised_cuda_does_not_fork(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="has initialised CUDA.*start_method='spawn'"):
        parlab.run(_noop, 2, start_method="fork")


def test_the_folder_of_a_killed_notebook_is_swept_by_the_next_run(tmp_path, monkeypatch):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()                       # a pid that has exited
    (tmp_path / f"parlab-run-{dead}-abc").mkdir()                        # left by a process killed with SIGKILL
    (tmp_path / f"parlab-run-{os.getpid()}-live").mkdir()                # a live process's folder stays
    (tmp_path / "parlab-run-other").mkdir()                              # not ours by name: untouched
    assert parlab.run(_noop, 2, echo=False).results == [0, 1]
    # (torch's inductor makes its cache folder in the temporary folder the first time a process imports torch._dynamo,
    # which parlab.run does before forking: when this test runs first in its process, that folder appears here too)
    left = sorted(n for n in os.listdir(tmp_path) if not n.startswith("torchinductor_"))
    assert left == sorted([f"parlab-run-{os.getpid()}-live", "parlab-run-other"])


def test_plan_into_a_closed_pipe_stops_quietly():
    """`parlab plan | head -1`: the reader may leave before parlab writes. Here it has left before parlab starts
    (the read end is closed at once), so the very first write meets a closed pipe: no traceback, status 141."""
    proc = subprocess.Popen([sys.executable, "-m", "parlab.cli", "plan", "--nodes", "8"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == "", err
