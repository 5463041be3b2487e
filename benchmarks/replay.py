"""Benchmark: does the replay (`parlab.replay`) reproduce what this machine measured? And how fast is it?

    python benchmarks/replay.py [--world 4] [--steps 5] [--hardware here.json]

1. Calibrate this machine (`parlab.calibrate`, `world` gloo ranks measured together), unless a description
   is given.
2. For each workload (DDP, ZeRO-3, 1F1B, ring attention) on `world` ranks: time `steps` traced steps without the
   cost meter (each step between barriers, in its own recorder; step time = first event start to last event
   end over all ranks), then trace one more step inside `count_costs()` and replay it on the calibrated
   description. Report the median measured step, the replayed step and their ratio.
3. Replay a 16-rank trace (1F1B, pp = 4, dp = 4) on DGX H100 and report how long the replay itself takes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import parlab  # noqa: E402
from parlab import comm, schedules as sch  # noqa: E402
from parlab import ring_attention as ra  # noqa: E402
from parlab.calibrate import calibrate  # noqa: E402
from parlab.data_parallel import DistributedDataParallel  # noqa: E402
from parlab.fsdp import FullyShardedDataParallel  # noqa: E402
from parlab.groups import build_groups  # noqa: E402
from parlab.hardware import load, preset  # noqa: E402
from parlab.models import GPT, GPTConfig  # noqa: E402
from parlab.pipeline_parallel import PipelineParallel  # noqa: E402
from parlab.replay import replay, step_time, timed  # noqa: E402
from parlab.topology import ParallelGrid  # noqa: E402
from parlab.trace import Event, Trace, count_costs, recording, region  # noqa: E402

CFG = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_embd=128)
ROWS = 8          # sequences per rank (per replica)


def _batch(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(CFG.vocab_size, (rows, CFG.seq_len), generator=g),   # (B, S)
            torch.randint(CFG.vocab_size, (rows, CFG.seq_len), generator=g))


def _steps(make_step, steps):
    """On every rank: `steps` plain traced steps, then one metered; events of each step as dicts."""
    step = make_step()
    step()                                                   # warm-up, untraced
    out = []
    for i in range(steps + 1):
        comm.barrier()
        with recording() as rec:
            if i == steps:
                with count_costs():
                    step()
            else:
                step()
        out.append([dataclasses.asdict(e) for e in rec.events])
    return out


def ddp():
    model = DistributedDataParallel(GPT(CFG, seed=0), bucket_cap_mb=0.25)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(ROWS, comm.get_rank())

    def step():
        _, loss = model(x, y)
        loss.backward()
        with region("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def zero3():
    model = FullyShardedDataParallel(GPT(CFG, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _batch(ROWS, comm.get_rank())

    def step():
        with region("forward"):
            _, loss = model(x, y)
        with region("backward"):
            loss.backward()
        with region("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def one_f_one_b():
    p = comm.get_world_size()
    pipe = PipelineParallel(GPT(GPTConfig(**{**CFG.__dict__, "n_layer": 2 * p}), seed=0), sch.one_f_one_b(p, 2 * p))
    x, y = _batch(2 * p * 2)

    def step():
        pipe.step(x, y)
        for prm in pipe.parameters():
            prm.grad = None
    return step


def ring():
    P, r = comm.get_world_size(), comm.get_rank()
    B, NH, S, HD = 1, 4, 256 * P, 32
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, NH, S, HD, generator=g) for _ in range(4))    # (B, nh, S, hd)
    qs, ks, vs = (ra.shard_sequence(t, P, r, "zigzag", dim=2).requires_grad_() for t in (q, k, v))
    ds = ra.shard_sequence(dout, P, r, "zigzag", dim=2)

    def step():
        out = ra.ring_attention(qs, ks, vs, causal=True, layout="zigzag")
        out.backward(ds)
    return step


WORKLOADS = {"DDP": ddp, "ZeRO-3": zero3, "1F1B": one_f_one_b, "ring attention": ring}


def _trace(dicts):
    return Trace([Event(**{**d, "group": tuple(d["group"])}) for d in dicts])


def self_consistency(hw, world, steps):
    rows = []
    for name, make in WORKLOADS.items():
        res = parlab.run(_steps, world, make, steps, backend="gloo", echo=False, timeout=600)
        per_step = [_trace([d for rank in res.results for d in rank[i]]) for i in range(steps + 1)]
        measured = statistics.median(step_time(t) for t in per_step[:steps])
        metered = per_step[steps]
        replayed = step_time(replay(metered, hw))
        rows.append((name, measured, step_time(metered), replayed))
        print(f"{name:<15} measured {measured * 1e3:8.1f} ms   (metered step {step_time(metered) * 1e3:8.1f} ms)   "
              f"replayed {replayed * 1e3:8.1f} ms   replayed / measured {replayed / measured:5.2f}", flush=True)
    return rows


def _pp_dp16():
    pg = build_groups(ParallelGrid(16, pp=4, dp=4), dims=("dp", "pp"))
    cfg = GPTConfig(**{**CFG.__dict__, "n_layer": 4})
    pipe = PipelineParallel(GPT(cfg, seed=0), sch.one_f_one_b(4, 8), group=pg.pp, dp_group=pg.dp)
    x, y = _batch(16, pg.coords["dp"])
    with count_costs():
        pipe.step(x, y)


def replay16():
    res = parlab.run(_pp_dp16, 16, backend="gloo", trace=True, echo=False, timeout=600)
    tr = res.trace
    times = []
    for _ in range(5):
        out, secs = timed(replay, tr, preset("dgx-h100"))
        times.append(secs)
    print(f"16-rank trace: {len(tr)} events; replay on DGX H100 takes {statistics.median(times) * 1e3:.1f} ms "
          f"(median of 5; min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}); replayed step "
          f"{step_time(out) * 1e3:.3f} ms")
    return len(tr), times


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hardware", default=None, help="a Hardware JSON (default: calibrate now)")
    p.add_argument("--only", default=None, choices=["consistency", "replay16"])
    a = p.parse_args(argv)
    print(f"load: {os.getloadavg()}", flush=True)
    if a.only != "replay16":
        if a.hardware:
            hw = load(a.hardware)
        else:
            hw, text = calibrate(a.world)
            print(text, flush=True)
        print(hw, flush=True)
        self_consistency(hw, a.world, a.steps)
    if a.only != "consistency":
        replay16()
    print(f"load: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
