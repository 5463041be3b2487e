"""Calibration from training steps: the per-op and per-byte costs that single ops do not show.

`parlab.calibrate` fits the replay's compute model (`parlab.hardware`) to single ops timed in a loop: a matrix
product, an add, a copy. A training step costs more per op than that: each aten op of autograd's backward and
of the optimizer also pays the autograd engine's bookkeeping, and outputs freshly allocated every step pay page
faults that a loop reusing its buffers never sees. On a CPU a replay with the single-op fit came out 2-6x too
fast (benchmarks/README.md, "Virtual cluster").

So calibration also times whole single-process training steps (forward, backward, AdamW step) of small GPTs of
a few shapes (`STEP_SHAPES`), each step metered once by the replay's own meter (`parlab.replay_meter`) for its
FLOPs F (F_b of them batched), memory-bound bytes M (by working-set class) and ops K, and timed unmetered
(median of several). With the single-op fit's times of those products, T_F = (F - F_b) / F_mm + F_b / F_bmm,
and of those bytes, T_mem(M) (cache and memory levels), it fits, least squares on relative error, all
coefficients >= 0:

    t_step  =  gamma x T_F  +  K x c  +  beta x T_mem(M)

The description then has kernel_overhead = c (the cost of one op inside a training step), both product rates
divided by gamma (a step's products are small and transposed, and run with caches the other ops have used) and
both bandwidths divided by beta (per-byte costs inside a step). When the three-term fit drops a term (a
coefficient 0), gamma is held at 1 and only c and beta are fitted. The shapes are not the benchmark's
workloads (those are only checked, never fitted).
"""
from __future__ import annotations

import statistics
import time

import torch

from .hardware import Hardware

__all__ = ["STEP_SHAPES", "step_samples", "fit_step", "apply_step_fit"]

#: (n_embd, n_layer, n_head, seq_len, rows) of the calibration steps: widths, depths and lengths around the
#: lessons' toy models, none of them a shape benchmarks/replay.py reports
STEP_SHAPES = ((48, 2, 2, 32, 4), (96, 2, 4, 48, 6), (64, 3, 2, 96, 2), (160, 1, 4, 40, 8), (80, 2, 2, 24, 12),
               (112, 1, 4, 128, 2))


def _gpt_step(n_embd: int, n_layer: int, n_head: int, seq: int, rows: int):
    from .models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=128, seq_len=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    model = GPT(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(cfg.vocab_size, (rows, seq), generator=g, device="cpu")            # (B, S)
    y = torch.randint(cfg.vocab_size, (rows, seq), generator=g, device="cpu")            # (B, S)

    def step():
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def step_samples(shapes=STEP_SHAPES, reps: int = 5, barrier=None) -> list[tuple]:
    """(flops, bytes, kernels, median seconds, size histogram, batched flops) of one training step per shape:
    metered once (the replay's meter), timed `reps` times unmetered. `barrier` (e.g. parlab.comm.barrier) lines
    the ranks up before each shape, so that every rank gets the share of the machine it has in a real run."""
    from .replay_meter import CostMeter
    out = []
    for shape in shapes:
        step = _gpt_step(*shape)
        step()
        step()                                                             # warm-up: AdamW's states, allocator
        meter = CostMeter()
        with meter:
            step()
        f, b, k, hist, fb = meter.state()
        if barrier is not None:
            barrier()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out.append((f, b, k, statistics.median(times), hist, fb))
    return out


def _flop_time(hw: Hardware, f: float, fb: float) -> float:
    return hw.compute_time(f, 0, 0, (), fb)


def _mem_time(hw: Hardware, b: float, hist) -> float:
    return hw.compute_time(0.0, b, 0, hist)


def fit_step(hw: Hardware, samples) -> tuple[float, float, float]:
    """(c seconds per op, beta, gamma) of the step model in the module docstring, fitted to `step_samples` rows
    with the single-op rates of `hw`."""
    from .calibrate import _fit_rates
    rows = [(_flop_time(hw, f, fb), float(k), _mem_time(hw, b, hist), t) for f, b, k, t, hist, fb in samples]
    if len(rows) < 3:
        raise ValueError(f"fitting the step model needs at least 3 training-step samples, got {len(rows)}")
    _, c = _fit_rates(rows, 3)
    if all(c.get(j, 0) > 0 for j in range(3)):
        return c[1], c[2], c[0]
    rest = [(k, m, t - tf) for tf, k, m, t in rows if t > tf]          # gamma = 1: what the products leave
    if len(rest) < 2:
        raise ValueError("the training-step samples took less time than their matrix products alone; the machine "
                         "is too noisy to fit a per-op cost: rerun calibration on a quieter machine")
    _, c = _fit_rates(rest, 2)
    return c.get(0, 0.0), c.get(1, 0.0), 1.0


def apply_step_fit(hw: Hardware, c: float, beta: float, gamma: float = 1.0) -> Hardware:
    """`hw` with kernel_overhead = c, its memory bandwidths divided by beta (beta 0: left as they are) and its
    product rates divided by gamma."""
    changes = dict(kernel_overhead=c, peak_flops=hw.peak_flops / gamma)
    if hw.bmm_flops is not None:
        changes["bmm_flops"] = hw.bmm_flops / gamma
    if beta > 0:
        changes["mem_bw"] = hw.mem_bw / beta
        if hw.cache_bw is not None:
            changes["cache_bw"] = hw.cache_bw / beta
    return hw.with_(**changes)
