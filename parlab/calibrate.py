"""Calibration: measure the machine parlab runs on and write it as a `parlab.hardware.Hardware` description.

``python -m parlab.calibrate --world 2 --out here.json`` (or ``parlab calibrate ...``) measures, on every rank
at once (so each rank gets the share of the machine it has in a real run):

* compute: single matrix products of several sizes (float32 on a CPU, bf16 on a GPU) and elementwise adds and
  copies from cache-sized to memory-sized (12 B .. 100 MB of working set on a CPU), each timed, their work
  counted by the replay's own meter; then a least-squares fit (on relative error) of the replay's compute model
  t = FLOPs / F + cached bytes / B_cache + other bytes / B + c per kernel gives the sustained FLOP/s F, the
  bandwidths of the cache level and of memory with the working-set size that separates them, and the per-kernel
  cost c (on a CPU, c is mostly framework overhead per op; `fit_compute` keeps one bandwidth when two do not fit
  clearly better);
* special functions: exp, GeLU and logsumexp of a few sizes; what their bytes and kernel do not explain, per
  result, is `special_rate` (`parlab.calibrate_special`);
* training steps (CPU): forward, backward and AdamW steps of small GPTs of a few shapes, metered and timed;
  with the products' rates kept, the per-op cost and a factor on the memory time are refitted to them
  (`parlab.calibrate_step`): a single op in a loop does not pay what an op inside autograd does;
* overlap (CPU): the same compute timed alone and with a ring step's send and receive in flight; when the
  messages slow it by half their own time or more, gloo is moving them with the ranks' cores and the
  description says `comm_overlap` False (the replay then charges asynchronous calls to their rank); without the
  training-step programs below, the p2p latency and bandwidth are refitted to what the messages slowed the compute
  by (their cost inside a step);
* communication inside training steps (CPU): DDP- and FSDP-wrapped GPT steps run on every rank, timed and
  replayed; `comm_delay`, how much later a transfer ends inside a step than alone, and (without overlap)
  `comm_cpu`, how much of its rank's core an asynchronous call takes, are fitted to make the replays match
  (`parlab.calibrate_comm`), with `comm_streams` read from gloo's pool of threads;
* point to point: every rank sends to the next and receives from the previous at once (isend / irecv, as a ring
  step does), over the same sizes; fitted the same way (t = latency + X / B) into `p2p_latency`, `p2p_bw`;
* collectives, like nccl-tests: all-reduce over message sizes 4 B .. 16 MiB, median time per size, algorithm
  bandwidth X / t and bus bandwidth 2 (N-1)/N X / t (nccl-tests PERFORMANCE.md), then a least-squares fit of
  t = alpha + 2 (N-1)/N X / B: B is the link bandwidth, alpha / (2 (N-1)) the latency per ring step.

On a CPU it runs `world` gloo ranks with `parlab.run`; on GPUs start it with ``torchrun --nproc-per-node 8 -m
parlab.calibrate`` and it measures NCCL between the node's GPUs (the inter-node link is taken equal to the
intra-node one unless the job spans nodes: then the all-reduce runs over one rank per node as well).
`Hardware.efficiency` is 1 here: the measured throughput already is what the products sustain.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from . import comm
from .hardware import Hardware

__all__ = ["measure_rank", "fit_alpha_beta", "fit_roofline", "fit_compute", "calibrate", "main", "SIZES",
           "default_world"]

SIZES = [4 * 4 ** k for k in range(0, 12)]       # 4 B .. 16 MiB


def default_world() -> int:
    """Gloo ranks to calibrate with by default: one per core, 2 to 4. More ranks than cores would measure the
    operating system handing the cores around (a rank woken by a message waits for a core) on every message."""
    return max(2, min(4, os.cpu_count() or 2))


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


def _fit_rates(samples, ncols: int) -> tuple[float, dict[int, float]]:
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
        raise ValueError("could not fit the compute model to the measurements; rerun on a quieter machine")
    return best


def _inv(c: dict, j: int) -> float:
    return 1 / c[j] if c.get(j, 0) > 0 else 1e30                # a term the fit dropped: free


def fit_roofline(samples) -> tuple[float, float, float]:
    """(FLOP/s, bytes/s, seconds per kernel) fitting t = flops / F + bytes / B + kernels x c to (flops, bytes,
    kernels, t) samples, least squares on relative error, every coefficient >= 0 (the best of the subsets)."""
    _, c = _fit_rates(samples, 3)
    return _inv(c, 0), _inv(c, 1), c.get(2, 0.0)


def fit_compute(samples, min_gain: float = 0.8, min_speedup: float = 1.25) -> dict:
    """The compute model of `parlab.hardware` (module docstring) fitted to (flops, bytes, kernels, t, working
    set[, batched flops]) samples. One level: t = (flops - F_b) / F + F_b / F_bmm + bytes / B + kernels x c.
    Two levels: for each candidate cache size C (a power of two between the samples' working sets, with at
    least two memory-bound samples on each side) the bytes split into cached ones (size class k with
    2^(k+1) <= C, at B_cache) and the others (at B). The best C is kept when it fits clearly better than one
    bandwidth (relative squared error below `min_gain` x the one-level fit's) with B_cache > `min_speedup` x B;
    otherwise the one-level fit, cache_bw None. bmm_flops is None when no sample has batched FLOPs.
    Returns dict(peak_flops, bmm_flops, mem_bw, kernel_overhead, cache_bw, cache_bytes)."""
    from .hardware import size_class

    def parts(s):
        f, b, k, t, ws = s[:5]
        fb = s[5] if len(s) > 5 else 0.0
        return f - fb, fb, b, k, t, ws

    rows1 = [(f, fb, b, k, t) for f, fb, b, k, t, _ in map(parts, samples)]
    err1, c1 = _fit_rates(rows1, 4)
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
        err, c = _fit_rates(rows, 5)
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
    from .replay_meter import CostMeter
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


def measure_rank(device: str = "cpu", sizes=SIZES, reps: int = 5, min_time: float = 0.2, steps: bool = True,
                 between=None) -> dict:
    """Run on every rank (inside an initialised process group): this rank's measurements. `steps` (CPU only):
    also time training steps of small GPTs for the per-op cost inside a step (`parlab.calibrate_step`) and
    training steps with communication (`parlab.calibrate_comm`). `between()`, if given, is called on every rank
    after each round of those timed steps (50 calls with the defaults; a collective call inside it is fine, every
    rank calls it at the same point): benchmarks/replay.py times the workloads it checks there, so that the
    calibration and the measurement it is checked against see the machine in the same minute."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    samples = _compute_samples(dev, dtype, gpu, min_time)
    from .calibrate_special import special_samples
    special = special_samples(dev, dtype, _timeit, min_time / 2, gpu, barrier=comm.barrier)
    step_rows = []
    if steps and not gpu:
        from .calibrate_step import step_samples
        step_rows = step_samples(barrier=dist.barrier, between=between)
    # collectives: all-reduce over message sizes, median of `reps` timed calls each
    rows = []
    for size in sizes:
        buf = torch.ones(max(size // 4, 1), device=dev)
        dist.all_reduce(buf)                                    # warm-up (connections, buffers)
        times = []
        for _ in range(reps):
            dist.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        rows.append((size, statistics.median(times)))
    # point to point: every rank sends to the next and receives from the previous at once (a ring step)
    n, r = dist.get_world_size(), dist.get_rank()
    p2p = []
    for size in sizes:
        out, into = torch.ones(max(size // 4, 1), device=dev), torch.empty(max(size // 4, 1), device=dev)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            works = [dist.isend(out, (r + 1) % n), dist.irecv(into, (r - 1) % n)]
            for w in works:
                w.wait()
            _sync(dev)
            if i:                                                  # the first one sets up the connection
                times.append(time.perf_counter() - t0)
        p2p.append((size, statistics.median(times)))
    overlap, programs = [], []
    if steps and not gpu:
        from .calibrate_comm import PROGRAMS, program_label, step_traces
        from .calibrate_step import overlap_rows
        overlap = overlap_rows(dev, _timeit, reps=3 * reps)     # noisier than the isolated calls: 3x the repetitions
        programs = step_traces(programs=PROGRAMS, between=between)
        labels = [program_label(*p) for p in PROGRAMS]
    return {"allreduce": rows, "p2p": p2p, "samples": samples, "steps": step_rows, "overlap": overlap,
            "special": special, "programs": programs, "program_labels": labels if programs else [],
            "comm_streams": 1 if gpu else _gloo_threads()}


def _gloo_threads() -> int:
    """How many collectives of one group gloo runs at once: the worker threads of torch's ProcessGroupGloo, 2 unless
    its options say otherwise (`Hardware.comm_streams`)."""
    try:
        return int(dist.ProcessGroupGloo._Options()._threads)
    except (AttributeError, TypeError, ValueError):           # a torch without gloo, or another layout of options
        return 2


def fit_alpha_beta(rows, n: int, factor: float | None = None) -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) of t = alpha + factor X / B over (X, t) rows, least squares on relative
    error with alpha, 1/B >= 0 (the sizes span six orders of magnitude: on absolute error the largest messages
    alone would set alpha, and their noise with it); factor defaults to the ring all-reduce's 2 (n-1)/n."""
    if n < 2:
        raise ValueError("fitting a link needs at least 2 ranks: pass --world 2 or more")
    factor = 2 * (n - 1) / n if factor is None else factor
    _, c = _fit_rates([(1.0, factor * size, t) for size, t in rows], 2)
    if not c.get(1, 0) > 0:
        raise ValueError("all-reduce time does not grow with message size in these measurements; "
                         "the machine is too noisy: rerun with larger --sizes or more --reps")
    return c.get(0, 0.0), 1.0 / c[1]


def describe(per_rank: list[dict], n: int, name: str) -> tuple[Hardware, str]:
    """The hardware description (slowest rank's rates) and an nccl-tests-like table."""
    # each size's median over the ranks (they ran it together; the median resists one rank's stall)
    rows = [(size, statistics.median(r["allreduce"][i][1] for r in per_rank))
            for i, (size, _) in enumerate(per_rank[0]["allreduce"])]
    alpha, bw = fit_alpha_beta(rows, n)
    hop = alpha / (2 * (n - 1))
    p2p_rows = [(size, statistics.median(r["p2p"][i][1] for r in per_rank))
                for i, (size, _) in enumerate(per_rank[0]["p2p"])]
    p2p_lat, p2p_bw = fit_alpha_beta(p2p_rows, n, factor=1.0)
    # the compute model is fitted to each sample's median time over the ranks (all ran it at once)
    pooled = [(*s[:3], statistics.median(r["samples"][i][3] for r in per_rank), *s[4:])
              for i, s in enumerate(per_rank[0]["samples"])]
    fit = fit_compute(pooled)
    hw = Hardware(name=name, peak_flops=fit["peak_flops"], mem_bw=fit["mem_bw"],
                  intra_bw=bw, inter_bw=bw, gpus_per_node=n, efficiency=1.0, mem_efficiency=1.0,
                  kernel_overhead=fit["kernel_overhead"], base_latency=0.0, cache_bw=fit["cache_bw"],
                  bmm_flops=fit["bmm_flops"],
                  cache_bytes=fit["cache_bytes"],
                  intra_latency=hop, inter_latency=hop, p2p_bw=p2p_bw, p2p_latency=p2p_lat,
                  source=f"parlab.calibrate on {n} ranks, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    special = [(*s[:4], statistics.median(r["special"][i][4] for r in per_rank))
               for i, s in enumerate(per_rank[0].get("special") or ())]
    if special:                                                 # exp, log, erf beyond their bytes
        from .calibrate_special import fit_special_rate
        hw = hw.with_(special_rate=fit_special_rate(hw, special))
    single = hw
    steps = [(*s[:3], statistics.median(r["steps"][i][3] for r in per_rank), *s[4:])
             for i, s in enumerate(per_rank[0].get("steps") or ())]
    if steps:                                                   # the per-op cost inside a training step
        from .calibrate_step import apply_step_fit, fit_step
        sf = fit_step(hw, steps)
        hw = apply_step_fit(hw, sf["c"], sf["beta"], sf["gamma"], sf["c_plain"])
        hw = hw.with_(source=hw.source + f"; per-op costs and memory fitted to {len(steps)} parts of training steps "
                      f"(parlab.calibrate_step)")
    over = [(size, statistics.median(r["overlap"][i][1] for r in per_rank),
             statistics.median(r["overlap"][i][2] for r in per_rank))
            for i, (size, _, _) in enumerate(per_rank[0].get("overlap") or ())]
    if over:                                                    # does a message in flight take the core?
        from .calibrate_step import fit_overlap
        overlap_fit = fit_overlap(over, p2p_lat, p2p_bw, n)
        hw = hw.with_(comm_overlap=overlap_fit["overlap"])
    programs = per_rank[0].get("programs")
    if over and overlap_fit["in_step"] and not programs:        # without training-step programs: the probe's cost
        hw = hw.with_(p2p_latency=overlap_fit["in_step"][0], p2p_bw=overlap_fit["in_step"][1])
    step_comm = None
    if programs:                                                # what a transfer costs inside a training step
        from .calibrate_comm import fit_step_comm, merge
        merged = merge([r["programs"] for r in per_rank])
        hw = hw.with_(comm_streams=per_rank[0].get("comm_streams", 1))
        step_comm = fit_step_comm(hw, merged)
        step_comm["labels"] = per_rank[0].get("program_labels") or [f"program {i}" for i in range(len(merged))]
        hw = hw.with_(comm_delay=step_comm["delay"], comm_cpu=step_comm["cpu"], p2p_delay=step_comm["p2p_delay"],
                      p2p_cpu=step_comm["p2p_cpu"],
                      source=hw.source + f"; communication inside a step fitted to {len(merged)} DDP, FSDP, "
                      f"pipeline and ring-attention training steps (parlab.calibrate_comm)")
    from .calibrate_report import report
    return hw, report(n, hw, single, rows=rows, alpha=alpha, bw=bw, p2p_rows=p2p_rows, p2p_lat=p2p_lat,
                      p2p_bw=p2p_bw, over=over, overlap_fit=overlap_fit if over else None, programs=bool(programs),
                      step_comm=step_comm, pooled=pooled, steps=steps, step_fit=sf if steps else None)


def _rank_main(sizes, reps, min_time, steps=True) -> dict:
    return measure_rank("cpu", sizes=sizes, reps=reps, min_time=min_time, steps=steps)


def calibrate(world: int | None = None, sizes=SIZES, reps: int = 5, min_time: float = 0.2, name: str | None = None,
              steps: bool = True):
    """On this CPU: `world` gloo ranks (default `default_world()`) measure it together. Returns (Hardware, report
    text). Replay a run on the description calibrated with as many ranks as the run had. `steps`: fit the per-op
    cost and the memory time to training steps (`parlab.calibrate_step`); False: the single-op fit only."""
    import parlab
    world = default_world() if world is None else world
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world must be an integer >= 2 (ranks measured together), got {world!r}")
    res = parlab.run(_rank_main, world, list(sizes), reps, min_time, steps, backend="gloo", echo=False, timeout=600)
    return describe(res.results, world, name or f"this machine ({world} gloo ranks)")


def _bad_args(a, sizes) -> str | None:
    """What is wrong with `parlab calibrate`'s arguments, and how to fix it (None: nothing)."""
    if a.reps < 1:
        return f"--reps must be at least 1 (timed calls per message size), got {a.reps}"
    if len(sizes) < 2:
        return (f"--max-size {a.max_size} leaves {len(sizes)} message size(s) to measure; a latency and a bandwidth "
                f"need two: give at least {SIZES[1]} (bytes)")
    out = os.path.abspath(a.out)
    if os.path.isdir(out):
        return f"--out {a.out} is a folder; give a file name, e.g. {os.path.join(a.out, 'hardware.json')}"
    folder = os.path.dirname(out)
    if not os.path.isdir(folder):
        return f"--out {a.out}: the folder {folder} does not exist; create it first"
    if not os.access(folder, os.W_OK):
        return f"--out {a.out}: the folder {folder} is not writable; choose another place"
    return None


def main(argv=None) -> int:
    """``parlab calibrate``: measure this machine (or, under torchrun, its GPUs) and write a Hardware JSON."""
    p = argparse.ArgumentParser(prog="parlab calibrate", description="measure collectives and matmul throughput "
                                "and write a hardware description for parlab.replay")
    p.add_argument("--world", type=int, default=default_world(),
                   help="gloo ranks on this CPU (default: one per core, 2 to 4; ignored under torchrun)")
    p.add_argument("--out", default="hardware.json", help="where to write the description (JSON)")
    p.add_argument("--name", default=None, help="name of the description (default: says what was measured)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per message size")
    p.add_argument("--max-size", type=int, default=SIZES[-1], help="largest all-reduce in bytes")
    a = p.parse_args(argv)
    sizes = [s for s in SIZES if s <= a.max_size]
    problem = _bad_args(a, sizes)
    if problem:                                           # before minutes of measuring, not after
        print(f"error: {problem}")
        return 2
    try:
        if "LOCAL_RANK" in os.environ:                    # under torchrun: NCCL and the GPUs
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            device = f"cuda:{int(os.environ['LOCAL_RANK'])}" if torch.cuda.is_available() else "cpu"
            if device != "cpu":
                torch.cuda.set_device(device)
            mine = measure_rank(device, sizes=sizes, reps=a.reps)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            n = dist.get_world_size()
            if dist.get_rank() == 0:
                gpu = torch.cuda.get_device_name() if device != "cpu" else "cpu"
                hw, text = describe(every, n, a.name or f"{n} x {gpu} (measured)")
                hw.save(a.out)
                print(text)
                print(f"wrote {a.out}")
            dist.destroy_process_group()
            return 0
        hw, text = calibrate(a.world, sizes, a.reps, name=a.name)
    except ValueError as err:
        print(f"error: {err}")
        return 2
    hw.save(a.out)
    print(text)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
