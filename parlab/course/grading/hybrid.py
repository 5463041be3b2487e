"""Checks for exercise 07 (4D hybrid layout): the groups of a tp x cp x dp x pp grid, and a layout for a model.

The notebook imports this module as ``grading``::

    from parlab.course.grading import hybrid as grading
    grading.check_groups_4d(groups_4d)
    grading.check_layout(choose_layout)
    grading.check_layout_search(search_layout)

* `check_groups_4d` compares the student's tp, cp, dp and pp groups with `parlab.parallel.topology.ParallelGrid`
  (Megatron-LM's order tp-cp-dp-pp, tp fastest) on four layouts, seed 000's 2 x 8 GPUs with tp=2 pp=4
  first. It recognises the usual mistakes: another rank order, cp left out (dp groups that are really
  the dp x cp groups), one dimension's groups returned for another.
* `check_layout` judges one hand-chosen layout with the planner's cost model (`parlab.cluster.planner`): it must
  be valid for the model and cluster, fit in GPU memory, keep tensor parallelism inside a node, and be
  within `tolerance` of the best step time the planner finds.
* `check_layout_search` runs the student's own search on several models and clusters, with
  `parlab.cluster.planner.plan` and `enumerate_layouts` switched off (the point is to write the search), and
  judges each answer like `check_layout`.

References: seed 000 (TP > DP > PP in volume, so TP inside a node and PP across nodes); Narayanan et al.,
arXiv:2104.04473, section 3; Megatron-LM ``parallel_state``.
"""
from __future__ import annotations

import itertools
import random

from parlab.cluster import planner
from parlab.cluster.costs import Cluster, ModelSpec, preset
from parlab.parallel.topology import DIMS, ParallelGrid
from parlab.course.grading import call_student
from parlab.course.grading.guard import fresh_seed, graded, protect

__all__ = ["check_groups_4d", "check_layout", "check_layout_search", "judge_layout", "LAYOUTS_4D",
           "LAYOUT_TASK", "SEARCH_TASKS"]

GB = 1e9
#: (world_size, tp, cp, pp) the groups are checked on: seed 000 first, then layouts with context parallelism
LAYOUTS_4D = ((16, 2, 1, 4), (16, 2, 2, 2), (32, 4, 2, 2), (24, 2, 3, 2))
#: the hand-chosen layout's task: LLaMA-65B on 4 DGX A100 80 GB nodes (32 GPUs), 128 sequences per step
LAYOUT_TASK = dict(model="llama-65b", cluster=Cluster(nodes=4), global_batch=128, tolerance=0.10)
#: the search's tasks: (model preset, cluster, global batch)
SEARCH_TASKS = (("llama-7b", Cluster(nodes=1, gpu_mem_gb=40.0), 32),
                ("llama-13b", Cluster(nodes=2, gpu_mem_gb=40.0), 64),
                ("gpt3-175b", Cluster(nodes=16), 256))
#: one more task is drawn at grading time from this pool (so that layouts copied from a run do not pass)
RANDOM_TASKS = (("llama-7b", "llama-13b"), (1, 2), (40.0, 80.0), (32, 64, 128))   # models, nodes, GB, batches
LAYOUT_KEYS = ("tp", "pp", "cp", "dp", "micro_batch", "zero", "recompute")

ORDER_HINT = ("Megatron's order is tp-cp-dp-pp, fastest first: rank = tp_rank + tp * (cp_rank + cp * (dp_rank + "
              "dp * pp_rank)). Neighbours along tp are 1 apart, along cp tp apart, along dp tp*cp apart, along pp "
              "tp*cp*dp = world_size/pp apart.")


# ---------------------------------------------------------------------- part 1: groups
def _normalise(groups, where: str) -> list[list[int]]:
    try:
        return sorted(sorted(int(r) for r in g) for g in groups)
    except TypeError:
        raise AssertionError(f"{where}: expected a list of groups, each a list of ranks, got {groups!r}") from None


def _order_of(answer: dict, grid: ParallelGrid) -> str:
    """A rank order whose groups equal every dimension of `answer` (dims of size 1 left out of the name,
    since they do not change the numbering), or "" if there is none."""
    for order in itertools.permutations(DIMS):
        alt = ParallelGrid(grid.world_size, tp=grid.tp, pp=grid.pp, cp=grid.cp, order="-".join(order))
        if all(alt.groups(d) == g for d, g in answer.items()):
            return "-".join(d for d in order if grid.sizes[d] > 1)
    return ""


def _diagnose(dim: str, got: list[list[int]], grid: ParallelGrid, where: str) -> str:
    """Why `got` is not grid.groups(dim): the recognisable mistakes first, then the first misplaced rank."""
    world, want = grid.world_size, grid.groups(dim)
    seen = [r for g in got for r in g]
    for r in range(world):
        if seen.count(r) != 1:
            return (f"{where}: rank {r} appears in {seen.count(r)} {dim} groups; the groups of one dimension "
                    f"contain every rank exactly once.\nHint: {ORDER_HINT}")
    if set(seen) != set(range(world)):
        return f"{where}: ranks {sorted(set(seen) - set(range(world)))} do not exist (ranks are 0..{world - 1})."
    if grid.cp > 1 and dim in ("dp", "cp"):
        nocp = ParallelGrid(world, tp=grid.tp, pp=grid.pp)            # cp folded into dp
        if got == nocp.groups("dp") or got == grid.groups("cp-dp"):
            return (f"{where}: your {dim} groups have {len(got[0])} ranks: they are the dp x cp groups "
                    f"{grid.groups('cp-dp')[:2]}..., as if cp were left out (dp = world_size / (tp*pp)).\n"
                    f"Hint: dp = world_size / (tp*cp*pp) = {grid.dp}; a cp group holds the {grid.cp} ranks that "
                    f"share a sequence (tp apart), a dp group the {grid.dp} ranks with the same tp, cp and pp "
                    f"coordinates (tp*cp apart).")
        if dim == "cp" and all(len(g) == 1 for g in got):
            return (f"{where}: every cp group has one rank, as if cp were left out, but cp = {grid.cp}: a cp group "
                    f"holds the {grid.cp} ranks that share one sequence, tp apart.\nHint: {ORDER_HINT}")
    order = _order_of({dim: got}, grid)
    if order:
        return (f"{where}: your {dim} groups are those of rank order {order} (fastest first).\n"
                f"  expected {want}\n  got      {got}\nHint: {ORDER_HINT}")
    for other in DIMS:
        if other != dim and got == grid.groups(other) and grid.groups(other) != want:
            return f"{where}: you returned the {other} groups as the {dim} groups.\nHint: {ORDER_HINT}"
    for r in range(world):
        mine = next(g for g in got if r in g)
        if mine != grid.group_of(r, dim):
            return (f"{where}: rank {r} should be in {dim} group {grid.group_of(r, dim)}, your groups put it in "
                    f"{mine}.\n  expected {want}\n  got      {got}\nHint: {ORDER_HINT}")
    return f"{where}: expected {want}, got {got}."                   # not reached: the loop finds a rank


def _random_layout(public) -> tuple[int, int, int, int]:
    """A (world, tp, cp, pp) drawn at grading time, every dimension > 1 but one at most, dp >= 2."""
    rng = random.Random(fresh_seed())
    choices = [(tp * cp * dp * pp, tp, cp, pp) for tp in (1, 2, 3, 4) for cp in (1, 2, 3) for pp in (1, 2, 3, 4)
               for dp in (2, 3) if sum(x > 1 for x in (tp, cp, pp)) >= 2 and tp * cp * dp * pp <= 48]
    return rng.choice([c for c in choices if c not in public])


@graded("parlab.parallel.topology:ParallelGrid")
def check_groups_4d(fn, layouts=LAYOUTS_4D) -> None:
    """``fn(world_size, tp, cp, pp)`` returns {"tp": groups, "cp": ..., "dp": ..., "pp": ...} equal to
    ``ParallelGrid(world_size, tp=tp, cp=cp, pp=pp).groups(dim)`` (any order of groups and of ranks), on the
    public layouts and on one drawn at grading time (so that answers copied from a run of them do not pass)."""
    layouts = list(layouts) + [_random_layout(layouts)]
    for world, tp, cp, pp in layouts:
        grid = ParallelGrid(world, tp=tp, pp=pp, cp=cp)
        got = call_student(fn, world, tp, cp, pp, what="groups_4d")
        where = f"world_size={world}, tp={tp}, cp={cp}, pp={pp} (so dp={grid.dp})"
        if not isinstance(got, dict) or sorted(got) != sorted(DIMS):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise AssertionError(f"{where}: groups_4d must return a dict with the keys {list(DIMS)}, got {keys}.")
        mine = {dim: _normalise(got[dim], f"{where}, {dim}") for dim in DIMS}
        wrong = [dim for dim in DIMS if mine[dim] != grid.groups(dim)]
        if wrong and _order_of(mine, grid):
            raise AssertionError(
                f"{where}: your groups are those of rank order {_order_of(mine, grid)} (fastest first; wrong: "
                f"{', '.join(wrong)}).\n" + "".join(f"  {d} expected {grid.groups(d)}\n  {d} got      {mine[d]}\n"
                                                  for d in wrong) + f"Hint: {ORDER_HINT}")
        for dim in wrong:
            raise AssertionError(_diagnose(dim, mine[dim], grid, where))
    print(f"tp, cp, dp and pp groups match parlab.parallel.topology (order tp-cp-dp-pp) on {len(layouts)} layouts, "
          f"the last drawn at random")


# ---------------------------------------------------------------------- part 2: choosing a layout
def _model(model) -> ModelSpec:
    return preset(model) if isinstance(model, str) else model


def _describe(e) -> str:
    states = e.params_bytes + e.grads_bytes + e.optimizer_bytes
    return (f"{e.layout}: {e.step_s:.2f} s/step (compute {e.compute_s:.2f}, bubble {e.bubble_s:.2f}, TP {e.tp_s:.2f}, "
            f"DP {e.dp_s:.2f}, PP {e.pp_s:.2f}), {e.total_bytes / GB:.1f} GB per GPU (states {states / GB:.1f}, "
            f"activations {e.activation_bytes / GB:.1f})")


def judge_layout(layout, model, cluster: Cluster, global_batch: int, tolerance: float, what: str = "your layout"):
    """The planner's estimate of `layout` (a dict of tp, pp, cp, micro_batch, zero, recompute; dp optional);
    raises AssertionError unless it is valid, fits, keeps TP in a node and is within `tolerance` of the best.
    Returns (estimate, best estimate)."""
    m = _model(model)
    task = (f"{m.name} ({m.param_count() / 1e9:.1f}B parameters, {m.layers} layers, {m.heads} heads) on "
            f"{cluster.nodes} x {cluster.gpus_per_node} GPUs of {cluster.gpu_mem_gb:g} GB, global batch {global_batch}")
    if not isinstance(layout, dict):
        raise AssertionError(f"{what} must be a dict such as dict(tp=8, pp=2, micro_batch=1, zero=1, "
                             f"recompute=False), got {layout!r}")
    unknown = sorted(set(layout) - set(LAYOUT_KEYS))
    if unknown or "tp" not in layout or "pp" not in layout:
        raise AssertionError(f"{what} {layout}: give tp and pp (and optionally cp, micro_batch, zero, recompute); "
                             f"unknown keys {unknown}" if unknown else f"{what} {layout}: tp and pp are required.")
    lay = dict(cp=1, micro_batch=1, zero=0, recompute=False) | {k: v for k, v in layout.items() if k != "dp"}
    for k in ("tp", "pp", "cp", "micro_batch"):
        if isinstance(lay[k], bool) or not isinstance(lay[k], int) or lay[k] < 1:
            raise AssertionError(f"{what}: {k} must be a positive int, got {lay[k]!r}")
    if lay["zero"] not in (0, 1, 2, 3):
        raise AssertionError(f"{what}: zero is the ZeRO stage 0, 1, 2 or 3, got {lay['zero']!r}")
    lay["recompute"] = bool(lay["recompute"])
    if m.heads % lay["tp"] or m.layers % lay["pp"]:
        raise AssertionError(f"{what} {layout} is not valid for {task}: tp must divide the {m.heads} heads and pp "
                             f"the {m.layers} layers.")
    world = cluster.world
    if world % (lay["tp"] * lay["pp"] * lay["cp"]):
        raise AssertionError(f"{what} {layout}: tp*pp*cp = {lay['tp'] * lay['pp'] * lay['cp']} does not divide the "
                             f"{world} GPUs of {task}.")
    dp = world // (lay["tp"] * lay["pp"] * lay["cp"])
    if "dp" in layout and layout["dp"] != dp:
        raise AssertionError(f"{what} {layout}: dp = GPUs / (tp*pp*cp) = {world} / "
                             f"{lay['tp'] * lay['pp'] * lay['cp']} = {dp}, not {layout['dp']}.")
    if global_batch % (dp * lay["micro_batch"]):
        raise AssertionError(f"{what} {layout}: the global batch {global_batch} must be a multiple of dp * "
                             f"micro_batch = {dp} * {lay['micro_batch']}; each replica runs whole micro-batches.")
    if lay["zero"] and dp * lay["cp"] == 1:
        raise AssertionError(f"{what} {layout}: ZeRO shards over the dp x cp ranks, and here dp*cp = 1; "
                             f"use zero=0 or a layout with dp > 1.")
    e = planner.estimate(m, cluster, global_batch, **lay)
    best = planner.plan(m, cluster, global_batch)[0]
    if not e.fits:
        raise AssertionError(
            f"{what} does not fit on {task}: {e.reason}.\n  {_describe(e)}\nHint: more pp (or tp, inside a node) "
            f"shards the weights and activations; ZeRO (zero=1, 2, 3) shards the gradients and optimizer state over "
            f"dp; recompute=True keeps only each layer's input; a smaller micro_batch keeps fewer activations.")
    if e.crosses["tp"]:
        raise AssertionError(
            f"{what} puts tensor parallelism across nodes: tp={e.tp} > {cluster.gpus_per_node} GPUs per node, so its "
            f"{e.volume['tp'] / GB:.0f} GB per GPU and step of all-reduces cross the {cluster.inter_gbps:g} GB/s "
            f"network instead of {cluster.intra_gbps:g} GB/s NVLink (TP {e.tp_s:.2f} s per step).\nHint: TP sends "
            f"the most (TP > DP > PP): keep tp <= {cluster.gpus_per_node} and let pp (or dp) cross the nodes.")
    if e.step_s > (1 + tolerance) * best.step_s:
        worst = max(("compute_s", "bubble_s", "tp_s", "dp_s", "pp_s", "cp_s"),
                    key=lambda k: getattr(e, k) - getattr(best, k))
        names = {"compute_s": "compute (recomputation costs one more forward pass)", "bubble_s": "pipeline bubble",
                 "tp_s": "TP communication", "dp_s": "exposed DP communication", "pp_s": "PP communication",
                 "cp_s": "CP communication"}
        raise AssertionError(
            f"{what} fits but is slow: {e.step_s:.2f} s per step, {100 * (e.step_s / best.step_s - 1):.0f}% more "
            f"than the best layout the planner finds ({best.step_s:.2f} s); allowed: {100 * tolerance:.0f}%.\n"
            f"  yours {_describe(e)}\n  best  {_describe(best)}\nThe biggest difference: {names[worst]} "
            f"({getattr(e, worst):.2f} s vs {getattr(best, worst):.2f} s).")
    return e, best


@graded("parlab.cluster.planner:enumerate_layouts", "parlab.cluster.planner:plan")
def check_layout(fn, model=LAYOUT_TASK["model"], cluster: Cluster = LAYOUT_TASK["cluster"],
                 global_batch: int = LAYOUT_TASK["global_batch"], tolerance: float = LAYOUT_TASK["tolerance"]) -> None:
    """``fn()`` returns a layout dict for `model` on `cluster`; it must fit, keep TP in a node and be within
    `tolerance` (default 10%) of the planner's best step time."""
    layout = call_student(fn, what="choose_layout")
    e, best = judge_layout(layout, model, cluster, global_batch, tolerance, what="choose_layout()")
    print(f"choose_layout: {e.layout} fits ({e.total_bytes / GB:.1f} GB per GPU), {e.step_s:.2f} s per step, "
          f"{100 * (e.step_s / best.step_s - 1):.1f}% from the planner's best ({best.layout}, {best.step_s:.2f} s)")


def _random_task() -> tuple[str, Cluster, int]:
    """A task from the RANDOM_TASKS pool, drawn at grading time, never one of the public SEARCH_TASKS."""
    rng = random.Random(fresh_seed())
    models, nodes, mem, batches = RANDOM_TASKS
    public = {(m, c.nodes, c.gpu_mem_gb, b) for m, c, b in SEARCH_TASKS}
    pool = [t for t in itertools.product(models, nodes, mem, batches) if t not in public]
    model, n, gb, batch = rng.choice(pool)
    return model, Cluster(nodes=n, gpu_mem_gb=gb), batch


@graded("parlab.cluster.planner:enumerate_layouts", "parlab.cluster.planner:plan")
def check_layout_search(fn, tasks=SEARCH_TASKS, tolerance: float = 0.05) -> None:
    """``fn(model, cluster, global_batch)`` returns a layout dict; on each task (and one drawn at grading time) it
    must fit, keep TP in a node and be within `tolerance` (default 5%) of the planner's best. The planner's own
    search is switched off."""
    tasks = list(tasks) + [_random_task()]
    blocked = {"plan": planner.plan, "enumerate_layouts": planner.enumerate_layouts}

    def refuse(*args, **kwargs):
        raise AssertionError("search_layout called parlab.cluster.planner.plan or enumerate_layouts: write the search "
                             "yourself, with parlab.cluster.planner.estimate for each candidate.")

    scope = getattr(fn, "__globals__", {})
    aliases = [k for k, v in scope.items() if any(v is f for f in blocked.values())]
    lines = []
    for name, cluster, batch in tasks:
        m = _model(name)
        for k in blocked:
            setattr(planner, k, refuse)
        saved = {k: scope[k] for k in aliases}
        scope.update({k: refuse for k in aliases})
        try:
            layout = call_student(fn, m, cluster, batch, what="search_layout")
        finally:
            for k, f in blocked.items():
                setattr(planner, k, f)
            scope.update(saved)
        e, best = judge_layout(layout, m, cluster, batch, tolerance,
                               what=f"search_layout({m.name}, {cluster.nodes} x {cluster.gpus_per_node} GPUs of "
                                    f"{cluster.gpu_mem_gb:g} GB, batch {batch})")
        lines.append(f"  {m.name} on {cluster.world} GPUs: {e.layout}, {e.step_s:.2f} s "
                     f"({100 * (e.step_s / best.step_s - 1):+.1f}% vs the planner's best)")
    print(f"search_layout finds a fitting layout within {100 * tolerance:.0f}% of the best on {len(tasks)} tasks:\n"
          + "\n".join(lines))


protect(__name__)
