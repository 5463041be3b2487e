"""Checks for exercise 01: the process groups of a tp x dp x pp grid (seed 000; Megatron-LM's parallel_state).

The student writes ``tp_groups``, ``dp_groups`` and ``pp_groups(world_size, tp, pp)`` and
``all_reduce_in_dp_group(x, tp, pp)``, and

    check_groups(fn, dim)     the `dim` groups (in any order) equal ``ParallelGrid(world, tp=tp, pp=pp).groups(dim)``
                              on the layouts of `GROUP_LAYOUTS`; a wrong answer is explained (the groups of another
                              dimension, a rank in two groups, a rank in the wrong group) with the layout's rule
    check_dp_all_reduce(fn)   on 8 simulated ranks, every rank gets the sum over its own dp group, from a
                              comm.all_reduce with that group (the trace says which groups communicated)

``parlab.parallel.topology.ParallelGrid`` is the reference, unavailable to the student's code while a check runs.
"""
from __future__ import annotations

import torch

from parlab import comm
from parlab.i18n import _
from parlab.parallel.topology import ParallelGrid
from parlab.course.grading import guard
from parlab.course.grading.guard import graded
from parlab.course.grading.runner import TIMEOUT, _show, call_student, run_student

__all__ = ["check_groups", "check_dp_all_reduce", "GROUP_LAYOUTS"]

GROUP_LAYOUTS = ((16, 2, 4), (8, 2, 2), (24, 4, 2))    # (world_size, tp, pp): seed 000's example first


def _group_hint(dim: str) -> str:
    """The rule of the layout that places `dim`'s neighbours."""
    return {"tp": _("tp is the fastest-varying coordinate: a tp group is tp consecutive ranks."),
            "dp": _("rank = tp_rank + tp * (dp_rank + dp * pp_rank): dp neighbours are tp apart, inside one pipeline "
                    "stage."),
            "pp": _("pp is the slowest coordinate: pp neighbours are world_size / pp = tp * dp apart.")}[dim]


def _normalise(groups) -> list[list[int]]:
    try:
        return sorted(sorted(int(r) for r in g) for g in groups)
    except TypeError:
        raise AssertionError(_("expected a list of groups, each a list of ranks, got {groups!r}").format(
            groups=groups)) from None


@graded("parlab.parallel.topology:ParallelGrid")
def check_groups(fn, dim: str, layouts=GROUP_LAYOUTS) -> None:
    """``fn(world_size, tp, pp)`` returns the `dim` groups (any order) equal to ParallelGrid(...).groups(dim)."""
    for world, tp, pp in layouts:
        grid = ParallelGrid(world, tp=tp, pp=pp)
        where = _("{dim} groups for world_size={world}, tp={tp}, pp={pp} (dp={dp})").format(
            dim=dim, world=world, tp=tp, pp=pp, dp=grid.dp)
        got = _normalise(call_student(fn, world, tp, pp, what=f"{dim}_groups"))
        want = grid.groups(dim)
        if got == want:
            continue
        for other in ("tp", "dp", "pp"):
            if other != dim and got == grid.groups(other):
                raise AssertionError(_("{where}: you returned the {other} groups.\nHint: {hint}").format(
                    where=where, other=other, hint=_group_hint(dim)))
        seen = [r for g in got for r in g]
        for r in range(world):
            if seen.count(r) != 1:
                raise AssertionError(_("{where}: rank {r} appears in {count} groups; the groups of one dimension "
                                       "must contain every rank exactly once.\nHint: {hint}").format(
                    where=where, r=r, count=seen.count(r), hint=_group_hint(dim)))
        if set(seen) != set(range(world)):
            raise AssertionError(_("{where}: ranks {ranks} do not exist.").format(
                where=where, ranks=sorted(set(seen) - set(range(world)))))
        for r in range(world):
            mine = next(g for g in got if r in g)
            if mine != grid.group_of(r, dim):
                raise AssertionError(_("{where}: rank {r} should be grouped with {group}, your groups put it in "
                                       "{mine}.\n  expected {want}\n  got      {got}\nHint: {hint}").format(
                    where=where, r=r, group=grid.group_of(r, dim), mine=mine, want=want, got=got,
                    hint=_group_hint(dim)))
    print(_("{dim} groups match parlab.parallel.topology for {n} layouts").format(dim=dim, n=len(layouts)))


def _rank_dp_all_reduce(student_fn, tp, pp):
    x = torch.tensor([float(2 ** comm.get_rank())])     # a sum of powers of two says which ranks took part
    out = student_fn(x, tp, pp)
    return (x if out is None else out).clone()


@graded("parlab.parallel.topology:ParallelGrid")
def check_dp_all_reduce(fn, world_size: int = 8, tp: int = 2, pp: int = 2, timeout: float = TIMEOUT) -> None:
    """``fn(x, tp, pp)``, run on every rank, sums x over this rank's dp group with comm.all_reduce."""
    grid = ParallelGrid(world_size, tp=tp, pp=pp)
    res = run_student(_rank_dp_all_reduce, world_size, fn, tp, pp, timeout=timeout, what="all_reduce_in_dp_group")
    for r, got in enumerate(res.results):
        group = grid.group_of(r, "dp")
        want = float(sum(2 ** k for k in group))
        value = int(got.item()) if got.numel() == 1 else None
        if got.numel() != 1 or float(got.item()) != want:
            who = [k for k in range(world_size) if value is not None and value >> k & 1]
            raise AssertionError(_("rank {r} of grid {grid}: expected the sum over its dp group {group} ({want:g}), "
                                   "got {got}, which is the sum over ranks {who}.\nHint: build every dp group with "
                                   "dist.new_group on every rank, in the same order, and pass this rank's group to "
                                   "comm.all_reduce(x, group=...).").format(r=r, grid=grid, group=group, want=want,
                                                                            got=_show(got), who=who))
    groups = {e.group for e in res.trace.filter(op="all_reduce").events}
    for r in range(world_size):
        mine = {e.group for e in res.trace.filter(op="all_reduce", rank=r).events}
        if tuple(grid.group_of(r, "dp")) not in mine:
            raise AssertionError(_("rank {r} made no comm.all_reduce over its dp group {group} (the trace shows "
                                   "{shown}); the sum must come from an all-reduce with the dp group, not be computed "
                                   "locally.").format(r=r, group=grid.group_of(r, "dp"),
                                                      shown=sorted(mine) or _("none")))
    if not groups <= {tuple(g) for g in grid.groups("dp")}:
        raise AssertionError(_("the trace shows all-reduces over {groups}; use comm.all_reduce with the dp group, so "
                               "that only dp groups {dp} communicate.").format(groups=sorted(groups),
                                                                              dp=grid.groups("dp")))
    print(_("all_reduce_in_dp_group sums over the dp groups {dp}").format(dp=grid.groups("dp")))


guard.protect(__name__)
