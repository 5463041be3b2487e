"""Step time of parlab's DistributedDataParallel against torch.nn.parallel.DistributedDataParallel.

Both wrap the same GPT (same weights, same float32 data, same bucket cap) inside one `parlab.run`, and the
two are timed in alternating rounds of steps, so machine load drifts hit both alike. A step is forward,
backward (with the bucketed all-reduces) and an SGD step; its time on a rank is wall-clock, and a step's
time is the slowest rank's. The table gives the median over the timed steps and the ratio parlab / torch
(the goal is <= 1.1).

    python benchmarks/ddp.py                      # 2 and 4 gloo ranks on the CPU
    python benchmarks/ddp.py --world-sizes 2 --rounds 5 --steps-per-round 4 --bucket-cap-mb 0.5

Differences that remain: torch caps its *first* bucket at 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) so the
first all-reduce starts sooner; parlab uses one cap for all. torch's reducer and hooks are C++; parlab's
hooks are Python (a few microseconds per parameter).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import parlab
from parlab.corpus import BatchSampler, load_corpus
from parlab.parallel.data import DistributedDataParallel
from parlab.models import GPT, GPTConfig


def _bench(cfg: GPTConfig, batch: int, bucket_cap_mb: float, rounds: int, steps_per_round: int, warmup: int):
    r, w = dist.get_rank(), dist.get_world_size()
    sampler = BatchSampler(load_corpus(20_000), batch_size=batch * w, seq_len=cfg.seq_len, seed=0)
    ours = DistributedDataParallel(GPT(cfg, seed=0), bucket_cap_mb=bucket_cap_mb)
    theirs = torch.nn.parallel.DistributedDataParallel(GPT(cfg, seed=0), bucket_cap_mb=bucket_cap_mb)
    models = {"parlab": ours, "torch": theirs}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    step = {k: 0 for k in models}

    def one_step(name: str) -> float:
        x, y = sampler.shard(step[name], r, w)                 # (batch, S) each
        step[name] += 1
        dist.barrier()                                          # start together: time the step, not the skew
        t = time.perf_counter()
        loss = models[name](x, y)[1]
        loss.backward()
        opts[name].step()
        opts[name].zero_grad()
        return time.perf_counter() - t

    for name in models:
        for _ in range(warmup):
            one_step(name)
    for i in range(rounds):                                     # alternate which goes first
        for name in (("parlab", "torch") if i % 2 == 0 else ("torch", "parlab")):
            times[name] += [one_step(name) for _ in range(steps_per_round)]
    # both trained on the same batches from the same weights: they should agree up to float32 rounding
    diff = max((a - b).abs().max().item() for a, b in zip(ours.module.parameters(), theirs.module.parameters()))
    return times, len(ours.buckets), diff


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="rows per rank")
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args(argv)
    cfg = GPTConfig(vocab_size=64, seq_len=args.seq_len, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    print(f"GPT {cfg.param_count() / 1e6:.2f}M params (float32, {cfg.param_count() * 4 / 2**20:.1f} MiB of "
          f"gradients), {args.batch} x {args.seq_len} tokens per rank, bucket_cap_mb={args.bucket_cap_mb}, "
          f"{args.rounds * args.steps_per_round} timed steps each, {args.threads} thread(s) per rank, "
          f"torch {torch.__version__}\n")
    print("| ranks | buckets | parlab DDP (ms/step) | torch DDP (ms/step) | ratio parlab/torch | max param diff |")
    print("|---|---|---|---|---|---|")
    for w in args.world_sizes:
        res = parlab.run(_bench, w, cfg, args.batch, args.bucket_cap_mb, args.rounds, args.steps_per_round,
                         args.warmup, backend="gloo", threads=args.threads, timeout=1800)
        med = {}
        for name in ("parlab", "torch"):
            per_step = [max(ts) for ts in zip(*(res[r][0][name] for r in range(w)))]  # slowest rank per step
            med[name] = statistics.median(per_step) * 1e3
        print(f"| {w} | {res[0][1]} | {med['parlab']:.1f} | {med['torch']:.1f} | {med['parlab'] / med['torch']:.3f} "
              f"| {res[0][2]:.1e} |", flush=True)


if __name__ == "__main__":
    main()
