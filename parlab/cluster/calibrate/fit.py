"""The least-squares fits of the calibration: times as sums of rates, on relative error, every rate >= 0.

Measured times span six orders of magnitude (a 4-byte message and a 256 MB one), so the fits weigh each sample
by its own size (least squares on relative error): on absolute error the largest samples alone would set every
coefficient, and their noise with it. A coefficient may not be negative (a negative time per byte means the fit
is explaining noise): the best fit over the subsets of columns that leaves every coefficient >= 0 wins.

* `fit_rates`: t = sum_j x_j c_j over rows (x_1, ..., x_n, t), used for the compute roofline and the in-step costs.
* `fit_alpha_beta`: the alpha-beta model of a link, t = alpha + factor X / B (Hockney 1994), the factor taken from
  the byte model of the collective timed (`parlab.trace.wire`: 2(N-1)/N for a ring all-reduce).
"""
from __future__ import annotations

import torch

from parlab.trace.wire import ring_factor

__all__ = ["fit_rates", "fit_alpha_beta"]


def fit_rates(samples, ncols: int) -> tuple[float, dict[int, float]]:
    """(relative squared error, {column: seconds per unit}) of t = sum_j x_j c_j fitted to rows (x_1..x_n, t),
    least squares on relative error, every coefficient >= 0: the best of the column subsets."""
    import itertools
    best = None
    for keep in itertools.chain.from_iterable(itertools.combinations(range(ncols), k) for k in range(ncols, 0, -1)):
        a = torch.tensor([[row[j] / row[ncols] for j in keep] for row in samples], dtype=torch.float64)
        if not bool((a.abs().sum(0) > 0).all()):                 # a column no sample exercises: not identifiable
            continue
        coef = torch.linalg.lstsq(a, torch.ones(len(samples), 1, dtype=torch.float64)).solution.flatten()
        if (coef < 0).any():
            continue
        err = float(((a @ coef) - 1).pow(2).sum())
        if best is None or err < best[0]:
            best = (err, dict(zip(keep, coef.tolist())))
    if best is None:
        raise ValueError("could not fit the model to the measurements; rerun on a quieter machine")
    return best


def fit_alpha_beta(rows, n: int, factor: float | None = None) -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) of t = alpha + factor X / B over (X, t) rows, least squares on relative
    error with alpha, 1/B >= 0 (the sizes span six orders of magnitude: on absolute error the largest messages
    alone would set alpha, and their noise with it); factor defaults to the ring all-reduce's 2 (n-1)/n."""
    if n < 2:
        raise ValueError("fitting a link needs at least 2 ranks: pass --world 2 or more")
    factor = ring_factor("all_reduce", n) if factor is None else factor
    _, c = fit_rates([(1.0, factor * size, t) for size, t in rows], 2)
    # a per-byte term below a millionth of the largest message's time is the solver's rounding, not a bandwidth
    # (constant rows gave 1/B = 2e-24 s/byte on one machine and exactly 0 on another)
    largest = max(rows, key=lambda r: r[0])
    if not c.get(1, 0) * factor * largest[0] > 1e-6 * largest[1]:
        raise ValueError("all-reduce time does not grow with message size in these measurements; "
                         "the machine is too noisy: rerun with more --reps, on a quieter machine")
    return c.get(0, 0.0), 1.0 / c[1]
