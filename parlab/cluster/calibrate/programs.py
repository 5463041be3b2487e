"""Calibration of communication inside a training step: what a call costs in the middle of a real step.

A collective timed alone (`parlab.cluster.calibrate`'s nccl-tests-like loop) is not what it costs inside a training step
on a CPU whose cores each run a rank: there the call hands its work to gloo's threads, which must first get a
core (and, on a virtual machine whose idle cores halt, wake one up). Here a 0.8 MB all-gather inside FSDP's
backward took 2.4-4.3 ms where the same call alone took 0.5-0.9 ms, and a ring-attention message of 256 KB
arrived 4-6 ms after it was sent (benchmarks/README.md). A single message timed inside a loop of products
(`parlab.cluster.calibrate.step.overlap_rows`) varied too much to fit this from.

So calibration runs real distributed training steps (`PROGRAMS`: DDP- and FSDP-wrapped GPTs, a 1F1B pipeline and
ring attention, of shapes that are not the benchmark's, on every rank at once), times 41 traced steps of each (the
same FSDP step took 34-67 ms here, so a median of 11 moved by a fifth between two calibrations), meters one, and
replays it on the description calibrated so far. A measured step runs from the moment its last rank began
(`parlab.cluster.replay.measured_step`), as a replay's does. What the replay misses is put on the transfers:

    comm_delay  each transfer ends that much later than the link model says (`Hardware.comm_delay`), without
                keeping a rank busy: a blocking call pays it, an asynchronous one what the compute issued after
                it does not cover;
    comm_cpu    when communication does not overlap compute (`Hardware.comm_overlap` False), each asynchronous
                call (collective or message) also takes that much of its rank's core (`Hardware.comm_cpu`):
                gloo's threads run on it.

and the group runs as many collectives at once as gloo has threads (`Hardware.comm_streams`, set before the
fit). Both numbers are fitted (`fit_step_comm`) to make the replayed steps match the measured ones: least squares
on log(replayed / measured) by a grid search, refined around its best point (the replayed step is not linear in
them). The two are told apart by the programs: FSDP's blocking calls pay the delay only, and two DDP programs of
one model with 0.25 and 0.05 MiB buckets (7 and 24 bucket all-reduces) differ by the rank's share of 17 calls.
With the delay alone, holding a single stream per group (round 4 of benchmarks/README.md), the 24-bucket
program replayed at 1.36-1.57 of its measured step; with two streams and the rank's share, the five programs
replay within 0.89-1.08 (round 5).

Messages (send / recv) get a delay and share of their own (`Hardware.p2p_delay`, `p2p_cpu`), fitted to the
pipeline and ring-attention programs with the collectives' two held: gloo runs a collective on its worker
threads and a message on its transport thread, and one pair did not fit both kinds. Fitted to DDP and FSDP alone,
a replayed 1F1B step came out 1.17-1.20 of its measured one (three runs) while ring attention came out at
0.89-0.98; one delay for every message (the share held at the collectives') put ring attention at 0.81-0.85 and
1F1B at 1.03-1.13;
a delay and a share for messages make both fit (benchmarks/README.md, round 7). benchmarks/replay.py checks
DDP, ZeRO-3, 1F1B and ring-attention steps of other shapes against the result.

Reference: vTrain (Bang et al., MICRO 2024) and Echo (2024) likewise take communication costs inside training
iterations from profiles of the running framework rather than from isolated collective benchmarks.
"""
from __future__ import annotations

import math
import statistics

from parlab.cluster.hardware import Hardware

__all__ = ["PROGRAMS", "program_label", "ring_attention_step", "traced_step", "step_traces", "merge", "fit_step_comm"]

#: the calibration programs, none of them a shape benchmarks/replay.py reports (GPT: n_embd 128, 4 layers, 4 heads,
#: 64 tokens, 8 rows, 0.25 MiB buckets; 1F1B: 2 layers and 2 micro-batches of 2 rows per stage; ring attention:
#: 4 heads of 32, 256 tokens per rank):
#:   ("ddp", (n_embd, n_layer, n_head, seq_len, rows), bucket cap in MiB), ("fsdp", (same), None),
#:   ("1f1b", (n_embd, layers per stage, n_head, seq_len, rows per micro-batch), micro-batches per stage),
#:   ("ring", (heads, head dim, tokens per rank), None): causal zigzag ring attention, forward and backward
PROGRAMS = (("ddp", (96, 3, 4, 64, 8), 0.25), ("ddp", (160, 2, 4, 48, 6), 1.0),
            ("fsdp", (112, 3, 4, 64, 6), None), ("fsdp", (144, 2, 4, 48, 8), None),
            ("ddp", (96, 3, 4, 64, 8), 0.05), ("1f1b", (96, 1, 4, 96, 2), 3), ("ring", (2, 48, 384), None))


def _program(wrapper: str, shape, extra):
    """One training step of program (`wrapper`, `shape`, `extra`) on this rank (`PROGRAMS`), on the CPU:
    calibration runs the programs on a CPU only (`parlab.cluster.calibrate.measure_rank`)."""
    import functools

    from parlab import comm
    if wrapper == "1f1b":
        return _pipeline_step(*shape, extra)
    if wrapper == "ring":
        return ring_attention_step(*shape)
    from parlab.cluster.calibrate.step import _gpt_step
    from parlab.parallel.data import DistributedDataParallel
    from parlab.parallel.zero import FullyShardedDataParallel
    wrap = (functools.partial(DistributedDataParallel, bucket_cap_mb=extra) if wrapper == "ddp"
            else FullyShardedDataParallel)
    return _gpt_step(*shape, wrap=wrap, data_seed=comm.get_rank())


def _pipeline_step(n_embd: int, per_stage: int, n_head: int, seq: int, rows: int, micro: int):
    """One 1F1B step over every rank as a stage (`per_stage` layers and `micro` micro-batches per stage)."""
    import torch

    from parlab import comm
    from parlab.parallel import pipeline as schedules
    from parlab.models import GPT, GPTConfig
    from parlab.parallel.pipeline import PipelineParallel
    p = comm.get_world_size()
    cfg = GPTConfig(vocab_size=128, seq_len=seq, n_layer=per_stage * p, n_head=n_head, n_embd=n_embd)
    pipe = PipelineParallel(GPT(cfg, seed=0), schedules.one_f_one_b(p, micro * p))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(cfg.vocab_size, (rows * micro * p, seq), generator=g, device="cpu")   # (B, S)
            for _ in range(2))

    def step():
        pipe.step(x, y)
        for prm in pipe.parameters():
            prm.grad = None
    return step


def ring_attention_step(heads: int, head_dim: int, per_rank: int):
    """Forward and backward of causal ring attention (zigzag) over every rank, `per_rank` tokens each."""
    import torch

    from parlab import comm
    from parlab.parallel.context import ring as ra
    n, r = comm.get_world_size(), comm.get_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, per_rank * n, head_dim, generator=g, device="cpu")   # (B, nh, S, hd)
                     for _ in range(4))
    qs, ks, vs = (ra.shard_sequence(t, n, r, "zigzag", dim=2).requires_grad_() for t in (q, k, v))
    ds = ra.shard_sequence(dout, n, r, "zigzag", dim=2)

    def step():
        out = ra.ring_attention(qs, ks, vs, causal=True, layout="zigzag")
        out.backward(ds)
    return step


def program_label(wrapper: str, shape: tuple, extra) -> str:
    """How the report names a program: 'ddp 96x3x4x64x8 (0.25 MiB buckets)', '1f1b 96x1x4x96x2 (3 micro-batches
    per stage)'."""
    what = {"ddp": " MiB buckets", "1f1b": " micro-batches per stage"}.get(wrapper, "")
    return f"{wrapper} {'x'.join(map(str, shape))}" + (f" ({extra:g}{what})" if extra else "")


def traced_step(step, metered: bool = False) -> list:
    """Every rank: a barrier, then `step()` in a recorder of its own (inside `count_costs()` if `metered`); its
    events."""
    from parlab import comm
    from parlab.trace import count_costs, recording
    comm.barrier()
    with recording() as rec:
        if metered:
            with count_costs():
                step()
        else:
            step()
    return list(rec.events)


def step_traces(steps: int = 41, programs=PROGRAMS, between=None) -> list[list[list]]:
    """Run on every rank of an initialised process group: for each program one step traced inside
    `count_costs()`, then `steps` traced steps, each between barriers in a recorder of its own; the timed steps
    go round the programs (one step of each, then the next round), so that a change of the machine's load
    shifts every program alike. This rank's events (`parlab.trace.Event`) of each step, the metered step last
    (merge the ranks' with `merge`). `between()`, if given, is called after each round (`measure_rank`)."""
    traced = traced_step
    made = []
    for wrapper, shape, bucket_mb in programs:
        step = _program(wrapper, shape, bucket_mb)
        step()
        step()                                                             # warm-up: buckets, AdamW's states
        made.append((step, traced(step, metered=True)))
    out = [[] for _ in made]
    for _ in range(steps):
        for (step, _), per_step in zip(made, out):
            per_step.append(traced(step))
        if between is not None:
            between()
    return [per_step + [metered] for (_, metered), per_step in zip(made, out)]


def merge(per_rank: list) -> list[tuple]:
    """(median measured step seconds (`parlab.cluster.replay.measured_step`), metered step as a `parlab.trace.Trace`) of
    each program, from every rank's `step_traces`."""
    from parlab.cluster.replay import measured_step
    from parlab.trace import Trace
    out = []
    for j in range(len(per_rank[0])):
        steps = [Trace([e for rank in per_rank for e in rank[j][i]]) for i in range(len(per_rank[0][j]))]
        out.append((statistics.median(measured_step(t) for t in steps[:-1]), steps[-1]))
    return out


def _replayed(hw: Hardware, metered) -> float:
    from parlab.cluster.replay import replay, step_time
    return step_time(replay(metered, hw))


def _error(hw: Hardware, programs) -> float:
    return sum(math.log(_replayed(hw, tr) / t) ** 2 for t, tr in programs)


def _has_messages(trace) -> bool:
    return any(e.kind == "p2p" for e in trace.events)


def _grid_fit(err, top: float, top_cpu: float, fit_cpu: bool, grid: int, rounds: int) -> tuple[float, float]:
    """(delay, share) minimising err(delay, share): a grid of `grid` delays over [0, `top`] by `grid` // 2 + 1
    shares over [0, `top_cpu`] (share 0 only, unless `fit_cpu`), refined `rounds` - 1 times around the best point
    on a 5-point grid of the neighbouring cells."""
    ds = [top * i / (grid - 1) for i in range(grid)]
    cs = [top_cpu * i / (grid // 2) for i in range(grid // 2 + 1)] if fit_cpu else [0.0]
    best = min(((err(d, c), d, c) for d in ds for c in cs))
    sd, sc = ds[1] - ds[0], (cs[1] - cs[0]) if fit_cpu else 0.0
    for _ in range(rounds - 1):                                   # refine: 5 points across the best cell's neighbours
        sd, sc = sd / 2, sc / 2
        cand = [(max(best[1] + i * sd, 0.0), max(best[2] + j * sc, 0.0)) for i in range(-2, 3)
                for j in (range(-2, 3) if fit_cpu else (0,))]
        best = min([best, *((err(d, c), d, c) for d, c in cand)])
    return best[1], best[2]


def fit_step_comm(hw: Hardware, programs, top: float = 10e-3, top_cpu: float = 3e-3, grid: int = 21,
                  rounds: int = 5) -> dict:
    """`comm_delay` (and, when `hw.comm_overlap` is False, `comm_cpu`) fitted to `programs` ((measured seconds,
    metered Trace), from `merge`) replayed on `hw` (module docstring, `_grid_fit`). When some programs send
    messages (pipeline, ring attention) and others do not, the delay and share are fitted to the others, then
    the messages' own (`p2p_delay`, `p2p_cpu`) to the message programs the same way, the first two held.
    dict(delay, cpu, p2p_delay, p2p_cpu (None: no message programs apart), before (replayed / measured per
    program without any), after (with them))."""
    fit_cpu = not hw.comm_overlap
    plain = [pr for pr in programs if not _has_messages(pr[1])]
    messages = [pr for pr in programs if _has_messages(pr[1])] if plain else []
    base = hw.with_(p2p_delay=None, p2p_cpu=None)
    delay, cpu = _grid_fit(lambda d, c: _error(base.with_(comm_delay=d, comm_cpu=c), plain or programs),
                           top, top_cpu, fit_cpu, grid, rounds)
    fitted = base.with_(comm_delay=delay, comm_cpu=cpu)
    p2p_delay = p2p_cpu = None
    if messages:
        p2p_delay, p2p_cpu = _grid_fit(lambda d, c: _error(fitted.with_(p2p_delay=d, p2p_cpu=c), messages),
                                       top, top_cpu, fit_cpu, grid, rounds)
        fitted = fitted.with_(p2p_delay=p2p_delay, p2p_cpu=p2p_cpu if fit_cpu else None)
        p2p_cpu = p2p_cpu if fit_cpu else None
    none = base.with_(comm_delay=0.0, comm_cpu=0.0)
    return dict(delay=delay, cpu=cpu, p2p_delay=p2p_delay, p2p_cpu=p2p_cpu,
                before=[_replayed(none, tr) / t for t, tr in programs],
                after=[_replayed(fitted, tr) / t for t, tr in programs])
