"""Start-up time of simulated ranks: parlab.run vs torch.multiprocessing.spawn vs torchrun.

Each launch starts N ranks that initialise a gloo process group and do one all-reduce of a
scalar, then exit; we time the whole launch from the caller's side (a Python that has
already imported torch, as a notebook kernel has).

    python benchmarks/launch.py                 # 20 launches of parlab/mp.spawn, 3 of torchrun
    python benchmarks/launch.py --repeats 5 --torchrun-repeats 1 --sizes 2 8
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import parlab


def _one_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawn_worker(rank: int, world_size: int, port: int):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    _one_all_reduce()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t = torch.ones(1); dist.all_reduce(t)
    dist.destroy_process_group()
""")


def time_parlab(n: int) -> float:
    t = time.perf_counter()
    res = parlab.run(_one_all_reduce, n, echo=False)
    assert res.results == [float(n)] * n
    return time.perf_counter() - t


def time_spawn(n: int) -> float:
    t = time.perf_counter()
    mp.spawn(_spawn_worker, args=(n, _free_port()), nprocs=n, join=True)
    return time.perf_counter() - t


def time_torchrun(n: int, script: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", script],
                   check=True, capture_output=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--torchrun-repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="parlab-bench-")   # removed at exit, whatever happens
    script = os.path.join(tmp.name, "allreduce.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo; seconds per launch (median / max)")
    print("| ranks | parlab.run (fork + FileStore) | mp.spawn (TCP store) | torchrun |")
    print("|---|---|---|---|")
    for n in args.sizes:
        cols = []
        for fn, reps in ((time_parlab, args.repeats), (time_spawn, args.repeats),
                         (lambda k: time_torchrun(k, script), args.torchrun_repeats)):
            ts = [fn(n) for _ in range(reps)]
            cols.append(f"{statistics.median(ts):.3f} / {max(ts):.3f} (n={reps})")
        print(f"| {n} | " + " | ".join(cols) + " |", flush=True)


if __name__ == "__main__":
    main()
