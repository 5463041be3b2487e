"""Context-parallel attention: peak activation memory and step time per rank vs sequence length and P.

    python benchmarks/context_parallel.py                      # defaults below
    python benchmarks/context_parallel.py --seq 1024 2048 --P 2 4 --repeats 5

One "step" is the forward and backward of one causal attention layer, q, k, v of shape
(B, nh, S, hd) in float32, split over P simulated ranks (parlab.run, gloo on the CPU, one torch
thread per rank). Methods:

    full naive    one process, parlab.models.causal_attention (materialises the S x S scores)
    full sdpa     one process, torch's scaled_dot_product_attention (a fused CPU kernel)
    ring contig   parlab.parallel.context.ring, contiguous chunks (causal work imbalanced)
    ring zigzag   parlab.parallel.context.ring, zigzag chunks (balanced)
    ulysses       parlab.parallel.context.ulysses.ulysses_attention (all-to-all to heads, naive attention)

(torch's own context_parallel does not run on the CPU, so the one-process attention is the reference.)

How it is measured, on every rank:
* memory: the rise of the process's resident set during one step: /proc/self/clear_refs resets the
  high-water mark, peak = VmHWM - VmRSS before the step. glibc's mmap threshold is pinned to 64 KiB
  (mallopt) so freed tensors go back to the OS instead of hiding in malloc's free lists. This counts
  every byte the step touched (scores, softmax, gradients, receive buffers, BLAS workspace), in pages.
  The largest rise over the timed steps is reported.
* time: the median over `--repeats` steps of the wall time of forward + backward, after one warm-up
  step; ranks start each step together (barrier). The table gives the slowest rank (the step is as
  slow as it) and every rank's time.
On a machine with fewer cores than ranks, ranks share cores and times mean less; the last column is the
1-minute load average after the row, to say how busy the machine was.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch
import torch.nn.functional as F

import parlab
from parlab import comm
from parlab.models import causal_attention
from parlab.parallel.context import ring_attention, shard_sequence
from parlab.parallel.context import ulysses_attention

METHODS = {  # name -> (ranks: "P" or 1, layout)
    "full naive": (1, "contiguous"), "full sdpa": (1, "contiguous"),
    "ring contig": ("P", "contiguous"), "ring zigzag": ("P", "zigzag"), "ulysses": ("P", "contiguous"),
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status (Linux only)")


def _rank(method: str, S: int, B: int, nh: int, hd: int, repeats: int):
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)        # M_MMAP_THRESHOLD: big frees return to the OS
    P, r = comm.get_world_size(), comm.get_rank()
    layout = METHODS[method][1]
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(B, nh, S, hd, generator=g) for _ in range(4)]                 # (B, nh, S, hd)
    q, k, v, do = (shard_sequence(t, P, r, layout, dim=2) for t in full)              # (B, nh, S/P, hd)
    del full
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attend = {"full naive": lambda: causal_attention(q, k, v, causal=True),
              "full sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
              "ring contig": lambda: ring_attention(q, k, v, causal=True, layout="contiguous"),
              "ring zigzag": lambda: ring_attention(q, k, v, causal=True, layout="zigzag"),
              "ulysses": lambda: ulysses_attention(q, k, v, causal=True)}[method]

    def step():
        q.grad = k.grad = v.grad = None
        attend().backward(do)

    step()                                                 # warm-up
    peaks, times = [], []
    for _ in range(repeats):
        if P > 1:
            comm.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                   # reset VmHWM to the current VmRSS
        base = _status("VmRSS")
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        peaks.append(_status("VmHWM") - base)
    return max(peaks), statistics.median(times)


def measure(method: str, S: int, P: int, B: int = 1, nh: int = 8, hd: int = 32, repeats: int = 3) -> dict:
    """One row of the table: the method run on P ranks (1 for the full references)."""
    ranks = P if METHODS[method][0] == "P" else 1
    res = parlab.run(_rank, ranks, method, S, B, nh, hd, repeats, threads=1, timeout=600, echo=False)
    peaks, times = zip(*res.results)
    return {"method": method, "P": ranks, "S": S, "peak_mib": max(peaks) / 2**20,
            "step_ms": max(times) * 1e3, "rank_ms": [t * 1e3 for t in times]}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--P", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    rows = []
    print(f"causal attention fwd+bwd, float32, B={a.batch} nh={a.heads} hd={a.head_dim}, 1 thread per rank\n")
    print("| method | P | S | peak MiB / rank | step ms (slowest rank) | ms per rank | load avg |")
    print("|---|---|---|---|---|---|---|")
    for S in a.seq:
        plan = [("full naive", 1), ("full sdpa", 1)] + [(m, P) for P in a.P
                                                       for m in ("ring contig", "ring zigzag", "ulysses")]
        for method, P in plan:
            row = measure(method, S, P, a.batch, a.heads, a.head_dim, a.repeats)
            rows.append(row)
            print(f"| {method} | {row['P']} | {S} | {row['peak_mib']:.1f} | {row['step_ms']:.1f} | "
                  + " ".join(f"{t:.0f}" for t in row["rank_ms"]) + f" | {os.getloadavg()[0]:.1f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
