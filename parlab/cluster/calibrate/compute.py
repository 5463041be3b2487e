"""Calibration's compute part: time single ops (products, batched products, adds and copies) and fit the replay's
compute model to them (`parlab.cluster.calibrate` has the whole procedure and the formula).

    t = FLOPs / F + cached bytes / B_cache + other bytes / B + c per kernel

`fit_compute` fits it on relative error with every coefficient >= 0 (the best of the column subsets), keeping a
cache level only when it fits clearly better and is at least 1.25x faster; `fit_roofline` is the one-level
form. `_compute_samples` measures on every rank at once (a barrier before each sample), the work counted by the
replay's own meter (`parlab.trace.meter`), so that the fitted rates apply to metered spans.

References
    S. Williams, A. Waterman, D. Patterson, "Roofline: An Insightful Visual Performance Model for Multicore
        Architectures", CACM 52(4), 2009 (time bounded by FLOPs / peak and bytes / bandwidth).
    J. Bang et al., "vTrain", MICRO 2024: operator costs profiled on the machine itself, as here, rather than
        taken from a datasheet.
"""
from __future__ import annotations

import statistics
import time

import torch

from parlab import comm
from parlab.cluster.calibrate.fit import fit_rates

__all__ = ["fit_roofline", "fit_compute"]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timeit(fn, device, min_time: float = 0.2, reps: int = 3) -> float:
    """Median seconds of one call of fn, over `reps` rounds each at least `min_time` long."""
    fn()
    _sync(device)
    out = []
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            _sync(device)
            t = time.perf_counter() - t0
            if t >= min_time:
                break
        out.append(t / n)
    return statistics.median(out)


def _inv(c: dict, j: int) -> float:
    return 1 / c[j] if c.get(j, 0) > 0 else 1e30                # a term the fit dropped: free


def fit_roofline(samples) -> tuple[float, float, float]:
    """(FLOP/s, bytes/s, seconds per kernel) fitting t = flops / F + bytes / B + kernels x c to (flops, bytes,
    kernels, t) samples, least squares on relative error, every coefficient >= 0 (the best of the subsets)."""
    _, c = fit_rates(samples, 3)
    return _inv(c, 0), _inv(c, 1), c.get(2, 0.0)


def fit_compute(samples, min_gain: float = 0.8, min_speedup: float = 1.25) -> dict:
    """The compute model of `parlab.cluster.hardware` (module docstring) fitted to (flops, bytes, kernels, t, working
    set[, batched flops]) samples. One level: t = (flops - F_b) / F + F_b / F_bmm + bytes / B + kernels x c.
    Two levels: for each candidate cache size C (a power of two between the samples' working sets, with at
    least two memory-bound samples on each side) the bytes split into cached ones (size class k with
    2^(k+1) <= C, at B_cache) and the others (at B). The best C is kept when it fits clearly better than one
    bandwidth (relative squared error below `min_gain` x the one-level fit's) with B_cache > `min_speedup` x B;
    otherwise the one-level fit, cache_bw None. bmm_flops is None when no sample has batched FLOPs.
    Returns dict(peak_flops, bmm_flops, mem_bw, kernel_overhead, cache_bw, cache_bytes)."""
    from parlab.trace.histogram import size_class

    def parts(s):
        f, b, k, t, ws = s[:5]
        fb = s[5] if len(s) > 5 else 0.0
        return f - fb, fb, b, k, t, ws

    rows1 = [(f, fb, b, k, t) for f, fb, b, k, t, _ in map(parts, samples)]
    err1, c1 = fit_rates(rows1, 4)
    out = dict(peak_flops=_inv(c1, 0), bmm_flops=_inv(c1, 1) if c1.get(1, 0) > 0 else None, mem_bw=_inv(c1, 2),
               kernel_overhead=c1.get(3, 0.0), cache_bw=None, cache_bytes=0.0)
    mem = [(b, ws) for _, _, b, _, _, ws in map(parts, samples) if b]
    best = None
    for top in sorted({size_class(ws) for _, ws in mem}):
        cache = 2.0 ** (top + 1)                                  # classes <= top are cached

        def fits(ws):
            return 2.0 ** (size_class(ws) + 1) <= cache
        if sum(1 for _, ws in mem if fits(ws)) < 2 or sum(1 for _, ws in mem if not fits(ws)) < 2:
            continue
        rows = [(f, fb, b if b and fits(ws) else 0, 0 if b and fits(ws) else b, k, t)
                for f, fb, b, k, t, ws in map(parts, samples)]
        err, c = fit_rates(rows, 5)
        if best is None or err < best[0]:
            best = (err, c, cache)
    if best is not None and best[0] < min_gain * err1:
        err, c, cache = best
        if c.get(2, 0) > 0 and c.get(3, 0) > 0 and _inv(c, 2) > min_speedup * _inv(c, 3):
            out = dict(peak_flops=_inv(c, 0), bmm_flops=_inv(c, 1) if c.get(1, 0) > 0 else None, mem_bw=_inv(c, 3),
                       kernel_overhead=c.get(4, 0.0), cache_bw=_inv(c, 2), cache_bytes=cache)
    return out


def _metered(fn) -> tuple[float, int, int, int, float]:
    """(FLOPs, bytes, kernels, largest working set, batched FLOPs) of one call of fn, as the replay's meter counts
    them."""
    from parlab.trace.meter import CostMeter
    meter = CostMeter()
    with meter:
        fn()
    f, b, k, hist, fb = meter.state()[:5]
    return f, b, k, max((v for _, v in hist), default=0), fb


def _compute_samples(dev, dtype, gpu: bool, min_time: float) -> list[tuple[float, int, int, float, int, float]]:
    """(flops, bytes, kernels, seconds, working set, batched flops) of single ops of several sizes: products,
    batched products shaped like attention's (b x m x k) @ (b x k x n), and elementwise adds and copies from
    cache-sized to memory-sized (work and working sets as the replay's meter counts them, so that the fitted
    rates apply to metered spans)."""
    out = []
    for n in ((1024, 2048, 4096, 8192) if gpu else (32, 64, 128, 256)):
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        comm.barrier()
        f, _, k, _, fb = _metered(lambda: a @ b)
        out.append((f, 0, k, _timeit(lambda: a @ b, dev, min_time), 0, fb))
    shapes = (((32, 2048, 128, 2048), (32, 2048, 2048, 128)) if gpu
              else ((4, 256, 32, 256), (4, 256, 256, 32), (16, 64, 32, 64)))
    for bs, m, k_, n in shapes:                       # scores q k^T (small inner dim k), and weights @ v
        a, b = torch.randn(bs, m, k_, device=dev, dtype=dtype), torch.randn(bs, k_, n, device=dev, dtype=dtype)
        comm.barrier()
        f, _, k, _, fb = _metered(lambda: a @ b)
        out.append((f, 0, k, _timeit(lambda: a @ b, dev, min_time), 0, fb))
    sizes = (1 << 16, 1 << 20, 1 << 24, 1 << 26) if gpu else (1, 1 << 10, 1 << 14, 1 << 16, 1 << 17, 1 << 18, 1 << 19,
                                                              1 << 20, 1 << 21, 1 << 22, 1 << 23)
    for numel in sizes:
        x, y = torch.randn(numel, device=dev, dtype=dtype), torch.randn(numel, device=dev, dtype=dtype)
        for op in ((lambda: x + y), (lambda: y.copy_(x))):
            comm.barrier()
            f, nbytes, k, ws, fb = _metered(op)
            out.append((f, nbytes, k, _timeit(op, dev, min_time), ws, fb))
    return out
