"""Size histograms: a working set's bytes grouped by power-of-two size class.

A compute span's memory traffic is priced by the size of the working set each op touches (a cache holds a small
one, HBM serves a big one), so the cost meter (`parlab.trace.meter`) records ((k, bytes), ...) pairs, class k
holding the ops whose working set is between 2^k and 2^(k+1) bytes. Spans nest (a region inside a metered
region), so histograms are added and subtracted. Pure Python; the virtual cluster (`parlab.cluster.hardware`)
prices them.
"""
from __future__ import annotations

__all__ = ["size_class", "hist_add", "hist_sub"]


def size_class(nbytes: int) -> int:
    """The power-of-two size class k of a working set of `nbytes` (>= 1): 2^k <= nbytes < 2^(k+1)."""
    return max(int(nbytes), 1).bit_length() - 1


def hist_add(a, b, sign: int = 1) -> tuple[tuple[int, int], ...]:
    """The sum (sign 1) or difference (sign -1) of two size histograms ((k, bytes), ...), zero classes left out."""
    out = dict((int(k), v) for k, v in a)
    for k, v in b:
        out[int(k)] = out.get(int(k), 0) + sign * v
    return tuple(sorted((k, v) for k, v in out.items() if v))


def hist_sub(a, b) -> tuple[tuple[int, int], ...]:
    """a - b for size histograms (see `hist_add`)."""
    return hist_add(a, b, -1)
