"""Cost of parlab.comm's tracing: torch.distributed directly vs parlab.comm with tracing off and on.

gloo ranks all-reduce a small tensor many times; we report microseconds per call, the median
of several rounds. With one rank (the default) the all-reduce does no network I/O, so what is
left is each path's own per-call cost; with 2 ranks gloo's loopback latency (100-1500 us per
call on a shared 2-core VM) swamps any difference.

    python benchmarks/trace_overhead.py [--ranks 1] [--calls 2000] [--rounds 7] [--numel 16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import parlab
from parlab import comm
from parlab.trace import recording


def _bench(calls: int, rounds: int, numel: int):
    t = torch.ones(numel)
    out = {"torch.distributed": [], "parlab.comm, tracing off": [], "parlab.comm, tracing on": []}
    for _ in range(rounds):
        for name in out:
            dist.barrier()
            start = time.perf_counter()
            if name == "torch.distributed":
                for _ in range(calls):
                    dist.all_reduce(t)
            elif name.endswith("off"):
                for _ in range(calls):
                    comm.all_reduce(t)
            else:
                with recording():
                    for _ in range(calls):
                        comm.all_reduce(t)
            out[name].append((time.perf_counter() - start) / calls * 1e6)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--numel", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=1)
    a = ap.parse_args()
    res = parlab.run(_bench, a.ranks, a.calls, a.rounds, a.numel, timeout=600)
    print(f"# {a.ranks} gloo rank(s), all_reduce of {a.numel} float32, {a.calls} calls x {a.rounds} rounds; us per call (rank 0)")
    print("| path | us per call |")
    print("|---|---|")
    for k, v in res.results[0].items():
        print(f"| {k} | {v:.1f} |")


if __name__ == "__main__":
    main()
