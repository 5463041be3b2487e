"""Calibration inside a step: the per-op, per-byte and per-message costs that single ops and isolated
messages do not show.

`parlab.cluster.calibrate.compute` fits the replay's compute model (`parlab.cluster.hardware`) to single ops timed in a loop: a matrix
product, an add, a copy. A training step costs more per op than that: each aten op of the forward and backward also
pays the autograd engine's bookkeeping, each of the optimizer's the Python between ops, and outputs freshly
allocated every step pay page faults that a loop reusing its buffers never sees. On a CPU a replay with the
single-op fit came out 2-6x too fast (benchmarks/README.md, "Virtual cluster").

So calibration also times single-process training steps (forward, backward, AdamW step) of small GPTs of a
few shapes (`STEP_SHAPES`) in two parts (`PARTS`: forward + backward, then the optimizer step), each part metered
once by the replay's own meter (`parlab.trace.meter`) for its FLOPs F (F_b of them batched), memory-bound bytes
M (by working-set class), ops K_a run under autograd and K_p run outside it, and timed unmetered (median of
several). With the single-op fit's times of those products, T_F = (F - F_b) / F_mm + F_b / F_bmm, and of those
bytes, T_mem(M) (cache and memory levels), and of its special-function results, T_sp (exp, erf:
`parlab.cluster.calibrate.special`, held as measured), four models of a part's time, with K c = K_a c + K_p c_plain:

    per-op        t  =  T_F          +  K c  +  T_mem(M)         +  T_sp
    + memory      t  =  T_F          +  K c  +  beta x T_mem(M)  +  T_sp
    + products    t  =  gamma x T_F  +  K c  +  T_mem(M)         +  T_sp
    + both        t  =  gamma x T_F  +  K c  +  beta x T_mem(M)  +  T_sp

each fitted by least squares on relative error (c, c_plain >= 0, beta and gamma > 0). Two per-op costs because an
op autograd records or runs pays the engine's bookkeeping and an optimizer's op does not: on this machine 14-20
us against 3-5 us, and AdamW runs about twice as many ops as forward and backward together in these models, so a
single cost fitted to whole steps came out 7 us, overcharged the optimizer by two thirds and undercharged forward
and backward by 5-10% (benchmarks/README.md, round 7); the parts tell the two apart, since their mixes differ.
F, M and K all grow with a model's size, so the larger models can fit noise: each model is scored by how well it
predicts a part it was not fitted to (leave-one-out over the rows), and calibration takes the models' average
weighted by 1 / error^2 (a combination of forecasts, Bates and Granger 1969), not the best one alone. "+ memory"
and "+ products" predict the calibration steps about equally well (4.0% and 4.6% in one calibration, 4.4% and
3.9% in the next), yet in the first the compute of a ring-attention step (batched products and softmax) comes
out 6.1 ms under one and 4.6 ms under the other, so keeping the winner made replays jump between calibrations
(benchmarks/README.md, round 6); the average moves smoothly with the errors. A model whose error is 0 is taken
alone. The description then has kernel_overhead = c and plain_kernel_overhead = c_plain (the cost of one op
inside a training step: the engine's and the optimizer's bookkeeping, Python between ops), its product rates
divided by gamma and its bandwidths divided by beta. The shapes are not the benchmark's workloads (those are
only checked, never fitted).

Messages inside a step (`overlap_rows`, `fit_overlap`): the same compute is timed alone and with a ring step's
send and receive in flight. On GPUs, and on a CPU with cores to spare, the messages hide behind it; on a CPU
whose cores each run a rank, gloo moves the bytes with those cores and the compute slows down by about the
messages' time, or more (a rank that blocks waits for the scheduler). When the median slow-down is half the
isolated message time or more, the description gets `comm_overlap` False and a p2p latency and bandwidth fitted
to the slow-down (the per-message cost inside a step).

References: vTrain (Bang et al., MICRO 2024) likewise takes operator costs from profiled training iterations
rather than from operators run alone; the models are scored by leave-one-out cross-validation (Stone,
"Cross-validatory choice and assessment of statistical predictions", J. R. Stat. Soc. B, 1974) and combined with
weights inverse to their squared errors (Bates and Granger, "The combination of forecasts", Oper. Res. Q., 1969).
"""
from __future__ import annotations

import statistics
import time

import torch

from parlab.cluster.hardware import Hardware

__all__ = ["STEP_SHAPES", "MODELS", "step_samples", "fit_step", "apply_step_fit", "overlap_rows", "fit_overlap"]

#: (n_embd, n_layer, n_head, seq_len, rows) of the calibration steps: widths, depths and lengths around the
#: lessons' toy models, none of them a shape benchmarks/replay.py reports; the last two as large as the benchmark's
#: steps (tens of ms), so that a replay of those is not an extrapolation from far smaller steps
STEP_SHAPES = ((48, 2, 2, 32, 4), (96, 2, 4, 48, 6), (64, 3, 2, 96, 2), (160, 1, 4, 40, 8), (80, 2, 2, 24, 12),
               (112, 1, 4, 128, 2), (144, 3, 4, 64, 6), (96, 5, 4, 80, 6))


def _gpt_step(n_embd: int, n_layer: int, n_head: int, seq: int, rows: int, wrap=None, data_seed: int = 0,
              parts: bool = False):
    """One AdamW training step of a small GPT (vocab 128) on fixed random tokens, as a function; `wrap` (e.g.
    a DDP or FSDP constructor) wraps the model first (`parlab.cluster.calibrate.programs`). `parts`: the step's two parts
    as two functions instead, (forward + backward, optimizer step + zero_grad)."""
    from parlab.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=128, seq_len=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    model = GPT(cfg, seed=0) if wrap is None else wrap(GPT(cfg, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randint(cfg.vocab_size, (rows, seq), generator=g, device="cpu")            # (B, S)
    y = torch.randint(cfg.vocab_size, (rows, seq), generator=g, device="cpu")            # (B, S)

    def forward_backward():
        _, loss = model(x, y)
        loss.backward()

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step():
        forward_backward()
        optimizer()
    return (forward_backward, optimizer) if parts else step


#: the two parts a calibration step is timed in: ops autograd records or runs, and ops outside it
PARTS = ("forward + backward", "optimizer")


def step_samples(shapes=STEP_SHAPES, reps: int = 9, barrier=None, between=None) -> list[tuple]:
    """(flops, bytes, kernels, median seconds, size histogram, batched flops, special-function results, kernels
    run outside autograd, part) of each part (`PARTS`: forward + backward, then the optimizer) of one training
    step per shape, so two rows per shape: each part metered once (the replay's meter), timed `reps` times
    unmetered. The repetitions go round the shapes (one step of each shape, then the next round), so that a
    change of the machine's load during calibration shifts every shape alike instead of tilting the fit.
    `barrier` (e.g. parlab.comm.barrier) lines the ranks up before each round, so that every rank gets the share
    of the machine it has in a real run. `between()`, if given, is called after each round (`measure_rank`)."""
    from parlab.trace.meter import CostMeter
    steps, metered = [], []
    for shape in shapes:
        parts = _gpt_step(*shape, parts=True)
        for _ in range(2):                                                 # warm-up: AdamW's states, allocator
            for part in parts:
                part()
        for part in parts:
            meter = CostMeter()
            with meter:
                part()
            metered.append(meter.state())
        steps.append(parts)
    times = [[] for _ in metered]
    for _ in range(reps):
        if barrier is not None:
            barrier()
        for i, parts in enumerate(steps):
            for j, part in enumerate(parts):
                t0 = time.perf_counter()
                part()
                times[2 * i + j].append(time.perf_counter() - t0)
        if between is not None:
            between()
    return [(f, b, k, statistics.median(ts), hist, fb, sp, kp, PARTS[i % 2])
            for i, ((f, b, k, hist, fb, sp, kp), ts) in enumerate(zip(metered, times))]


def _flop_time(hw: Hardware, f: float, fb: float) -> float:
    return hw.compute_time(f, 0, 0, (), fb)


def _mem_time(hw: Hardware, b: float, hist) -> float:
    return hw.compute_time(0.0, b, 0, hist)


def _special_time(hw: Hardware, special: float) -> float:
    return hw.compute_time(special=special)


MODELS = (("c",), ("c", "beta"), ("c", "gamma"), ("c", "beta", "gamma"))


def _fit_one(rows, free) -> tuple[float, dict] | None:
    """(relative squared error, {c, c_plain, beta, gamma}) of t = gamma T_F + c K_a + c_plain K_p + beta T_mem +
    T_sp over rows (T_F, K_a, K_p, T_mem, t, T_sp), the factors not in `free` held at 1; "c" in `free` frees both
    per-op costs (c_plain only when some row ran plain ops); least squares on relative error, c, c_plain >= 0,
    beta, gamma > 0."""
    import itertools
    col = {"gamma": 0, "c": 1, "c_plain": 2, "beta": 3}
    names = [n for n in free if n != "c"]
    if "c" in free:
        names += ["c"] + (["c_plain"] if any(r[2] for r in rows) else [])
    best = None
    optional = [n for n in names if n in ("c", "c_plain")]           # only the per-op costs may drop out (to 0)
    for drop in itertools.chain.from_iterable(itertools.combinations(optional, k) for k in range(len(optional) + 1)):
        keep = [n for n in names if n not in drop]
        fixed = [sum(r[col[n]] for n in ("gamma", "beta") if n not in free) + r[5] for r in rows]
        a = torch.tensor([[r[col[n]] / r[4] for n in keep] for r in rows], dtype=torch.float64, device="cpu")
        rhs = torch.tensor([[1 - fx / r[4]] for fx, r in zip(fixed, rows)], dtype=torch.float64, device="cpu")
        if keep:
            coef = torch.linalg.lstsq(a, rhs).solution.flatten()
            if (coef < 0).any() or any(float(v) == 0 for n, v in zip(keep, coef) if n in ("beta", "gamma")):
                continue
            err = float(((a @ coef.unsqueeze(1)) - rhs).pow(2).sum())
        else:
            coef, err = torch.zeros(0, dtype=torch.float64, device="cpu"), float(rhs.pow(2).sum())
        got = {"c": 0.0, "c_plain": 0.0, "beta": 1.0, "gamma": 1.0} | {n: float(v) for n, v in zip(keep, coef)}
        if "c_plain" not in names:                                      # no plain ops seen: they cost what others do
            got["c_plain"] = got["c"]
        if best is None or err < best[0] - 1e-15:
            best = (err, got)
    return best


def _predict(row, p) -> float:
    return p["gamma"] * row[0] + p["c"] * row[1] + p["c_plain"] * row[2] + p["beta"] * row[3] + row[5]


def _rows(hw: Hardware, samples) -> list[tuple]:
    """(T_F, K_a (ops under autograd), K_p (ops outside it), T_mem, t, T_sp) of each sample; a sample without a
    plain-kernel count (written before they were counted) has K_p = 0."""
    out = []
    for s in samples:
        kp = min(s[7], s[2]) if len(s) > 7 else 0
        out.append((_flop_time(hw, s[0], s[5]), float(s[2] - kp), float(kp), _mem_time(hw, s[1], s[4]), s[3],
                    _special_time(hw, s[6] if len(s) > 6 else 0.0)))
    return out


def fit_step(hw: Hardware, samples) -> dict:
    """The step model (module docstring) fitted to `step_samples` rows with the single-op rates of `hw`:
    dict(c, c_plain, beta, gamma (the models' weighted average), model (the one of lowest leave-one-out error),
    cv (its error), cv_all ({model: its leave-one-out RMS relative error}), weights ({model: its weight}))."""
    rows = _rows(hw, samples)
    if len(rows) < 4:
        raise ValueError(f"fitting the step model needs at least 4 training-step samples, got {len(rows)}")
    if any(not r[4] > 0 for r in rows):
        raise ValueError("a training-step sample has no positive time; rerun calibration")
    cv = {}
    for free in MODELS:
        errs = []
        for i in range(len(rows)):
            fit = _fit_one(rows[:i] + rows[i + 1:], free)
            if fit is None:
                break
            errs.append((_predict(rows[i], fit[1]) / rows[i][4] - 1) ** 2)
        if len(errs) == len(rows):
            cv[free] = (sum(errs) / len(errs)) ** 0.5
    if not cv:
        raise ValueError("the training-step samples fit no step model with positive costs; the machine is too noisy: "
                         "rerun calibration on a quieter machine")
    free = min(cv, key=lambda m: (cv[m], len(m)))
    if cv[free] < 1e-9:                                          # one model explains the steps exactly: it alone
        weights = {m: float(m == free) for m in cv}
    else:                                                        # forecast combination: weight ~ 1 / error^2
        inv = {m: cv[m] ** -2 for m in cv}
        weights = {m: w / sum(inv.values()) for m, w in inv.items()}
    fits = {m: _fit_one(rows, m)[1] for m in cv if weights[m] > 0}
    got = {k: sum(weights[m] * p[k] for m, p in fits.items()) for k in ("c", "c_plain", "beta", "gamma")}
    return dict(got, model=free, cv=cv[free], cv_all=cv, weights=weights)


def apply_step_fit(hw: Hardware, c: float, beta: float, gamma: float = 1.0, c_plain: float | None = None) -> Hardware:
    """`hw` with kernel_overhead = c, plain_kernel_overhead = c_plain, its memory bandwidths divided by beta (beta
    0: left as they are) and its product rates divided by gamma."""
    changes = dict(kernel_overhead=c, plain_kernel_overhead=c_plain, peak_flops=hw.peak_flops / gamma)
    if hw.bmm_flops is not None:
        changes["bmm_flops"] = hw.bmm_flops / gamma
    if beta > 0:
        changes["mem_bw"] = hw.mem_bw / beta
        if hw.cache_bw is not None:
            changes["cache_bw"] = hw.cache_bw / beta
    return hw.with_(**changes)


def overlap_rows(dev, timeit, sizes=(1 << 12, 1 << 16, 1 << 18, 1 << 20), target: float = 3e-3,
                 reps: int = 15) -> list:
    """(bytes, seconds of some compute alone, seconds of the same compute with a ring step's send and receive of
    that size in flight), medians of `reps`: does a message in flight slow the rank's compute down by its time
    (gloo moving bytes with the rank's own core) or hide behind it (`Hardware.comm_overlap`)? The repetitions go
    round the sizes (every size once, then the next round), so that a change of load tilts no size. Run on every
    rank of an initialised process group; `timeit(fn, device, min_time)` times one call."""
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    a = torch.randn(192, 192, device=dev)
    per = timeit(lambda: a @ a, dev, min_time=0.05)
    k = max(1, round(target / per))

    def work():
        for _ in range(k):
            a @ a
    bufs = [(torch.ones(size // 4, device=dev), torch.empty(size // 4, device=dev)) for size in sizes]
    alone, both = [[] for _ in sizes], [[] for _ in sizes]
    for i in range(reps + 1):
        for j, (out, into) in enumerate(bufs):
            dist.barrier()
            t0 = time.perf_counter()
            work()
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            works = [dist.isend(out, (r + 1) % n), dist.irecv(into, (r - 1) % n)]
            work()
            for w in works:
                w.wait()
            t3 = time.perf_counter()
            if i:                                                  # the first round sets up the buffers
                alone[j].append(t1 - t0)
                both[j].append(t3 - t2)
    return [(size, statistics.median(al), statistics.median(bo)) for size, al, bo in zip(sizes, alone, both)]


def fit_overlap(over, p2p_latency: float, p2p_bw: float, n: int) -> dict:
    """From `overlap_rows` (medians over the ranks) and the isolated p2p fit: dict(exposed (per size: the
    slow-down in units of the isolated message time), overlap (the median below 0.5), in_step ((latency, bw) of
    the messages inside a step, or None)). Without overlap the slow-down is the messages' cost inside a step:
    fitted as latency + X / bandwidth, or, when it does not grow with the size (a busy machine's scheduling),
    as a latency at the isolated bandwidth."""
    from parlab.cluster.calibrate.fit import fit_alpha_beta
    exposed = [(b - a) / (p2p_latency + size / p2p_bw) for size, a, b in over]
    overlap = statistics.median(exposed) < 0.5
    in_step = None
    if not overlap:
        try:
            in_step = fit_alpha_beta([(size, b - a) for size, a, b in over if b > a], n, factor=1.0)
        except (ValueError, RuntimeError):
            lat = statistics.median((b - a) - size / p2p_bw for size, a, b in over)
            in_step = (lat, p2p_bw) if lat > p2p_latency else None
    return dict(exposed=exposed, overlap=overlap, in_step=in_step)
