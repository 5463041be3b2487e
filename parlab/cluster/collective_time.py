"""How long a collective takes on a `parlab.cluster.hardware.Hardware`: `collective_seconds`, the body of
`Hardware.collective_time` (the replay's and the planner's one timing of every collective and message).

Ring collectives as NCCL runs them (steps and bytes of `parlab.trace.wire.RING`); across nodes NCCL's double binary
tree for all-reduce where it is faster (Sanders et al., "Two-tree algorithms for full bandwidth broadcast,
reduction and scan", Parallel Computing 2009); the bandwidth a group gets across nodes from
`Hardware.inter_bandwidth` (one channel per network card, NCCL's src/graph/search.cc); an all-to-all as a send to
and a receive from every peer in one group (nccl-tests' src/alltoall.cu: ncclSend / ncclRecv between
ncclGroupStart and ncclGroupEnd), so its peers on the same node are reached over NVLink and the others over the
network cards at the same time.
Pure Python: no torch.
"""
from __future__ import annotations

import math

from parlab.trace.wire import RING as COLLECTIVE_FACTORS

__all__ = ["collective_seconds"]


def collective_seconds(hw, op: str, nbytes: float, n: int, crosses_nodes: bool = False, nodes: int = 1,
                       algorithm: str = "auto") -> float:
    """Seconds of one call of `op` with payload `nbytes` (as `parlab.trace.Event.nbytes` counts it) over
    `n` ranks whose slowest link is inter-node when `crosses_nodes`, spread over `nodes` nodes.

    ring:  base + steps x hop + factor x nbytes / bandwidth, with (steps, factor) from COLLECTIVE_FACTORS,
           e.g. all-reduce 2(n-1) steps, 2(n-1)/n of the bytes (reduce-scatter + all-gather).
    tree (all-reduce only; "auto" takes it when it is faster, as NCCL's tuner does across nodes): a chain
           inside each node and a binary tree across nodes, reduced up and broadcast down: 2 (log2(nodes)
           inter + (n/nodes - 1) intra) steps, and each rank moves the whole payload up and down once:
           2 x nbytes / bandwidth (NCCL's double binary tree: Sanders et al. 2009).
    send / recv: one step, nbytes / bandwidth, no base latency.
    all-to-all across nodes: its bytes to peers on the rank's own node over NVLink, the rest over the network
    cards, at once (`_all_to_all_bytes_time`)."""
    if n < 1:
        raise ValueError(f"a collective needs at least one rank, got n={n}")
    if op not in COLLECTIVE_FACTORS:
        raise ValueError(f"no cost model for op {op!r}; known: {', '.join(COLLECTIVE_FACTORS)}")
    if algorithm not in ("auto", "ring", "tree"):
        raise ValueError(f"algorithm must be 'auto', 'ring' or 'tree', got {algorithm!r}")
    bw, hop = hw.link(crosses_nodes)
    if crosses_nodes and op not in ("send", "recv"):
        bw = hw.inter_bandwidth(op, n // max(nodes, 1))
    if op in ("send", "recv"):
        if hw.p2p_bw is not None:
            bw = min(bw, hw.p2p_bw)
        if hw.p2p_latency is not None:
            hop = max(hop, hw.p2p_latency)
        return hop + nbytes / bw
    if n == 1:
        return 0.0
    steps, factor = COLLECTIVE_FACTORS[op](n)
    if op == "all_to_all" and crosses_nodes and nodes > 1:
        return hw.base_latency + steps * hop + _all_to_all_bytes_time(hw, factor * nbytes, n, nodes, bw)
    ring = hw.base_latency + steps * hop + factor * nbytes / bw
    if op != "all_reduce" or algorithm == "ring" or (algorithm == "auto" and not crosses_nodes):
        return ring
    per_node = max(1, n // max(nodes, 1))
    tree_steps = 2 * (math.ceil(math.log2(max(nodes, 2))) * hw.inter_latency + (per_node - 1) * hw.intra_latency)
    tree = hw.base_latency + tree_steps + 2 * nbytes / bw
    return tree if algorithm == "tree" else min(ring, tree)


def _all_to_all_bytes_time(hw, moved: float, n: int, nodes: int, inter: float) -> float:
    """Seconds of the `moved` bytes an all-to-all sends from one rank, to its n - 1 peers equally: those on its own
    node (k - 1 of them, k = n / nodes) over NVLink, the others through its share of the network cards (`inter`),
    both at once (NCCL's all-to-all posts a send to every peer): the slower part sets the time."""
    k = max(1, n // nodes)
    intra, _ = hw.link(False)
    return max(moved * (k - 1) / (n - 1) / intra, moved * (n - k) / (n - 1) / inter)
