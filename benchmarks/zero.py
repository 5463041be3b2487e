"""Benchmark: parlab ZeRO-1/2/3 against torch's ZeroRedundancyOptimizer and fully_shard (FSDP2).

    python benchmarks/zero.py [--world 2] [--layers 4] [--hidden 128] [--steps 8] [--repeats 3]

Every variant trains the same fp32 GPT with AdamW for the same steps on simulated ranks
(gloo on the CPU, one process per rank). A step is forward + backward + gradient
synchronisation + optimizer step; we report the median step time over ranks, steps and
repeats (variants interleaved in each repeat, so drifting machine load hits all alike),
its ratio to the torch counterpart, and the model-state bytes each rank holds after the
step (params + grads + optimizer state, measured from the tensors; for parlab's FSDP also
the peak of gathered weights from its trace marks). This is not allocator peak memory:
on the CPU torch has no allocator statistics.

Pairs compared (ratio = parlab / torch, goal <= 1.25):
    parlab ZeRO-1 (ShardedOptimizer stage 1: reduce-scatter overlapped with backward + all-gather)
        vs torch DDP + ZeroRedundancyOptimizer (bucketed all-reduce overlapped with backward, then broadcasts)
    parlab ZeRO-3 (FullyShardedDataParallel, one unit per block)
        vs torch fully_shard on each block and the root (FSDP2, CPU device mesh on gloo)
parlab ZeRO-2 and torch DDP + AdamW are listed for context.

Size sweep (``--sweep``): ZeRO-1/2 against torch's ZeroRedundancyOptimizer (after DDP's all-reduce) at
about 1M, 6.3M and 50M parameters, for a 6-layer MLP (widths 408, 1024, 2887) and a GPT (L/H = 4/144,
6/296, 8/720, seq 32). One run per (model, size): every rank builds all three variants, then times
alternating blocks of steps (order reversed every other block), so a load change on the shared machine
hits every variant alike. The batch is small on purpose (MLP: 16 rows per rank; GPT: 2 x 32 tokens per
rank), so the optimizer and its communication are a large share of the step: the regime where ZeRO's
implementation matters most.

    python benchmarks/zero.py --sweep [--blocks 4] [--block-steps 3] [--sizes 1M,6.3M,50M] [--models mlp,gpt]
                                      [--before REV]

``--before REV`` (default: the commit before the overlap work) adds parlab's ZeRO-1 as it was at git revision
REV (the whole package at REV, extracted to a temporary folder and removed afterwards), timed in the same
blocks: a before/after at the same machine load. The table also gives the median CPU time per step of each
variant (the process's CPU time, all its threads, gloo's included): on a loaded machine it moves less than
the wall time.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import time

import torch
import torch.distributed as dist

import parlab
from parlab.corpus import BatchSampler, load_corpus
from parlab.parallel.zero import FullyShardedDataParallel
from parlab.parallel.zero.memory import measure
from parlab.models import GPT, GPTConfig
from parlab.parallel.zero import ShardedOptimizer

VARIANTS = ["torch-ddp", "parlab-zero1", "torch-zero1", "parlab-zero2", "parlab-zero3", "torch-fsdp2"]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t     # DTensor -> this rank's shard


def _torch_bytes(params, opt) -> dict:
    params = list(params)
    p = sum(_local(x).nbytes for x in params)
    g = sum(_local(x.grad).nbytes for x in params if x.grad is not None)
    state = opt.optim.state if hasattr(opt, "optim") else opt.state      # ZeroRedundancyOptimizer keeps .optim
    o = sum(_local(v).nbytes for s in state.values() for v in s.values() if torch.is_tensor(v))
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def _bench(kind: str, cfg: GPTConfig, batch: int, steps: int, warmup: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT(cfg, seed=0)
    adamw = dict(lr=1e-3, weight_decay=0.1)
    if kind == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        fwd = DDP(model)
        opt = torch.optim.AdamW(fwd.parameters(), **adamw)
    elif kind == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP
        fwd = DDP(model)
        opt = ZeroRedundancyOptimizer(fwd.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    elif kind in ("parlab-zero1", "parlab-zero2"):
        fwd = model
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=int(kind[-1]), **adamw)
    elif kind == "parlab-zero3":
        fwd = FullyShardedDataParallel(model)
        opt = torch.optim.AdamW(fwd.parameters(), **adamw)
    elif kind == "torch-fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fwd = model
        opt = torch.optim.AdamW(model.parameters(), **adamw)
    else:
        raise ValueError(f"unknown variant {kind!r}; choose from {VARIANTS}")
    sampler = BatchSampler(load_corpus(20000), batch, cfg.seq_len, seed=0)
    times = []
    for t in range(warmup + steps):
        x, y = sampler.shard(t, rank, world)
        dist.barrier()                                   # start every step together (not timed)
        t0 = time.perf_counter()
        loss = fwd(x, y)[1]
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        if t == warmup + steps - 1:                      # bytes held after the last step, before zero_grad
            held = measure(fwd.parameters(), opt) if kind.startswith("parlab") else _torch_bytes(fwd.parameters(), opt)
        opt.zero_grad()
        if t >= warmup:
            times.append(t1 - t0)
    return {"times": times, "bytes": held, "loss": loss.item()}


SWEEP_VARIANTS = ["parlab-zero1", "parlab-zero2", "torch-zero1"]
BEFORE = "36f01c3"          # the last commit before ZeRO-1/2 overlapped its reduce-scatters with backward


def _extract_at(rev: str) -> str:
    """Extract the parlab package as it was at git revision `rev` into a new temporary folder, as package
    ``parlab_before`` (the caller removes the folder)."""
    import pathlib
    import subprocess
    import tempfile
    root = pathlib.Path(__file__).resolve().parents[1]
    dest = pathlib.Path(tempfile.mkdtemp(prefix="parlab-before-"))
    tar = subprocess.run(["git", "archive", rev, "parlab"], cwd=root, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True)
    (dest / "parlab").rename(dest / "parlab_before")
    return str(dest)


def _sharded_optimizer_at(folder: str):
    """ShardedOptimizer from the package `_extract_at` left in `folder`: the whole package at that revision
    (its relative imports resolve inside it, so zero.py, zero_comm.py, zero_flat.py and comm.py are all as
    they were), so before and after run in one process, on one machine load."""
    import importlib
    import sys
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("parlab_before.zero").ShardedOptimizer


MLP_WIDTH = {"1M": 408, "6.3M": 1024, "50M": 2887}
GPT_SHAPE = {"1M": (4, 144), "6.3M": (6, 296), "50M": (8, 720)}


class MLP(torch.nn.Module):
    """6 x (Linear(h, h), ReLU): 6 (h^2 + h) parameters; loss = mean square of the output."""

    def __init__(self, h: int, layers: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(h, h), torch.nn.ReLU())])

    def forward(self, x, y=None):
        out = self.net(x)                                        # (B, h)
        return out, out.square().mean()


def _sweep_rank(model_kind: str, size: str, blocks: int, steps: int, warmup: int, variants=SWEEP_VARIANTS,
                before: str | None = None):
    """One rank: build every variant on its own copy of the model, then alternate timed blocks of steps.
    'parlab-zero1-before' is ZeRO-1 from the package `_extract_at` left in folder `before`."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, world = dist.get_rank(), dist.get_world_size()
    adamw = dict(lr=1e-3, weight_decay=0.1)
    if model_kind == "mlp":
        h = MLP_WIDTH[size]
        make = lambda: MLP(h)
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(16, h, generator=g), None) for _ in range(4)]
    else:
        L, H = GPT_SHAPE[size]
        cfg = GPTConfig(n_layer=L, n_embd=H, n_head=4, seq_len=32, vocab_size=64)
        make = lambda: GPT(cfg, seed=0)
        sampler = BatchSampler(load_corpus(20000), 2 * world, cfg.seq_len, seed=0)
        batches = [sampler.shard(t, rank, world) for t in range(4)]
    runs = {}
    for v in variants:
        model = make()
        if v == "torch-zero1":
            fwd = DDP(model)
            opt = ZeroRedundancyOptimizer(fwd.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
        elif v == "parlab-zero1-before":
            fwd, opt = model, _sharded_optimizer_at(before)(model.parameters(), torch.optim.AdamW, stage=1, **adamw)
        else:
            fwd, opt = model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=int(v[-1]), **adamw)
        runs[v] = (fwd, opt)
    n_params = sum(p.numel() for p in runs[variants[0]][0].parameters())
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}          # CPU seconds of the process (all its threads, gloo's included)

    def one(v, t):
        fwd, opt = runs[v]
        x, y = batches[t % len(batches)]
        dist.barrier()                                   # start every step together (not timed)
        t0, c0 = time.perf_counter(), time.process_time()
        fwd(x, y)[1].backward()
        opt.step()
        t1, c1 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        cpu[v].append(c1 - c0)
        return t1 - t0

    for v in variants:
        for t in range(warmup):
            one(v, t)
    for b in range(blocks):
        for v in (variants if b % 2 == 0 else variants[::-1]):
            times[v] += [one(v, b * steps + t) for t in range(steps)]
    return {"times": times, "cpu": {v: c[warmup:] for v, c in cpu.items()}, "params": n_params}


def sweep(args) -> None:
    """Print one markdown table: per (model, size) the median step time of each variant and the ratios."""
    import os
    print(f"ZeRO size sweep: AdamW fp32, world {args.world}, gloo/CPU, torch {torch.__version__}; "
          f"{args.blocks} alternating blocks x {args.block_steps} steps per variant, {args.warmup} warm-up; "
          f"load average before: {os.getloadavg()[0]:.1f}")
    variants = SWEEP_VARIANTS + (["parlab-zero1-before"] if args.before else [])
    before = f" | ZeRO-1 at {args.before} ms | before / torch" if args.before else ""
    print("| model | params | parlab ZeRO-1 ms | parlab ZeRO-2 ms | torch ZeRO-1 ms | ZeRO-1 / torch | "
          f"ZeRO-2 / torch{before} | CPU ms ZeRO-1 / ZeRO-2 / torch{' / before' if args.before else ''} | "
          "load after |")
    print("|---" * (9 + 2 * bool(args.before)) + "|")
    before_dir = _extract_at(args.before) if args.before else None
    try:
        _sweep_rows(args, variants, before_dir)
    finally:
        if before_dir:
            shutil.rmtree(before_dir, ignore_errors=True)


def _sweep_rows(args, variants, before_dir) -> None:
    import os
    for model_kind in args.models.split(","):
        for size in args.sizes.split(","):
            res = parlab.run(_sweep_rank, args.world, model_kind, size, args.blocks, args.block_steps, args.warmup,
                             variants, before_dir, backend="gloo", timeout=3600, echo=False)
            med = {v: statistics.median(s for r in res.results for s in r["times"][v]) for v in variants}
            cpu = {v: statistics.median(s for r in res.results for s in r["cpu"][v]) * 1e3 for v in variants}
            ref = med["torch-zero1"]
            old = (f" {med['parlab-zero1-before'] * 1e3:.1f} | {med['parlab-zero1-before'] / ref:.2f} |"
                   if args.before else "")
            print(f"| {model_kind} | {res[0]['params'] / 1e6:.2f}M | {med['parlab-zero1'] * 1e3:.1f} | "
                  f"{med['parlab-zero2'] * 1e3:.1f} | {ref * 1e3:.1f} | {med['parlab-zero1'] / ref:.2f} | "
                  f"{med['parlab-zero2'] / ref:.2f} |{old} {cpu['parlab-zero1']:.0f} / {cpu['parlab-zero2']:.0f} / "
                  f"{cpu['torch-zero1']:.0f}{' / %.0f' % cpu['parlab-zero1-before'] if args.before else ''} | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="ZeRO-1/2 vs ZeroRedundancyOptimizer at 1M-50M params")
    ap.add_argument("--models", default="mlp,gpt", help="sweep: mlp, gpt or both")
    ap.add_argument("--sizes", default="1M,6.3M,50M", help="sweep: any of 1M, 6.3M, 50M")
    ap.add_argument("--blocks", type=int, default=4, help="sweep: alternating blocks per variant")
    ap.add_argument("--block-steps", type=int, default=3, help="sweep: timed steps per block")
    ap.add_argument("--before", default=BEFORE, help="sweep: also time ZeRO-1 as it was at this git revision "
                                                     "('' to skip)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    if args.sweep:
        return sweep(args)
    cfg = GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=4, seq_len=args.seq, vocab_size=64)
    variants = args.variants.split(",")
    times: dict[str, list[float]] = {v: [] for v in variants}
    info: dict[str, dict] = {}
    for rep in range(args.repeats):
        for v in (variants if rep % 2 == 0 else variants[::-1]):
            try:
                res = parlab.run(_bench, args.world, v, cfg, args.batch, args.steps, args.warmup, backend="gloo",
                                 timeout=600, echo=False, trace=(v == "parlab-zero3"))
            except parlab.RankError as e:
                info[v] = {"error": f"{e.exc_type}: {e.message.splitlines()[0][:120]}"}
                continue
            times[v] += [s for r in res.results for s in r["times"]]
            info[v] = {"bytes": res[0]["bytes"], "loss": res[0]["loss"]}
            if res.trace is not None:
                info[v]["peak_gathered"] = max(e.nbytes for e in res.trace.filter(rank=0, op="unsharded_bytes"))
    med = {v: statistics.median(ts) for v, ts in times.items() if ts}
    pairs = {"parlab-zero1": "torch-zero1", "parlab-zero3": "torch-fsdp2", "parlab-zero2": "torch-zero1"}
    print(f"GPT {cfg.param_count() / 1e6:.2f}M params (L={args.layers}, H={args.hidden}, S={args.seq}), "
          f"global batch {args.batch}, world {args.world}, gloo/CPU, torch {torch.__version__}; "
          f"{args.repeats} x {args.steps} timed steps per variant")
    print("| variant | step ms (median) | vs torch | params KB | grads KB | optim KB | total KB/rank | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        if "error" in info.get(v, {}):
            print(f"| {v} | did not run: {info[v]['error']} | | | | | | |")
            continue
        if v not in med:
            continue
        b = info[v]["bytes"]
        ref = pairs.get(v)
        ratio = f"{med[v] / med[ref]:.2f}x {ref}" if ref in med else ""
        print(f"| {v} | {med[v] * 1e3:.1f} | {ratio} | {b['params'] / 1024:.0f} | {b['grads'] / 1024:.0f} | "
              f"{b['optimizer'] / 1024:.0f} | {b['total'] / 1024:.0f} | {info[v]['loss']:.4f} |")
    if "peak_gathered" in info.get("parlab-zero3", {}):
        print(f"parlab-zero3 peak gathered (unsharded) weights on rank 0: "
              f"{info['parlab-zero3']['peak_gathered'] / 1024:.0f} KB")


if __name__ == "__main__":
    main()
