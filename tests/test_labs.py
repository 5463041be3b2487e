"""The standalone labs (parlab.labs.*) run under torchrun on CPU ranks (gloo) with tiny sizes."""
import json
import os
import re
import subprocess
import sys

import pytest

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
    ("hybrid", 4, ["--tp", "2", "--pp", "2", "--sp"]),        # TP+SP x PP
    ("hybrid", 4, ["--cp", "2", "--zero", "1"]),               # dp 2 x cp 2
    ("pipeline", 2, ["--schedule", "zb-h1", "--microbatches", "4", "--dtype", "bfloat16"]),  # autocast, fp32 W
]


def run_lab(name, ranks, options, tmp_path):
    trace = tmp_path / f"{name}.json"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    guard = os.path.join(os.path.dirname(__file__), "lab_guard.py")   # strict comm + NCCL's p2p rules
    proc = subprocess.run(launcher + [guard, f"parlab.labs.{name}", *SMALL, *options, "--trace", str(trace)],
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
    summary = re.search(r"^summary: lab=(\w+) world=(\d+) backend=gloo steps=2 loss=([\d.]+) tokens/s=(\d+) "
                        r"max_mem/rank=([\d.]+) MB", out, re.M)
    assert summary, out[-2000:]
    assert summary[1] == name and int(summary[2]) == ranks
    assert 0 < float(summary[3]) < 10 and int(summary[4]) > 0 and float(summary[5]) > 0
    assert len(re.findall(r"^summary:", out, re.M)) == 1        # rank 0 only
    assert len(re.findall(r"^  rank +\d+: ", out, re.M)) == ranks  # one memory line per rank
    check_trace(trace, ranks)


def test_lab_runs_as_one_process(tmp_path):
    out, trace = run_lab("hybrid", 1, [], tmp_path)
    assert re.search(r"^summary: lab=hybrid world=1 ", out, re.M)
    check_trace(trace, 1)


def test_every_lab_has_a_module():
    import importlib
    for name in LABS:
        assert callable(importlib.import_module(f"parlab.labs.{name}").main)
