"""Calibration: measure the machine parlab runs on and write it as a `parlab.cluster.hardware.Hardware` description.

``python -m parlab.cluster.calibrate --world 2 --out here.json`` (or ``parlab calibrate ...``) measures, on every rank
at once (so each rank gets the share of the machine it has in a real run):

* compute: single matrix products of several sizes (float32 on a CPU, bf16 on a GPU) and elementwise adds and
  copies from cache-sized to memory-sized (12 B .. 100 MB of working set on a CPU), each timed, their work
  counted by the replay's own meter; then a least-squares fit (on relative error) of the replay's compute model
  t = FLOPs / F + cached bytes / B_cache + other bytes / B + c per kernel gives the sustained FLOP/s F, the
  bandwidths of the cache level and of memory with the working-set size that separates them, and the per-kernel
  cost c (on a CPU, c is mostly framework overhead per op; `fit_compute` keeps one bandwidth when two do not fit
  clearly better; both in `parlab.cluster.calibrate.compute`);
* special functions: exp, GeLU and logsumexp of a few sizes; what their bytes and kernel do not explain, per
  result, is `special_rate` (`parlab.cluster.calibrate.special`);
* training steps (CPU): forward, backward and AdamW steps of small GPTs of a few shapes, metered and timed;
  with the products' rates kept, the per-op cost and a factor on the memory time are refitted to them
  (`parlab.cluster.calibrate.step`): a single op in a loop does not pay what an op inside autograd does;
* overlap (CPU): the same compute timed alone and with a ring step's send and receive in flight; when the
  messages slow it by half their own time or more, gloo is moving them with the ranks' cores and the
  description says `comm_overlap` False (the replay then charges asynchronous calls to their rank); without the
  training-step programs below, the p2p latency and bandwidth are refitted to what the messages slowed the compute
  by (their cost inside a step);
* communication inside training steps (CPU): DDP- and FSDP-wrapped GPT steps run on every rank, timed and
  replayed; `comm_delay`, how much later a transfer ends inside a step than alone, and (without overlap)
  `comm_cpu`, how much of its rank's core an asynchronous call takes, are fitted to make the replays match
  (`parlab.cluster.calibrate.programs`), with `comm_streams` read from gloo's pool of threads;
* point to point: every rank sends to the next and receives from the previous at once (isend / irecv, as a ring
  step does), over the same sizes; fitted the same way (t = latency + X / B) into `p2p_latency`, `p2p_bw`;
* collectives, like nccl-tests: all-reduce over message sizes 4 B .. 16 MiB, median time per size, algorithm
  bandwidth X / t and bus bandwidth 2 (N-1)/N X / t (nccl-tests PERFORMANCE.md), then a least-squares fit of
  t = alpha + 2 (N-1)/N X / B: B is the link bandwidth, alpha / (2 (N-1)) the latency per ring step.

On a CPU it runs `world` gloo ranks with `parlab.run` (one torch thread each, as `parlab.run` gives its ranks); on
GPUs start it with ``torchrun --nproc-per-node 8 -m parlab.cluster.calibrate`` and it measures NCCL between the job's
GPUs. The description has one link: `intra_bw` = `inter_bw` = the bandwidth fitted to the world group's all-reduce.
In a job on one node that is the node's link (NVLink); in a job across nodes the ring crosses them, so it is the
slower, inter-node one (calibrate one node alone for the other and put both in the JSON). Under torchrun on CPUs
each rank keeps torch's default threads (every core) unless OMP_NUM_THREADS says otherwise; the description's
`source` records the count, since a CPU's rates depend on it (benchmarks/README.md, round 8: 2 ranks sharing 2
cores with 2 threads each measured a third of the FLOP/s of 2 ranks with one thread each).
`Hardware.efficiency` is 1 here: the measured throughput already is what the products sustain.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from parlab.i18n.args import ArgumentParser
from parlab.i18n.catalogue import _
from parlab import comm
from parlab.cluster.calibrate.compute import _compute_samples, _sync, _timeit, fit_compute, fit_roofline
from parlab.cluster.calibrate.fit import fit_alpha_beta
from parlab.cluster.hardware import Hardware
from parlab.launch.torchrun import slurm_ranks, init
from parlab.trace.wire import ring_steps

__all__ = ["measure_rank", "calibrate", "describe", "main", "SIZES", "default_world"]

SIZES = [4 * 4 ** k for k in range(0, 12)]       # 4 B .. 16 MiB


def default_world() -> int:
    """Gloo ranks to calibrate with by default: one per core, 2 to 4. More ranks than cores would measure the
    operating system handing the cores around (a rank woken by a message waits for a core) on every message."""
    return max(2, min(4, os.cpu_count() or 2))


def measure_rank(device: str = "cpu", sizes=SIZES, reps: int = 5, min_time: float = 0.2, steps: bool = True,
                 between=None) -> dict:
    """Run on every rank (inside an initialised process group): this rank's measurements. `steps` (CPU only):
    also time training steps of small GPTs for the per-op cost inside a step (`parlab.cluster.calibrate.step`) and
    training steps with communication (`parlab.cluster.calibrate.programs`). `between()`, if given, is called on every rank
    after each round of those timed steps (50 calls with the defaults; a collective call inside it is fine, every
    rank calls it at the same point): benchmarks/replay.py times the workloads it checks there, so that the
    calibration and the measurement it is checked against see the machine in the same minute."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    samples = _compute_samples(dev, dtype, gpu, min_time)
    from parlab.cluster.calibrate.special import special_samples
    special = special_samples(dev, dtype, _timeit, min_time / 2, gpu, barrier=comm.barrier)
    step_rows = []
    if steps and not gpu:
        from parlab.cluster.calibrate.step import step_samples
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
        from parlab.cluster.calibrate.programs import PROGRAMS, program_label, step_traces
        from parlab.cluster.calibrate.step import overlap_rows
        overlap = overlap_rows(dev, _timeit, reps=3 * reps)     # noisier than the isolated calls: 3x the repetitions
        programs = step_traces(programs=PROGRAMS, between=between)
        labels = [program_label(*p) for p in PROGRAMS]
    return {"allreduce": rows, "p2p": p2p, "samples": samples, "steps": step_rows, "overlap": overlap,
            "special": special, "programs": programs, "program_labels": labels if programs else [],
            "comm_streams": 1 if gpu else _gloo_threads(), "threads": torch.get_num_threads()}


def _gloo_threads() -> int:
    """How many collectives of one group gloo runs at once: the worker threads of torch's ProcessGroupGloo, 2 unless
    its options say otherwise (`Hardware.comm_streams`)."""
    try:
        return int(dist.ProcessGroupGloo._Options()._threads)
    except (AttributeError, TypeError, ValueError):           # a torch without gloo, or another layout of options
        return 2


def _threads(per_rank: list[dict]) -> str:
    """' (T torch thread(s) each)' as the ranks reported it: a CPU's rates depend on it (`parlab.run` gives each
    forked rank one; torchrun leaves torch's default, every core, unless OMP_NUM_THREADS says otherwise)."""
    ts = sorted({r["threads"] for r in per_rank if "threads" in r})
    return f" ({'/'.join(map(str, ts))} torch thread{'s' if ts != [1] else ''} each)" if ts else ""


def describe(per_rank: list[dict], n: int, name: str) -> tuple[Hardware, str]:
    """The hardware description (slowest rank's rates) and an nccl-tests-like table."""
    # each size's median over the ranks (they ran it together; the median resists one rank's stall)
    rows = [(size, statistics.median(r["allreduce"][i][1] for r in per_rank))
            for i, (size, _) in enumerate(per_rank[0]["allreduce"])]
    alpha, bw = fit_alpha_beta(rows, n)
    hop = alpha / ring_steps("all_reduce", n)
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
                  source=f"parlab.cluster.calibrate on {n} ranks{_threads(per_rank)}, "
                         f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    special = [(*s[:4], statistics.median(r["special"][i][4] for r in per_rank))
               for i, s in enumerate(per_rank[0].get("special") or ())]
    if special:                                                 # exp, log, erf beyond their bytes
        from parlab.cluster.calibrate.special import fit_special_rate
        hw = hw.with_(special_rate=fit_special_rate(hw, special))
    single = hw
    steps = [(*s[:3], statistics.median(r["steps"][i][3] for r in per_rank), *s[4:])
             for i, s in enumerate(per_rank[0].get("steps") or ())]
    if steps:                                                   # the per-op cost inside a training step
        from parlab.cluster.calibrate.step import apply_step_fit, fit_step
        sf = fit_step(hw, steps)
        hw = apply_step_fit(hw, sf["c"], sf["beta"], sf["gamma"], sf["c_plain"])
        hw = hw.with_(source=hw.source + f"; per-op costs and memory fitted to {len(steps)} parts of training steps "
                      f"(parlab.cluster.calibrate.step)")
    over = [(size, statistics.median(r["overlap"][i][1] for r in per_rank),
             statistics.median(r["overlap"][i][2] for r in per_rank))
            for i, (size, _, _) in enumerate(per_rank[0].get("overlap") or ())]
    if over:                                                    # does a message in flight take the core?
        from parlab.cluster.calibrate.step import fit_overlap
        overlap_fit = fit_overlap(over, p2p_lat, p2p_bw, n)
        hw = hw.with_(comm_overlap=overlap_fit["overlap"])
    programs = per_rank[0].get("programs")
    if over and overlap_fit["in_step"] and not programs:        # without training-step programs: the probe's cost
        hw = hw.with_(p2p_latency=overlap_fit["in_step"][0], p2p_bw=overlap_fit["in_step"][1])
    step_comm = None
    if programs:                                                # what a transfer costs inside a training step
        from parlab.cluster.calibrate.programs import fit_step_comm, merge
        merged = merge([r["programs"] for r in per_rank])
        hw = hw.with_(comm_streams=per_rank[0].get("comm_streams", 1))
        step_comm = fit_step_comm(hw, merged)
        step_comm["labels"] = per_rank[0].get("program_labels") or [f"program {i}" for i in range(len(merged))]
        hw = hw.with_(comm_delay=step_comm["delay"], comm_cpu=step_comm["cpu"], p2p_delay=step_comm["p2p_delay"],
                      p2p_cpu=step_comm["p2p_cpu"],
                      source=hw.source + f"; communication inside a step fitted to {len(merged)} DDP, FSDP, "
                      f"pipeline and ring-attention training steps (parlab.cluster.calibrate.programs)")
    from parlab.cluster.calibrate.report import report
    return hw, report(n, hw, single, rows=rows, alpha=alpha, bw=bw, p2p_rows=p2p_rows, p2p_lat=p2p_lat,
                      p2p_bw=p2p_bw, over=over, overlap_fit=overlap_fit if over else None, programs=bool(programs),
                      step_comm=step_comm, pooled=pooled, steps=steps, step_fit=sf if steps else None)


def _rank_main(sizes, reps, min_time, steps=True) -> dict:
    return measure_rank("cpu", sizes=sizes, reps=reps, min_time=min_time, steps=steps)


def calibrate(world: int | None = None, sizes=SIZES, reps: int = 5, min_time: float = 0.2, name: str | None = None,
              steps: bool = True):
    """On this CPU: `world` gloo ranks (default `default_world()`) measure it together. Returns (Hardware, report
    text). Replay a run on the description calibrated with as many ranks as the run had. `steps`: fit the per-op
    cost and the memory time to training steps (`parlab.cluster.calibrate.step`); False: the single-op fit only."""
    import parlab
    world = default_world() if world is None else world
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(_("world must be an integer >= 2 (ranks measured together), got {world}").format(
            world=repr(world)))
    res = parlab.run(_rank_main, world, list(sizes), reps, min_time, steps, backend="gloo", echo=False, timeout=600)
    return describe(res.results, world, name or f"this machine ({world} gloo ranks)")


def _bad_args(a, sizes) -> str | None:
    """What is wrong with `parlab calibrate`'s arguments, and how to fix it (None: nothing)."""
    if a.reps < 1:
        return _("--reps must be at least 1 (timed calls per message size), got {reps}").format(reps=a.reps)
    if a.min_time is not None and not 0 < a.min_time < float("inf"):
        return _("--min-time must be a positive number of seconds (each op timed for at least that), "
                 "got {seconds}").format(seconds=a.min_time)
    if len(sizes) < 2:
        return _("--max-size {max_size} leaves {n} message size(s) to measure; a latency and a bandwidth need two: "
                 "give at least {least} (bytes)").format(max_size=a.max_size, n=len(sizes), least=SIZES[1])
    out = os.path.abspath(a.out)
    if os.path.isdir(out):
        return _("--out {out} is a folder; give a file name, e.g. {example}").format(
            out=a.out, example=os.path.join(a.out, "hardware.json"))
    if os.path.exists(out):                               # replaced in place: the file itself must be writable
        return None if os.access(out, os.W_OK) else _(
            "--out {out} exists and is not writable; choose another name").format(out=a.out)
    folder = os.path.dirname(out)
    if not os.path.isdir(folder):
        return _("--out {out}: the folder {folder} does not exist; create it first").format(out=a.out, folder=folder)
    if not os.access(folder, os.W_OK):
        return _("--out {out}: the folder {folder} is not writable; choose another place").format(
            out=a.out, folder=folder)
    return None


def main(argv=None) -> int:
    """``parlab calibrate``: measure this machine (or, under torchrun, its GPUs) and write a Hardware JSON."""
    p = ArgumentParser(prog="parlab calibrate", description=_("measure collectives and matmul throughput and write "
                                                               "a hardware description for parlab.cluster.replay"))
    p.add_argument("--world", type=int, default=default_world(),
                   help=_("gloo ranks on this CPU (default: one per core, 2 to 4; ignored under torchrun)"))
    p.add_argument("--out", default="hardware.json", help=_("where to write the description (JSON)"))
    p.add_argument("--name", default=None, help=_("name of the description (default: says what was measured)"))
    p.add_argument("--reps", type=int, default=5, help=_("timed calls per message size"))
    p.add_argument("--max-size", type=int, default=SIZES[-1], help=_("largest all-reduce in bytes"))
    p.add_argument("--quick", action="store_true",
                   help=_("a rough description in seconds: each op timed for 0.05 s instead of 0.2 s, and no "
                          "training steps timed (a minute or more on a CPU; their fit brings replays of CPU runs "
                          "closer to what was measured)"))
    p.add_argument("--min-time", type=float, default=None,
                   help=_("seconds each op is timed for, in each of its three rounds (default 0.2, with --quick "
                          "0.05); shorter is rougher"))
    a = p.parse_args(argv)
    sizes = [s for s in SIZES if s <= a.max_size]
    problem = _bad_args(a, sizes)
    min_time = a.min_time or (0.05 if a.quick else 0.2)   # seconds each op is timed for
    if problem:                                           # before minutes of measuring, not after
        print(_("error: {problem}").format(problem=problem))
        return 2
    try:
        if "LOCAL_RANK" in os.environ or slurm_ranks(os.environ) is not None:
            # under torchrun or srun: this process is one rank (NCCL and its GPU where there are GPUs); the ranks
            # measure together and rank 0 alone writes (srun -n 2 once ran two calibrations into one file)
            ctx = init()
            device = str(ctx.device)
            mine = measure_rank(device, sizes=sizes, reps=a.reps, steps=not a.quick, min_time=min_time)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            n = dist.get_world_size()
            if dist.get_rank() == 0:
                gpu = torch.cuda.get_device_name() if device != "cpu" else "cpu"
                hw, text = describe(every, n, a.name or f"{n} x {gpu} (measured)")
                hw.save(a.out)
                print(text)
                print(_("wrote {path}").format(path=a.out))
            # no destroy_process_group() here: init()'s exit handler leaves the group in step with the other ranks
            # (destroyed at once, task 1 aborted in C++ while rank 0 was still writing: 1 srun run in 4)
            return 0
        hw, text = calibrate(a.world, sizes, a.reps, min_time=min_time, name=a.name, steps=not a.quick)
    except ValueError as err:
        print(_("error: {problem}").format(problem=err))
        return 2
    hw.save(a.out)
    print(text)
    print(_("wrote {path}").format(path=a.out))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
