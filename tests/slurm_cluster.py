"""A one-node SLURM cluster for the tests: munged, slurmctld and slurmd started in a folder of their own.

Everything the daemons and the clients (srun, sbatch, scontrol) read or write lives under `root`: the munge key
and socket, ``slurm.conf`` (the clients find it through ``SLURM_CONF``), the state and spool folders, the logs.
Ports are free ones picked at start, so a SLURM already running on the machine is neither used nor disturbed.
The daemons run in the foreground as children of the test process and are stopped when the context ends.

Needs Debian's ``slurm-wlm`` and ``munge`` (``apt-get install slurm-wlm munge``; ``.ci/run`` installs them) and
root: slurmd starts each task as the submitting user, which only root can do. `unavailable()` says why not.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from net import free_port

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol")


def _find(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)),
                                      None)


def unavailable() -> str | None:
    """Why a local SLURM cannot be started here (None when it can)."""
    missing = [d for d in DAEMONS if _find(d) is None]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "slurmd must run as root to start tasks as the submitting user; run the tests as root (as CI does)"
    return None



CONF = """\
ClusterName=parlabtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=parlab Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@contextlib.contextmanager
def local_slurm(root: Path, cpus: int | None = None):
    """Start a one-node cluster under `root`; yields the environment for its clients (SLURM_CONF set)."""
    root = Path(root)
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)                                   # munged refuses a key or socket in a writable folder
    host = socket.gethostname().split(".")[0]           # slurmd takes its node name from the short host name
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(host=host, root=root, cpus=cpus or os.cpu_count() or 2,
                                ctld_port=free_port(), d_port=free_port()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"]:
        del env[k]                                       # a test run inside a SLURM job must not leak its job in
    subprocess.run([_find("mungekey"), "--create", f"--keyfile={root}/munge/key"], check=True, capture_output=True)
    procs = []
    try:
        procs.append(subprocess.Popen(
            [_find("munged"), "--foreground", "--force", f"--key-file={root}/munge/key",
             f"--socket={root}/munge/socket", f"--pid-file={root}/munge/pid", f"--log-file={root}/log/munged.log",
             f"--seed-file={root}/munge/seed"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(lambda: (root / "munge" / "socket").exists(), 20, "munged did not create its socket", root)
        for daemon in ("slurmctld", "slurmd"):
            procs.append(subprocess.Popen([_find(daemon), "-D", "-f", str(conf)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def idle() -> bool:
            out = subprocess.run([_find("sinfo"), "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            return out.returncode == 0 and out.stdout.strip() == "idle"
        _wait(idle, 60, "the node did not become idle", root, procs)
        yield env
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _wait(ready, seconds: float, what: str, root: Path, procs=()):
    deadline, dead = time.monotonic() + seconds, []
    while time.monotonic() < deadline:
        if ready():
            return
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead:
            break
        time.sleep(0.2)
    logs = "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                     for log in sorted((root / "log").glob("*.log")))
    raise RuntimeError(f"local SLURM: {what} within {seconds:g} s{' (' + ', '.join(dead) + ' exited)' if dead else ''}"
                       f"\n{logs}")
