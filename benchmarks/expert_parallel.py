"""Benchmark: parlab's expert-parallel MoE layer vs the same layer dispatched with torch's own autograd all-to-all.

One MoE layer (E experts, top-k, no dropping) with its experts spread over N gloo ranks, each rank routing its own
T tokens. Both sides use the same router, the same stacked expert weights and the same routing; what differs is
the dispatch and combine: parlab's (`parlab.parallel.expert.comm`: a traced counts exchange, uneven
``all_to_all_single`` through parlab.comm, rows re-sorted by local expert, a deterministic combine) against a
reference written with torch alone (``torch.distributed.all_to_all_single`` for the counts,
``torch.distributed.nn.functional.all_to_all_single`` for the rows, the same sort). They run in the same
processes, alternating step by step; outputs and input gradients agree (checked each run). Reported per N:

    step ms        median wall time of forward + backward of the layer, slowest rank
    ratio          parlab / torch
    bytes/rank     what rank 0 sent in the step's four token all-to-alls (dispatch and combine, forward and
                   backward), from parlab's trace, next to the formula 2 (S + R) H 4 bytes (S rows it sent to
                   other ranks' experts, R rows it received from other ranks: dispatch sends S, combine returns R,
                   backward the same the other way), and its expectation under uniform routing, 4 k T (N-1)/N H 4
    dropped        none (no capacity factor), so every assignment travels

Usage:  python benchmarks/expert_parallel.py [--ranks 2 4] [--steps 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dfn

import parlab
from parlab import comm
from parlab.models.moe import MoE, sort_by_expert, unsort
from parlab.parallel.expert import ExpertParallelMoE
from parlab.trace import recording

H, F, E, K, T = 256, 1024, 8, 2, 512        # hidden, expert ffn, experts, top-k, tokens per rank


def torch_dispatch_forward(layer: ExpertParallelMoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward with dispatch and combine written with torch.distributed only (untraced)."""
    r = layer.route(x)                                                               # the same routing
    x_sorted, slots = sort_by_expert(x, r)                                           # (N, H) by expert
    n = dist.get_world_size()
    local = E // n
    received = torch.empty(n * local, dtype=torch.long)                              # (ep E/ep,)
    dist.all_to_all_single(received, r.counts.clone())                               # counts first
    received = received.view(n, local)
    in_splits = r.counts.view(n, local).sum(1).tolist()
    out_splits = received.sum(1).tolist()
    rows = x_sorted.new_empty(sum(out_splits), H)
    rows = dfn.all_to_all_single(rows, x_sorted, out_splits, in_splits)             # (M, H) by source rank
    src_expert = torch.repeat_interleave(torch.arange(n * local), received.reshape(-1)) % local
    order = torch.sort(src_expert, stable=True).indices                              # (M,) by local expert
    y = layer.experts(rows[order], received.sum(0).tolist())                         # (M, H)
    back = torch.empty_like(y).index_copy(0, order, y)                               # by source rank again
    out = x_sorted.new_empty(sum(in_splits), H)
    out = dfn.all_to_all_single(out, back, in_splits, out_splits)                    # (N, H)
    return unsort(out, slots, r)                                                     # (T, H)


def _rank(steps: int):
    rank, n = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(0)
    layer = ExpertParallelMoE(MoE(H, F, E, K), None)                                 # same weights on every rank
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + rank))       # this rank's tokens
    times = {"parlab": [], "torch": []}
    grads, sent = {}, 0
    for step in range(steps + 2):
        for name in ("parlab", "torch"):
            xi = x.clone().requires_grad_()
            comm.barrier()
            t0 = time.perf_counter()
            if name == "parlab":
                with recording() as rec:
                    out = layer(xi)
                    out.square().sum().backward()
            else:
                out = torch_dispatch_forward(layer, xi)
                out.square().sum().backward()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)                                # the slowest rank
            if step >= 2:
                times[name].append(dt.item())
            grads[name] = xi.grad
            if name == "parlab":
                sent = sum(e.wire_bytes for e in rec.events if e.op == "all_to_all" and "ep counts" not in e.label)
            layer.zero_grad(set_to_none=True)
    counts = layer.route(x).counts                                                   # (E,) this rank's rows
    everyone = counts.clone()
    dist.all_reduce(everyone)                                                        # (E,) all ranks' rows
    mine = slice(rank * (E // n), (rank + 1) * (E // n))
    sent_rows = int(counts.sum() - counts[mine].sum())                               # to other ranks' experts
    received_rows = int(everyone[mine].sum() - counts[mine].sum())                   # from other ranks
    # dispatch sends `sent_rows` and combine returns `received_rows`; backward the same two the other way
    formula = 2 * (sent_rows + received_rows) * H * 4
    same = torch.allclose(grads["parlab"], grads["torch"], rtol=1e-5, atol=1e-6)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, sent, formula, same


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    print("| ranks | parlab ms | torch ms | ratio | bytes/rank (trace) | formula 2(S+R)H x 4 | uniform routing | "
          "input grads agree |")
    print("|---|---|---|---|---|---|---|---|")
    for n in a.ranks:
        times, sent, formula, same = parlab.run(_rank, n, a.steps, echo=False)[0]
        uniform = 4 * K * T * (n - 1) / n * H * 4
        print(f"| {n} | {times['parlab']:.1f} | {times['torch']:.1f} | {times['parlab'] / times['torch']:.2f} | "
              f"{sent:,.0f} | {formula:,} | {uniform:,.0f} | {same} |")


if __name__ == "__main__":
    main()
