"""What a call puts on the wire: the byte model every traced event is read with (pure, no torch).

An event (`parlab.trace.Event`) stores the *payload* size ``nbytes`` of the call (for all-reduce the tensor, for
all-gather the gathered output, for reduce-scatter the full input, for send/recv the message). How many bytes a
rank actually puts on the wire depends on the algorithm; `wire_bytes` gives the standard ring/pipeline model used
by NCCL's performance notes (nccl-tests PERFORMANCE.md; Patarasuk & Yuan 2009):

    all_reduce      2 (N-1)/N * X     (reduce-scatter + all-gather)
    all_gather        (N-1)/N * X     (X = size of the gathered output)
    reduce_scatter    (N-1)/N * X     (X = size of the full input)
    all_to_all        (N-1)/N * X     (the block a rank keeps stays home)
    broadcast, reduce         X       (pipelined chain around the group: every rank but the
                                       chain's last sends X, every rank but its first receives X)
    gather / scatter   X/N per non-root rank, (N-1)/N * X at the root
    send / recv               X

`RING` holds, for each op over n ranks, the algorithm's steps and its bytes factor on the payload (the bus-bandwidth
factors of nccl-tests PERFORMANCE.md): the one place in parlab where 2(N-1)/N is written. The formulas of the
lessons, the planner, the calibration and the replay all read it (`ring_factor`, `ring_steps`).

`format_bytes` writes a byte count the way the whole course does (SI units).
"""
from __future__ import annotations

__all__ = ["wire_bytes", "format_bytes", "RING", "ring_factor", "ring_steps"]

#: (algorithm steps, bytes factor on the payload) of the ring / chain algorithm of each op over n ranks
RING = {
    "all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),   # reduce-scatter + all-gather: N-1 steps of X/N each
    "all_gather": lambda n: (n - 1, (n - 1) / n),
    "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
    "all_to_all": lambda n: (n - 1, (n - 1) / n),             # the block a rank keeps stays home
    "broadcast": lambda n: (n - 1, 1.0),                      # pipelined chain: the payload once, n - 1 hops to fill it
    "reduce": lambda n: (n - 1, 1.0),
    "gather": lambda n: (n - 1, (n - 1) / n),
    "scatter": lambda n: (n - 1, (n - 1) / n),
    "barrier": lambda n: (2 * (n - 1), 0.0),
    "send": lambda n: (1, 1.0),
    "recv": lambda n: (1, 1.0),
}


def ring_factor(op: str, n: int) -> float:
    """Bytes a rank sends per byte of payload in `op` over `n` ranks (ring all-reduce: 2(n-1)/n)."""
    return RING[op](max(n, 1))[1]


def ring_steps(op: str, n: int) -> int:
    """Sequential message steps of `op`'s ring / chain algorithm over `n` ranks (ring all-reduce: 2(n-1))."""
    return RING[op](max(n, 1))[0]


def wire_bytes(op: str, nbytes: int, group_size: int, is_root: bool = False, position: int | None = None) -> float:
    """Bytes one rank sends for a call with payload `nbytes` in a group of `group_size` ranks.

    `position` is the rank's place in the broadcast/reduce chain counted from the root (0 = root);
    when unknown a non-root rank is assumed to be in the middle of the chain."""
    n = max(group_size, 1)
    if op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        return ring_factor(op, n) * nbytes
    if op in ("broadcast", "reduce"):
        if n == 1:
            return 0.0
        pos = 0 if is_root else (position if position is not None else 1)
        if op == "broadcast":   # root -> 1 -> 2 -> ... -> n-1: the chain's last rank sends nothing
            return 0.0 if pos == n - 1 else float(nbytes)
        return 0.0 if pos == 0 else float(nbytes)   # reduce: n-1 -> ... -> 1 -> root
    if op == "gather":      # non-roots send their X/N block; the root sends nothing
        return 0.0 if is_root else nbytes / n
    if op == "scatter":     # the root sends every block but its own
        return (n - 1) / n * nbytes if is_root else 0.0
    if op == "send":
        return float(nbytes)
    return 0.0              # recv, barrier, compute


def _recv_bytes(e) -> float:
    n = max(len(e.group), 1)
    if e.op == "recv":
        return float(e.nbytes)
    if e.op == "send":
        return 0.0
    if e.op in ("broadcast", "reduce"):
        if n == 1:
            return 0.0
        pos = _chain_position(e)
        if e.op == "broadcast":     # everyone but the root receives
            return 0.0 if pos == 0 else float(e.nbytes)
        return 0.0 if pos == n - 1 else float(e.nbytes)   # reduce: everyone but the chain's start receives
    if e.op == "gather":
        return (n - 1) / n * e.nbytes if e.peer == e.rank else 0.0
    if e.op == "scatter":
        return 0.0 if e.peer == e.rank else e.nbytes / n
    return e.wire_bytes   # symmetric collectives receive what they send


def _chain_position(e) -> int | None:
    """Distance from the root along the group's rank order (the chain a pipelined broadcast/reduce uses)."""
    if e.peer is None or e.rank not in e.group or e.peer not in e.group:
        return None
    g = list(e.group)
    return (g.index(e.rank) - g.index(e.peer)) % len(g)


def format_bytes(n: float) -> str:
    """4_000_000 -> '4.00 MB': SI units (powers of 1000: kB, MB, GB, TB), the convention the whole course uses,
    as GPU vendors quote memory (80 GB) and links (25 GB/s). torch's bucket_cap_mb is the one MiB in the course
    and is always labelled MiB where it appears."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
