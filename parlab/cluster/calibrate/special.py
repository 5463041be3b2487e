"""Calibration of special functions: how fast this machine evaluates exp, log and erf.

The replay's compute model (`parlab.cluster.hardware.Hardware.compute_time`) charges a memory-bound op its bytes; ops
that evaluate a special function per element (softmax, logsumexp, GeLU: `parlab.trace.meter.SPECIAL_OPS`)
also pay ``special / special_rate``. On a GPU the rate comes from the datasheet (16 results per clock per SM).
On a CPU the functions are polynomial approximations in software, a few results per nanosecond, and on this
machine they were the largest part of ring attention's compute that the bytes alone did not explain (an
exponential over 130 k elements took 320 us where its bytes took 60 us: benchmarks/README.md).

`special_samples` times exp, GeLU and logsumexp over a few sizes, metered by the replay's own meter;
`fit_special_rate` takes what the bytes and the per-op cost do not explain, per result, and returns the median
rate (None when the functions cost nothing beyond their bytes here).
"""
from __future__ import annotations

import statistics

import torch

from parlab.cluster.hardware import Hardware

__all__ = ["special_samples", "fit_special_rate"]


def special_samples(dev, dtype, timeit, min_time: float, gpu: bool = False, barrier=None) -> list[tuple]:
    """(bytes, kernels, size histogram, special results, seconds) of single exp, GeLU and logsumexp calls of
    several sizes, as the replay's meter counts them; `timeit(fn, device, min_time)` times one call. `barrier`
    (e.g. parlab.comm.barrier) lines the ranks up before each, so that all of them time it at once."""
    from parlab.trace.meter import CostMeter
    sizes = (1 << 20, 1 << 22, 1 << 24) if gpu else (1 << 14, 1 << 16, 1 << 18, 1 << 20)
    out = []
    for numel in sizes:
        x = torch.randn(numel // 256, 256, device=dev, dtype=dtype)                    # (rows, 256)
        for fn in ((lambda: x.exp()), (lambda: torch.nn.functional.gelu(x)), (lambda: x.logsumexp(-1))):
            meter = CostMeter()
            with meter:
                fn()
            _, b, k, hist, _, special = meter.state()[:6]
            if barrier is not None:
                barrier()
            out.append((b, k, hist, special, timeit(fn, dev, min_time)))
    return out


def fit_special_rate(hw: Hardware, samples) -> float | None:
    """Special-function results per second: the median over `samples` (`special_samples`, each time the
    median over the ranks) of results / (time - what `hw` charges the op's bytes and kernel). None when no
    sample took longer than its bytes (the functions are free beyond their memory traffic)."""
    rates = []
    for b, k, hist, special, t in samples:
        rest = t - hw.compute_time(0.0, b, k, hist)
        if special and rest > 0:
            rates.append(special / rest)
    if len(rates) * 2 <= len(samples):                     # most samples were no slower than their bytes
        return None
    return statistics.median(rates)
