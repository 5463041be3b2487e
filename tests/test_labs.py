"""The standalone labs (parlab.labs.*) run as under torchrun on CPU ranks (gloo) with tiny sizes.

Each lab's ranks are forked from this process with the environment torchrun gives its workers
(tests/forked_ranks.py: the lab's code runs as under torchrun without importing torch and parlab again in every
rank, 2.5-3 s of CPU each: 11 lab runs, about 90 s of the suite's CPU). One lab runs under torchrun itself
(`test_a_lab_runs_under_torchrun_itself`), and torchrun's own behaviour (a crashed rank ends the job, two
simulated nodes, srun) is tried in tests/test_launch.py and test_slurm.py.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from forked_ranks import run_forked
from parlab.labs import LABS

SMALL = ["--steps", "2", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16", "--batch", "8"]

# (lab, ranks, lab options); every lab at least once, ZeRO through both ShardedOptimizer and FSDP.
RUNS = [
    ("data_parallel", 2, ["--bucket-mb", "0.001"]),
    ("zero", 2, ["--stage", "2"]),
    ("zero", 2, ["--stage", "3"]),
    ("tensor_parallel", 2, ["--sp"]),
    ("pipeline", 2, ["--microbatches", "4"]),
    ("context_parallel", 2, ["--attention", "ring"]),
    ("expert_parallel", 2, ["--experts", "4", "--capacity-factor", "1.0"]),   # 2 experts a rank, some dropped
    ("hybrid", 4, ["--tp", "2", "--pp", "2", "--sp"]),        # TP+SP x PP
    ("hybrid", 4, ["--cp", "2", "--zero", "1", "--ep", "2", "--experts", "4"]),   # dp 2 x cp 2, EP 2 + ZeRO-1
    ("hybrid", 4, ["--tp", "2", "--sp", "--ep", "2", "--experts", "4", "--etp", "2"]),   # TP+SP, EP 2, etp 2
    ("pipeline", 2, ["--schedule", "zb-h1", "--microbatches", "4", "--dtype", "bfloat16"]),  # autocast, fp32 W
]


def run_lab(name, ranks, options, tmp_path, torchrun: bool = False):
    """(stdout of every rank in rank order, trace path) of the lab run with `ranks` ranks: under torchrun itself
    if `torchrun` (or one rank: plain python), else forked with torchrun's worker environment."""
    trace = tmp_path / f"{name}.json"
    argv = [*SMALL, *options, "--trace", str(trace)]
    if ranks > 1 and not torchrun:
        return run_forked(f"parlab.labs.{name}", argv, ranks, tmp_path), trace
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    guard = os.path.join(os.path.dirname(__file__), "lab_guard.py")   # strict comm + NCCL's p2p rules
    proc = subprocess.run(launcher + [guard, f"parlab.labs.{name}", *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout, trace


def check_trace(trace, ranks):
    doc = json.loads(trace.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == set(range(ranks))       # events of every rank, merged on rank 0
    if ranks > 1:
        assert {e["tid"] for e in spans if e["cat"] in ("collective", "p2p")} == set(range(ranks))


@pytest.mark.parametrize("name,ranks,options", RUNS, ids=[f"{n}-{r}ranks{''.join(o[-2:])}" for n, r, o in RUNS])
def test_lab_runs_under_torchrun(name, ranks, options, tmp_path):
    out, trace = run_lab(name, ranks, options, tmp_path)
    backend = "nccl" if torch.cuda.is_available() else "gloo"   # --backend auto (parlab.launch.torchrun.init)
    summary = re.search(rf"^summary: lab=(\w+) world=(\d+) backend={backend} steps=2 loss=([\d.]+) "
                        r"tokens/s=(\d+) max_mem/rank=([\d.]+) MB", out, re.M)
    assert summary, out[-2000:]
    assert summary[1] == name and int(summary[2]) == ranks
    assert 0 < float(summary[3]) < 10 and int(summary[4]) > 0 and float(summary[5]) > 0
    assert len(re.findall(r"^summary:", out, re.M)) == 1        # rank 0 only
    assert len(re.findall(r"^  rank +\d+: ", out, re.M)) == ranks  # one memory line per rank
    check_trace(trace, ranks)


def test_a_lab_runs_under_torchrun_itself(tmp_path):
    # two workers (each imports torch and parlab: 2.5-3 s of CPU), the pipeline's p2p between them
    out, trace = run_lab("hybrid", 2, ["--pp", "2"], tmp_path, torchrun=True)
    assert re.search(r"^summary: lab=hybrid world=2 ", out, re.M) and len(re.findall(r"^summary:", out, re.M)) == 1
    check_trace(trace, 2)


def test_lab_runs_as_one_process(tmp_path):
    out, trace = run_lab("hybrid", 1, [], tmp_path)
    assert re.search(r"^summary: lab=hybrid world=1 ", out, re.M)
    check_trace(trace, 1)


def test_every_lab_has_a_module():
    import importlib
    for name in LABS:
        assert callable(importlib.import_module(f"parlab.labs.{name}").main)


# ---------------------------------------------------------------------- the first-run-on-GPUs script
def test_gpu_check_refuses_clearly_without_cuda(monkeypatch):
    import torch
    from parlab.labs import gpu_check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="^no CUDA device: torch.cuda.is_available"):
        gpu_check.main(["--gpus", "2"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit, match="--gpus 4 but this node has 2 CUDA device"):
        gpu_check.check_cuda(4)
    assert gpu_check.check_cuda(None) == 2


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "3", "--dry-run"], "--gpus must be one of"),
    (["--gpus", "0"], "--gpus must be a positive number"),
    (["--only", "pipelin", "--dry-run"], "unknown labs \\['pipelin'\\]"),
    (["--steps", "1", "--dry-run"], "--steps must be at least 2"),
    (["--timeout", "0"], "--timeout must be a positive"),
    (["--size", "huge"], "invalid choice: 'huge'"),
])
def test_gpu_check_rejects_bad_arguments(argv, message, capsys):
    from parlab.labs import gpu_check
    with pytest.raises(SystemExit) as e:
        gpu_check.main(argv)
    assert e.value.code == 2 and re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_gpu_check_plan_covers_every_lab_with_options_each_lab_accepts(gpus, capsys):
    import importlib
    from parlab.parallel.hybrid import check_layout, make_schedule
    from parlab.labs import gpu_check, parser
    from parlab.models import GPTConfig
    from parlab.parallel.topology import ParallelGrid
    runs = gpu_check.plan(gpus, "small", 20)
    assert {r.lab for r in runs} == set(LABS)
    for r in runs:
        argv = r.argv(gpus, "python")
        assert argv[:6] == ["python", "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", "-m"]
        assert argv[argv.index("--backend") + 1] == "nccl"
        p = parser(r.lab, "")
        importlib.import_module(f"parlab.labs.{r.lab}").add_args(p)
        a = p.parse_args(argv[7:])                                   # every option is one the lab knows
        cfg = GPTConfig(vocab_size=a.vocab, seq_len=a.seq_len, n_layer=a.layers, n_head=a.heads, n_embd=a.hidden)
        assert a.batch % gpus == 0 and a.seq_len % (2 * gpus) == 0 and a.heads % gpus == 0 and a.vocab % gpus == 0
        if r.lab == "pipeline":
            assert a.batch % a.microbatches == 0 and a.layers >= gpus * a.chunks
        if r.lab == "hybrid":                                        # the layout the lab itself would check
            grid = ParallelGrid(gpus, tp=a.tp, pp=a.pp, cp=a.cp)
            check_layout(cfg, grid, make_schedule(a.schedule, a.pp, 2 * a.pp, a.chunks), batch_size=a.batch,
                         seq_len=a.seq_len, sequence_parallel=a.sp, zero_stage=a.zero)
    assert gpu_check.main(["--gpus", str(gpus), "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(runs) + len(gpu_check.TESTS) and all(f"--nproc_per_node={gpus}" in ln
                                                                      for ln in printed[:len(runs)])


def test_gpu_check_writes_the_results_table(monkeypatch, tmp_path):
    from parlab.labs import gpu_check
    monkeypatch.setattr(gpu_check, "check_cuda", lambda gpus: 2)
    monkeypatch.setattr(gpu_check, "_environment", lambda: "a test, no GPU")
    calls = []

    def fake_run(argv, log, timeout):
        calls.append(argv)
        if "pytest" in argv:
            return 0, "....\n5 passed in 1.0s\n", 1.0
        if "zero" in " ".join(argv):                                 # one lab fails before its summary
            return 1, "Traceback ...\nRuntimeError: NCCL error\n", 2.0
        lab = argv[argv.index("-m", 3) + 1].rsplit(".", 1)[1]
        return 0, (f"summary: lab={lab} world=2 backend=nccl steps=20 loss=3.1021 tokens/s=8123 "
                   f"max_mem/rank=1.20 MB trace=x.json\n"), 3.0

    monkeypatch.setattr(gpu_check, "_run", fake_run)
    out = tmp_path / "table.md"
    code = gpu_check.main(["--out", str(out), "--logdir", str(tmp_path / "logs")])
    text = out.read_text()
    assert code == 1                                                  # a failed lab: a failed check
    assert "| `pipeline --schedule 1f1b --microbatches 4` | 0 | nccl | 3.1021 | 8123 | 1.20 |" in text
    assert "| `zero --stage 3` | 1 | - | - | - | - |" in text
    assert "| tests/gpu/test_gpu.py | 0 | 5 passed in 1.0s |" in text
    assert len(calls) == len(gpu_check.plan(2)) + len(gpu_check.TESTS)


def test_gpu_tests_import_on_cpu():
    # tests/gpu/ is collected only where CUDA exists (tests/conftest.py); this keeps it importable and its
    # checks present on every machine, so a GPU node's first run does not fail on a stale import.
    import importlib.util
    from pathlib import Path
    path = Path(__file__).with_name("gpu") / "test_gpu.py"
    spec = importlib.util.spec_from_file_location("parlab_gpu_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    names = {n for n in vars(mod) if n.startswith("test_")}
    assert {"test_nccl_all_reduce_through_parlab_comm", "test_cuda_events_clock_times_gpu_work",
            "test_meta_construction_materialises_on_the_gpu_with_the_dense_values"} <= names


# ---------------------------------------------------------------------- bad options: one line, exit 2, no ranks
@pytest.mark.parametrize("lab,argv,message", [
    ("pipeline", ["--batch", "0"], "argument --batch: must be a positive integer, got 0"),
    ("pipeline", ["--lr", "-1"], "argument --lr: must be a positive number, got -1"),
    ("pipeline", ["--lr", "nan"], "argument --lr: must be a positive number, got nan"),
    ("pipeline", ["--microbatches", "0"], "argument --microbatches: must be a positive integer, got 0"),
    ("pipeline", ["--layers", "two"], "argument --layers: must be a positive integer, got 'two'"),
    ("data_parallel", ["--bucket-mb", "0"], "argument --bucket-mb: must be a positive number, got 0"),
    ("hybrid", ["--tp", "0"], "argument --tp: must be a positive integer, got 0"),
    ("hybrid", ["--chunks", "-2"], "argument --chunks: must be a positive integer, got -2"),
    ("hybrid", ["--ep", "2"], "--ep 2 spreads the experts of MoE layers over 2 ranks: give --experts E"),
    ("hybrid", ["--ep", "2", "--experts", "3"], "--experts 3 must be a multiple of --ep 2"),
    ("hybrid", ["--experts", "-1"], "--experts must be 0 .* got -1"),
    ("hybrid", ["--tp", "2", "--ep", "2", "--etp", "4", "--experts", "4"], "--etp 4 must be 1 .* or equal to --tp 2"),
    ("hybrid", ["--tp", "2", "--sp", "--etp", "2"], "--etp 2 splits each expert's MLP .* give --experts E"),
    ("hybrid", ["--tp", "2", "--sp", "--etp", "2", "--experts", "4"], "with --ep 1 every rank holds each expert "
                                                                      "whole: leave --etp at 1"),
    ("zero", ["--trace", "no/such/folder/t.json"], "the folder .*no/such/folder does not exist; create it, or pass "
                                                   "--no-trace"),
    ("zero", ["--trace", "."], "--trace .: that is a folder; name a file in it"),
])
def test_a_bad_lab_option_is_one_line_and_exit_2(lab, argv, message, capsys):
    """Found while parsing, before parlab.init starts anything (the test runs in this process, with no group)."""
    import importlib
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"parlab.labs.{lab}").main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    # the error first and alone (parlab.i18n.args), then where the usage is: no ten lines of usage before it
    assert e.value.code == 2 and re.search(message, err[0]) and len(err) == 2 and "--help" in err[1], err
    assert not any("Traceback" in line or "usage:" in line for line in err)


WATCHED = """
import os, signal, sys, time
from parlab.labs import Watch

class Store:                      # in memory; once 'gone', it never answers again (its host stopped or died)
    gone = False
    def __init__(self):
        self.d = {}
    def set(self, k, v):
        if Store.gone:
            raise RuntimeError("gone")
        self.d[k] = v
    def add(self, k, n):
        if Store.gone:
            raise RuntimeError("gone")
        self.d[k] = int(self.d.get(k, 0)) + n
        return self.d[k]

Watch(Store(), rank=0, world=2, interval=0.05, timeout=1.0)
time.sleep(0.3)
Store.gone = True
if sys.argv[1] == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)       # the test wakes it with SIGCONT, as SLURM does
time.sleep(30)
"""


@pytest.mark.parametrize("stopped", [True, False], ids=["this-rank-stopped", "store-host-gone"])
def test_the_store_watch_blames_the_process_that_stopped(stopped, tmp_path):
    """A rank stopped (SIGSTOP) and woken later (SIGCONT) says it was stopped itself; it used to blame 'the
    process hosting the store', which under srun is rank 0, itself. A rank whose store really went silent
    still says that."""
    import signal
    import time
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    proc = subprocess.Popen([sys.executable, str(script), "stop" if stopped else "run"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if stopped:
        for _ in range(1200):                                   # until it has stopped itself
            if open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[-1].split()[0] == "T":
                break
            time.sleep(0.05)
        time.sleep(2.5)                                         # longer than the watch's timeout of 1 s
        os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    said = err.strip().splitlines()[-1]
    if stopped:
        assert said.startswith("[rank 0] this process was stopped for") and "has just resumed" in said, said
    else:
        assert "the rendezvous store has not answered for" in said, said
