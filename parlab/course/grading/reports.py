"""What the exercises' locked demonstration cells print, in the language in force.

A locked cell is the same bytes in every language (nbgrader checksums it and grades against it), so a sentence it
prints cannot be translated in the notebook. Such a cell prints what one of these functions returns instead, each
sentence a message of parlab's catalogue (``_()``), the way exercise 05 prints `Simulation.summary()`:

    ring_traffic          exercise 00: your ring against comm.all_reduce, bytes per rank against 2(N-1)/N x size
    zero_fit              exercise 03: the fewest GPUs that hold a model's states at one ZeRO stage
    same_as_dense         exercise 04: the tensor-parallel MLP against the dense one
    causal_ring_report    exercise 06: the error against full causal attention, each rank's score blocks
    ulysses_traffic       exercise 08: the bytes put into all-to-alls against the formula's payload

The numbers are the cell's own (computed from the student's code); only the words come from here.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from parlab.i18n import _
from parlab.i18n.columns import pad

__all__ = ["ring_traffic", "zero_fit", "same_as_dense", "causal_ring_report", "ulysses_traffic"]


def _yes(ok: bool) -> str:
    return _("yes") if ok else _("no")


def ring_traffic(equal: bool, sent: Mapping[int, float], formula: float) -> str:
    """Whether the ring's result equals ``comm.all_reduce`` on every rank, the formula's bytes per rank and what
    each rank's ring sent (`sent`: rank -> bytes)."""
    lines = [_("ring result equals comm.all_reduce on every rank: {answer}").format(answer=_yes(equal)),
             _("formula 2(N-1)/N x size = {bytes:,.0f} bytes per rank").format(bytes=formula)]
    lines += [_("rank {rank}: your ring sent {bytes:,.0f} bytes").format(rank=r, bytes=b) for r, b in sent.items()]
    return "\n".join(lines)


def zero_fit(stage: str, gpus: int | None, floor_bytes: float) -> str:
    """One line: the fewest GPUs (None: no number does) that hold the model states at ZeRO stage `stage`, and
    what each GPU still holds with unlimited GPUs (`floor_bytes`)."""
    need = _("never") if gpus is None else _("{n} GPUs").format(n=gpus)
    return f"{stage:>6}: {pad(need, 10, '>')} " + _("(with unlimited GPUs each still holds {gb:,.1f} GB)").format(
        gb=floor_bytes / 1e9)


def same_as_dense(equal: bool) -> str:
    """Whether the tensor-parallel MLP's output and input gradient equal the dense MLP's on every rank."""
    return _("output and input gradient equal the dense MLP on every rank: {answer}").format(answer=_yes(equal))


def causal_ring_report(error: float, ranks: Iterable[tuple[list[int], list[float]]]) -> str:
    """The largest error against full causal attention, then for each rank (positions, score blocks computed at
    each ring step) its positions, blocks per step and total."""
    lines = [_("max |error| vs full causal attention: {error:.1e}").format(error=float(error))]
    lines += [_("rank {rank}: positions {positions}, score blocks per step {blocks}, total {total:g}").format(
        rank=r, positions=list(pos), blocks=list(blocks), total=sum(blocks)) for r, (pos, blocks) in enumerate(ranks)]
    return "\n".join(lines)


def ulysses_traffic(sent: int, payload: float) -> str:
    """The bytes rank 0 put into all-to-alls in one layer (forward and backward) and the formula's payload."""
    return "\n".join([_("rank 0 put {bytes:,} bytes into all-to-alls (forward + backward)").format(bytes=sent),
                      _("formula: payload {bytes:,.0f} bytes each way").format(bytes=payload)])
