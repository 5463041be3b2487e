"""Benchmark: parlab's Megatron tensor parallelism vs torch's own ``parallelize_module`` on the same gloo run.

Both sides shard the same tiny GPT (q/k/v and mlp.fc column-wise, the two projections row-wise, the
embedding and lm_head along the vocabulary, vocab-parallel cross-entropy) and run in the same processes,
alternating step by step so that the noise of a shared CPU hits both alike. Reported per tp:

    step ms       median wall time of forward + backward (+ SP gradient sync) of one step, slowest rank
    ratio         parlab / torch (the goal is <= 1.2)
    bytes/step    wire bytes one rank sent in one step, from parlab's trace, next to the ring formula
                  per layer 2 all-reduces fwd + 2 bwd of (B, S, H), plus the embedding's and lm_head's,
                  plus 3 per-token all-reduces in the loss: (4L + 2) * 2(N-1)/N * BSH*4 + 3 * 2(N-1)/N * BS*4
    torch colls   collectives torch issued in one step (CommDebugMode), for comparison

Usage:  python benchmarks/tensor_parallel.py [--tp 2 4] [--steps 20] [--sp]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import parlab
from parlab import comm
from parlab.models import GPT, GPTConfig
from parlab.parallel.tensor import parallelize_gpt, sync_sequence_parallel_grads

CFG = GPTConfig(vocab_size=512, seq_len=128, n_layer=2, n_head=8, n_embd=256, tie_embeddings=False)
B = 4


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CFG.vocab_size, (B, CFG.seq_len), generator=g),
            torch.randint(0, CFG.vocab_size, (B, CFG.seq_len), generator=g))


def _torch_tp(model, tp, sp):
    """The same layout with torch.distributed.tensor.parallel (DTensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    mesh = init_device_mesh("cpu", (tp,))
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(use_local_output=False)}  # Shard(-1) logits for loss_parallel
    for i in range(CFG.n_layer):
        p = f"blocks.{i}."
        plan.update({p + "attn.q": ColwiseParallel(), p + "attn.k": ColwiseParallel(), p + "attn.v": ColwiseParallel(),
                     p + "attn.proj": RowwiseParallel(), p + "mlp.fc": ColwiseParallel(),
                     p + "mlp.proj": RowwiseParallel()})
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)  # one all-gather for q, k, v (and for mlp.fc)
            plan.update({p + "ln_1": SequenceParallel(use_local_output=True), p + "attn": gather,
                         p + "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
                         p + "ln_2": SequenceParallel(use_local_output=True), p + "mlp": gather,
                         p + "mlp.proj": RowwiseParallel(output_layouts=Shard(1))})
    if sp:  # the position table is added after the embedding, so the sequence is split at the first block
        plan.update({"blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                    use_local_output=True),
                     "ln_f": SequenceParallel(use_local_output=True),
                     "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)})
    return parallelize_module(model, mesh, plan)


def _torch_step(model, idx, targets):
    from torch.distributed.tensor.parallel import loss_parallel
    logits = model.head(_torch_blocks(model, model.embed(idx)))
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    return loss


def _torch_blocks(model, x):
    for block in model.blocks:
        x = block(x)
    return x


def _parlab_step(model, idx, targets, sp):
    loss = model(idx, targets)[1]
    loss.backward()
    if sp:
        sync_sequence_parallel_grads(model)
    return loss


def _bench(steps: int, sp: bool):
    from torch.distributed.tensor.debug import CommDebugMode
    tp = comm.get_world_size()
    ours = parallelize_gpt(GPT(CFG, seed=0), sequence_parallel=sp)
    theirs = _torch_tp(GPT(CFG, seed=0), tp, sp)
    idx, targets = _batch()
    times = {"parlab": [], "torch": []}
    losses = {}
    for step in range(steps + 2):  # 2 warm-up steps
        for name, fn in (("parlab", lambda: _parlab_step(ours, idx, targets, sp)),
                         ("torch", lambda: _torch_step(theirs, idx, targets))):
            comm.barrier()
            t = time.perf_counter()
            with parlab.trace.region("step", label=f"{name} {step}"):
                losses[name] = fn().item()
            if step >= 2:
                times[name].append(time.perf_counter() - t)
        for m in (ours, theirs):
            m.zero_grad(set_to_none=True)
    with warnings.catch_warnings(), CommDebugMode() as cdm:
        # CommDebugMode's own module hooks warn that "Full backward hook is firing ..."; not our model's doing
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        _torch_step(theirs, idx, targets)
    return dict(times=times, losses=losses, torch_colls={str(k): v for k, v in cdm.get_comm_counts().items()})


def formula_bytes(tp: int, sp: bool) -> float:
    L, S, H = CFG.n_layer, CFG.seq_len, CFG.n_embd
    X = B * S * H * 4  # one float32 activation (B, S, H)
    ring = 2 * (tp - 1) / tp
    act = (4 * L + 2) * ring * X  # SP: as many all-gathers + reduce-scatters, each half of an all-reduce
    loss = 3 * ring * B * S * 4
    sp_grads = ring * 4 * ((2 * L + 1) * 2 * H + 2 * L * H + S * H) if sp else 0  # the SP gradient all-reduce
    return act + loss + sp_grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sp", action="store_true", help="sequence parallel on both sides")
    a = ap.parse_args()
    print(f"config: {CFG}, B={B}, float32, gloo, sequence_parallel={a.sp}")
    print(f"{'tp':>3} {'parlab ms':>10} {'torch ms':>9} {'ratio':>6} {'bytes/step (trace)':>19} "
          f"{'formula':>10} {'loss parlab':>12} {'loss torch':>11}  torch collectives/step")
    for tp in a.tp:
        res = parlab.run(_bench, tp, a.steps, a.sp, trace=True, timeout=600, echo=False)
        slowest = {k: [max(r["times"][k][i] for r in res.results) for i in range(a.steps)] for k in ("parlab", "torch")}
        ms = {k: 1e3 * statistics.median(v) for k, v in slowest.items()}
        # wire bytes of one parlab step on rank 0: the trace events inside the first measured step's region
        step = res.trace.filter(rank=0, kind="compute", label="parlab 2").events[0]
        sent = sum(e.wire_bytes for e in res.trace.filter(rank=0).comm()
                   if step.start <= e.start <= step.end and e.op != "barrier")
        lo = res.results[0]["losses"]
        print(f"{tp:>3} {ms['parlab']:>10.1f} {ms['torch']:>9.1f} {ms['parlab'] / ms['torch']:>6.2f} "
              f"{sent:>19,.0f} {formula_bytes(tp, a.sp):>10,.0f} {lo['parlab']:>12.6f} {lo['torch']:>11.6f}  "
              f"{res.results[0]['torch_colls']}")


if __name__ == "__main__":
    main()
