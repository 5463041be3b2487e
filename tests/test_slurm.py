"""The labs, calibration and the hang watchdog under a real SLURM (srun and sbatch), not an imitation of its
environment: a one-node cluster (munged + slurmctld + slurmd, `slurm_cluster.local_slurm`) is started for this
file. tests/test_faults.py covers the same code paths with SLURM's variables set by hand, in every environment.

What a cluster user does, and what must hold:
* ``sbatch`` a job script written as parlab/labs/README.md says (``export MASTER_ADDR=$(scontrol show
  hostnames ...)``, one ``srun -K python -m parlab.labs.NAME`` per lab): each lab trains, each task with one torch
  thread (said once), data parallel's loss equals that of the same ranks started as torchrun starts them, and
  nothing is printed at exit but the labs' own lines (no C++ stack traces from the rendezvous store);
* ``srun -n 2 parlab calibrate --quick`` (each op timed for 5 ms: what is checked is the tasks' cooperation, not the
  numbers): the two tasks measure together and one description is written, once;
* rank 0's task stopped with ``kill -STOP`` (its process holds the rendezvous store under srun): the other task
  says so within the lab's ``--timeout``, and ``srun -K`` ends the step. (Another rank stopped is found by rank
  0's store watch, as under torchrun: tests/test_faults.py, ``test_a_stopped_lab_worker_is_named_by_the_survivors``.)
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forked_ranks import run_forked
from slurm_cluster import local_slurm, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

PY = sys.executable
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--batch", "8", "--steps", "3",
        "--quiet", "--no-trace"]
# two labs: the DP world and the hybrid's groups of a grid (every lab under srun, against torchrun's throughput: benchmarks/README.md, "Labs under a real SLURM")
LABS = {"data_parallel": [], "hybrid": ["--tp", "2"]}           # (the hybrid: the README's CPU script)
NOISE = ("recvValue", "terminate called", "TCPStore.cpp", "Traceback")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with local_slurm(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def _loss(text: str, lab: str) -> str:
    m = re.search(rf"summary: lab={lab} world=2 .*?loss=(\S+)", text)
    assert m, f"no summary line of lab {lab} in:\n{text[-3000:]}"
    return m.group(1)


def _documented_master_addr() -> str:
    """The line parlab/labs/README.md gives, where this machine resolves its own host name (a container may not:
    that is the machine's DNS, not parlab, and the address is then the loopback one)."""
    try:
        socket.gethostbyname(socket.gethostname().split(".")[0])
    except OSError:
        return "export MASTER_ADDR=127.0.0.1"
    return 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'


def _readme_cpu_script() -> str:
    """The CPU cluster's sbatch script of parlab/labs/README.md, as a user copies it (on this one node: --nodes=1;
    this environment's python; a short run)."""
    readme = (Path(__file__).parents[1] / "parlab" / "labs" / "README.md").read_text()
    script = re.search(r"```bash\n(#!/bin/bash\n#SBATCH --job-name=parlab-hybrid-cpu\n.*?)```", readme, re.S).group(1)
    assert "#SBATCH --nodes=2\n" in script and "srun -K python -m parlab.labs.hybrid" in script
    script = script.replace("#SBATCH --nodes=2\n", "#SBATCH --nodes=1\n").replace(" python -m", f" {PY} -m")
    script = script.replace('export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                            _documented_master_addr())      # the loopback address where the host name does not resolve
    return script.rstrip() + " --steps 3 --quiet --no-trace\n"


def test_labs_run_in_an_sbatch_job_as_under_torchrun(slurm, tmp_path):
    """The README's CPU script (the hybrid lab, tp 2) and a data-parallel lab after it, in one job."""
    script = tmp_path / "labs.sbatch"
    script.write_text(_readme_cpu_script() + f"srun -K {PY} -m parlab.labs.data_parallel {' '.join(TINY)}\n")
    submitted = subprocess.run(["sbatch", "--parsable", "--output", str(tmp_path / "job.out"), str(script)],
                               env=slurm, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    # while the job runs: the same lab's ranks as torchrun starts them (its loss is compared below; forked with
    # torchrun's worker environment, tests/forked_ranks.py: tests/test_labs.py runs a lab under torchrun itself)
    (tmp_path / "ref").mkdir()
    ref = run_forked("parlab.labs.data_parallel", TINY, 2, tmp_path / "ref")
    state = _wait_for_job(slurm, submitted.stdout.strip().split(";")[0])
    text = (tmp_path / "job.out").read_text()
    assert state == ("COMPLETED", "0:0"), f"job {state}:\n{text[-4000:]}"
    for lab in LABS:
        assert _loss(text, lab)
    assert text.count("each srun task computes with 1 torch thread") == len(LABS)     # rank 0 says it, once a lab
    assert not [n for n in NOISE if n in text], text[-4000:]
    # under torchrun the same lab ended at the same loss: srun's tasks took the same ranks and the same data
    assert _loss(ref, "data_parallel") == _loss(text, "data_parallel")


def _wait_for_job(env, job: str, seconds: float = 600) -> tuple[str, str]:
    """(JobState, ExitCode) of a batch job once it has ended, polled every 0.3 s (``sbatch --wait`` polls with
    growing sleeps of up to 10 s; this is the same answer sooner)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        info = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
        fields = dict(kv.split("=", 1) for kv in info.split() if "=" in kv)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields["JobState"], fields.get("ExitCode", "")
        time.sleep(0.3)
    raise AssertionError(f"job {job} did not end within {seconds:g} s")


def test_calibrate_under_srun_measures_once_and_writes_one_description(slurm, tmp_path):
    out = subprocess.run(["srun", "-K", "-n", "2", "--export", "ALL,MASTER_ADDR=127.0.0.1", PY, "-m", "parlab.cli",
                          "calibrate", "--out", str(tmp_path / "here.json"), "--quick", "--min-time", "0.005"],
                         env=slurm, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("here.json") == 1, out.stdout          # rank 0 alone writes and says so
    assert "2 x cpu (measured)" in json.loads((tmp_path / "here.json").read_text())["name"]   # both tasks measured
    assert not [n for n in NOISE if n in out.stdout + out.stderr], out.stderr[-3000:]


def _task_pid(job_marker: str, rank: int) -> int | None:
    """The pid of the lab's task `rank` whose environment holds `job_marker` (read from /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"parlab.labs.data_parallel" in cmd and job_marker.encode() in environ \
                and f"SLURM_PROCID={rank}".encode() in environ:
            return int(pid)
    return None


def test_a_stopped_rank_0_task_is_reported_by_the_other_within_the_timeout(slurm, tmp_path):
    marker = f"PARLAB_TEST_STOP={os.getpid()}"
    log = tmp_path / "step.log"
    cmd = ["srun", "-K", "-n", "2", "--export", f"ALL,MASTER_ADDR=127.0.0.1,{marker}", PY, "-m",
           "parlab.labs.data_parallel", "--steps", "1000000", "--layers", "1", "--hidden", "16", "--heads", "2",
           "--seq-len", "8", "--batch", "4", "--quiet", "--no-trace", "--timeout", "5"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=slurm, cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT)
    victim = None
    try:
        for _ in range(1200):                                       # until the ranks train (2 min at most)
            if "rows per rank" in log.read_text() or proc.poll() is not None:
                break
            time.sleep(0.1)
        time.sleep(1)
        victim = _task_pid(marker, 0)
        assert victim is not None, log.read_text()[-3000:]
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        proc.wait(timeout=120)                                      # srun -K ends the step once the other fails
        took = time.monotonic() - t0
        text = log.read_text()
        assert "[rank 1] the rendezvous store has not answered for" in text and "rank 0's" in text, text[-3000:]
        assert proc.returncode != 0
        assert took < 90, f"the step took {took:.0f} s to end after the stop"   # --timeout 5 + SLURM's KillWait 5
    finally:
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()
