"""Step time of parlab's pipeline executor vs torch.distributed.pipelining on the same gloo run.

Each configuration starts p simulated ranks once (parlab.run, gloo, one thread per rank) and, inside that one
run, times four training steps alternately: parlab's 1F1B and GPipe (`PipelineParallel`) and torch's
`Schedule1F1B` and `ScheduleGPipe` driving `PipelineStage`s built from the very same stage modules (same
layers per stage, same micro-batches, same float32 model with untied embeddings, so neither side pays for a
tied-weight exchange). A step is timed from a barrier to the slowest rank's end (all-reduce MAX of the
per-rank times); we report the median over `--steps` after `--warmup` steps. Before timing, both runtimes'
gradients are compared (they must agree: same model, same batch), so the two sides do the same work.
For parlab's 1F1B it also prints the bubble measured from the trace of one extra step, the bubble that
`simulate` predicts from that step's measured per-action costs, and the unit-cost closed form.

    python benchmarks/pipeline.py                      # p = 2 and 4, m = 8
    python benchmarks/pipeline.py --stages 2 --microbatches 4 8 --steps 10
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import parlab
from parlab.parallel import pipeline as sch
from parlab.models import GPT, GPTConfig
from parlab.parallel.pipeline import PipelineParallel, measured_bubble, measured_costs
from parlab.trace import recording


class _Stage(nn.Module):
    """One pipeline stage of parlab's split, as a module torch's PipelineStage can drive."""

    def __init__(self, pp: PipelineParallel, stage: int):
        super().__init__()
        self.pp, self.stage = pp, stage
        self.body = pp.module          # registers this rank's parameters

    def forward(self, x):
        return self.pp.forward_stage(self.stage, x)


def _loss(logits, target):
    return GPT.loss(logits, target)


def _bench(cfg: GPTConfig, batch: int, m: int, steps: int, warmup: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)   # (B, S)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)   # (B, S)
    model = GPT(cfg, seed=0)

    def parlab_runner(schedule):
        pp = PipelineParallel(model, schedule)

        def step():
            for q in pp.parameters():
                q.grad = None
            pp.step(x, y)
        return step, pp

    def torch_runner(cls):
        pp = PipelineParallel(model, sch.one_f_one_b(p, m))          # only for its stage module
        stage = PipelineStage(_Stage(pp, rank), rank, p, torch.device("cpu"))
        schedule = cls(stage, m, loss_fn=_loss, scale_grads=True)   # mean over micro-batches, like parlab

        def step():
            for q in pp.parameters():
                q.grad = None
            if rank == 0:
                schedule.step(x)
            elif rank == p - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
        return step, pp

    runners = {"parlab 1F1B": parlab_runner(sch.one_f_one_b(p, m)), "parlab GPipe": parlab_runner(sch.gpipe(p, m)),
               "torch Schedule1F1B": torch_runner(Schedule1F1B), "torch ScheduleGPipe": torch_runner(ScheduleGPipe)}
    # the same work: after one step each, every runtime holds the same gradients
    grads = {}
    for name, (step, pp) in runners.items():
        step()
        grads[name] = {k: v.clone() for k, v in pp.grads().items()}
    ref = grads["parlab 1F1B"]
    agree = all(torch.allclose(grads[n][k], ref[k], rtol=1e-4, atol=1e-6) for n in grads for k in ref)

    times = {name: [] for name in runners}
    for it in range(warmup + steps):
        for name, (step, _) in runners.items():                    # interleaved, so load drifts hit all alike
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if it >= warmup:
                times[name].append(dt.item())
    with recording(rank) as rec:                                   # one traced parlab step for the bubble
        dist.barrier()
        runners["parlab 1F1B"][0]()
    return {"median": {n: statistics.median(t) for n, t in times.items()}, "agree": agree, "events": rec.events}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    cfg = GPTConfig(vocab_size=64, seq_len=args.seq, n_layer=args.layers, n_head=4, n_embd=args.hidden,
                    tie_embeddings=False)
    print(f"model: {cfg.param_count():,} parameters ({args.layers} layers, hidden {args.hidden}, seq {args.seq}), "
          f"batch {args.batch}, float32, gloo, 1 thread per rank; median of {args.steps} steps")
    print(f"{'p':>2} {'m':>3} {'parlab 1F1B':>12} {'torch 1F1B':>11} {'ratio':>6} {'parlab GPipe':>13} "
          f"{'torch GPipe':>12} {'ratio':>6}  {'bubble: measured':>16} {'sim(meas)':>8} {'sim(unit)':>6}  grads agree")
    for p in args.stages:
        for m in args.microbatches:
            res = parlab.run(_bench, p, cfg, args.batch, m, args.steps, args.warmup, threads=1, timeout=600)
            med, agree = res.results[0]["median"], res.results[0]["agree"]
            trace = parlab.Trace.merge(r["events"] for r in res.results)
            unit = sch.simulate(sch.one_f_one_b(p, m)).bubble_fraction
            cost = measured_costs(trace)
            sim = sch.simulate(sch.one_f_one_b(p, m), costs=lambda a: cost[(a.stage, a.kind)]).bubble_fraction
            r1 = med["parlab 1F1B"] / med["torch Schedule1F1B"]
            r2 = med["parlab GPipe"] / med["torch ScheduleGPipe"]
            print(f"{p:>2} {m:>3} {med['parlab 1F1B'] * 1e3:>10.1f}ms {med['torch Schedule1F1B'] * 1e3:>9.1f}ms "
                  f"{r1:>6.2f} {med['parlab GPipe'] * 1e3:>11.1f}ms {med['torch ScheduleGPipe'] * 1e3:>10.1f}ms "
                  f"{r2:>6.2f}  {measured_bubble(trace):>8.2f} {sim:>8.2f} {unit:>6.2f}  {agree}")


if __name__ == "__main__":
    main()
