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

from parlab.i18n import _
from parlab.cluster import planner
from parlab.cluster.costs import Cluster, ModelSpec, model_preset
from parlab.parallel.topology import DIMS, ParallelGrid
from parlab.course.grading.runner import call_student
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


def _order_hint() -> str:
    return _("Megatron's order is tp-cp-dp-pp, fastest first: rank = tp_rank + tp * (cp_rank + cp * (dp_rank + "
             "dp * pp_rank)). Neighbours along tp are 1 apart, along cp tp apart, along dp tp*cp apart, along pp "
             "tp*cp*dp = world_size/pp apart.")


# ---------------------------------------------------------------------- part 1: groups
def _normalise(groups, where: str) -> list[list[int]]:
    try:
        return sorted(sorted(int(r) for r in g) for g in groups)
    except TypeError:
        raise AssertionError(_("{where}: expected a list of groups, each a list of ranks, got {groups!r}").format(
            where=where, groups=groups)) from None


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
            return _("{where}: rank {r} appears in {count} {dim} groups; the groups of one dimension contain every "
                     "rank exactly once.\nHint: {hint}").format(where=where, r=r, count=seen.count(r), dim=dim,
                                                                hint=_order_hint())
    if set(seen) != set(range(world)):
        return _("{where}: ranks {ranks} do not exist (ranks are 0..{last}).").format(
            where=where, ranks=sorted(set(seen) - set(range(world))), last=world - 1)
    if grid.cp > 1 and dim in ("dp", "cp"):
        nocp = ParallelGrid(world, tp=grid.tp, pp=grid.pp)            # cp folded into dp
        if got == nocp.groups("dp") or got == grid.groups("cp-dp"):
            return _("{where}: your {dim} groups have {n} ranks: they are the dp x cp groups {groups}..., as if cp "
                     "were left out (dp = world_size / (tp*pp)).\nHint: dp = world_size / (tp*cp*pp) = {dp}; a cp "
                     "group holds the {cp} ranks that share a sequence (tp apart), a dp group the {dp} ranks with the "
                     "same tp, cp and pp coordinates (tp*cp apart).").format(
                where=where, dim=dim, n=len(got[0]), groups=grid.groups("cp-dp")[:2], dp=grid.dp, cp=grid.cp)
        if dim == "cp" and all(len(g) == 1 for g in got):
            return _("{where}: every cp group has one rank, as if cp were left out, but cp = {cp}: a cp group holds "
                     "the {cp} ranks that share one sequence, tp apart.\nHint: {hint}").format(
                where=where, cp=grid.cp, hint=_order_hint())
    order = _order_of({dim: got}, grid)
    if order:
        return _("{where}: your {dim} groups are those of rank order {order} (fastest first).\n  expected {want}\n"
                 "  got      {got}\nHint: {hint}").format(where=where, dim=dim, order=order, want=want, got=got,
                                                          hint=_order_hint())
    for other in DIMS:
        if other != dim and got == grid.groups(other) and grid.groups(other) != want:
            return _("{where}: you returned the {other} groups as the {dim} groups.\nHint: {hint}").format(
                where=where, other=other, dim=dim, hint=_order_hint())
    for r in range(world):
        mine = next(g for g in got if r in g)
        if mine != grid.group_of(r, dim):
            return _("{where}: rank {r} should be in {dim} group {group}, your groups put it in {mine}.\n"
                     "  expected {want}\n  got      {got}\nHint: {hint}").format(
                where=where, r=r, dim=dim, group=grid.group_of(r, dim), mine=mine, want=want, got=got,
                hint=_order_hint())
    return _("{where}: expected {want}, got {got}.").format(where=where, want=want, got=got)   # not reached


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
        where = _("world_size={world}, tp={tp}, cp={cp}, pp={pp} (so dp={dp})").format(
            world=world, tp=tp, cp=cp, pp=pp, dp=grid.dp)
        if not isinstance(got, dict) or sorted(got) != sorted(DIMS):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise AssertionError(_("{where}: groups_4d must return a dict with the keys {dims}, got {keys}.").format(
                where=where, dims=list(DIMS), keys=keys))
        mine = {dim: _normalise(got[dim], f"{where}, {dim}") for dim in DIMS}
        wrong = [dim for dim in DIMS if mine[dim] != grid.groups(dim)]
        if wrong and _order_of(mine, grid):
            raise AssertionError(
                _("{where}: your groups are those of rank order {order} (fastest first; wrong: {wrong}).").format(
                    where=where, order=_order_of(mine, grid), wrong=", ".join(wrong)) + "\n"
                + "".join(_("  {d} expected {want}\n  {d} got      {got}\n").format(d=d, want=grid.groups(d),
                                                                                    got=mine[d]) for d in wrong)
                + _("Hint: {hint}").format(hint=_order_hint()))
        for dim in wrong:
            raise AssertionError(_diagnose(dim, mine[dim], grid, where))
    print(_("tp, cp, dp and pp groups match parlab.parallel.topology (order tp-cp-dp-pp) on {n} layouts, the last "
            "drawn at random").format(n=len(layouts)))


# ---------------------------------------------------------------------- part 2: choosing a layout
def _model(model) -> ModelSpec:
    return model_preset(model) if isinstance(model, str) else model


def _describe(e) -> str:
    states = e.params_bytes + e.grads_bytes + e.optimizer_bytes
    return _("{layout}: {step:.2f} s/step (compute {compute:.2f}, bubble {bubble:.2f}, TP {tp:.2f}, DP {dp:.2f}, "
             "PP {pp:.2f}), {total:.1f} GB per GPU (states {states:.1f}, activations {activations:.1f})").format(
        layout=e.layout, step=e.step_s, compute=e.compute_s, bubble=e.bubble_s, tp=e.tp_s, dp=e.dp_s, pp=e.pp_s,
        total=e.total_bytes / GB, states=states / GB, activations=e.activation_bytes / GB)


def judge_layout(layout, model, cluster: Cluster, global_batch: int, tolerance: float, what: str | None = None):
    """The planner's estimate of `layout` (a dict of tp, pp, cp, micro_batch, zero, recompute; dp optional);
    raises AssertionError unless it is valid, fits, keeps TP in a node and is within `tolerance` of the best.
    Returns (estimate, best estimate)."""
    what = what or _("your layout")
    m = _model(model)
    task = _("{model} ({params:.1f}B parameters, {layers} layers, {heads} heads) on {nodes} x {gpus} GPUs of {mem:g} "
             "GB, global batch {batch}").format(model=m.name, params=m.param_count() / 1e9, layers=m.layers,
                                                heads=m.heads, nodes=cluster.nodes, gpus=cluster.gpus_per_node,
                                                mem=cluster.gpu_mem_gb, batch=global_batch)
    if not isinstance(layout, dict):
        raise AssertionError(_("{what} must be a dict such as dict(tp=8, pp=2, micro_batch=1, zero=1, "
                               "recompute=False), got {layout!r}").format(what=what, layout=layout))
    unknown = sorted(set(layout) - set(LAYOUT_KEYS))
    if unknown or "tp" not in layout or "pp" not in layout:
        raise AssertionError(_("{what} {layout}: give tp and pp (and optionally cp, micro_batch, zero, recompute); "
                               "unknown keys {unknown}").format(what=what, layout=layout, unknown=unknown) if unknown
                             else _("{what} {layout}: tp and pp are required.").format(what=what, layout=layout))
    lay = dict(cp=1, micro_batch=1, zero=0, recompute=False) | {k: v for k, v in layout.items() if k != "dp"}
    for k in ("tp", "pp", "cp", "micro_batch"):
        if isinstance(lay[k], bool) or not isinstance(lay[k], int) or lay[k] < 1:
            raise AssertionError(_("{what}: {key} must be a positive int, got {value!r}").format(
                what=what, key=k, value=lay[k]))
    if lay["zero"] not in (0, 1, 2, 3):
        raise AssertionError(_("{what}: zero is the ZeRO stage 0, 1, 2 or 3, got {value!r}").format(
            what=what, value=lay["zero"]))
    lay["recompute"] = bool(lay["recompute"])
    if m.heads % lay["tp"] or m.layers % lay["pp"]:
        raise AssertionError(_("{what} {layout} is not valid for {task}: tp must divide the {heads} heads and pp the "
                               "{layers} layers.").format(what=what, layout=layout, task=task, heads=m.heads,
                                                          layers=m.layers))
    world = cluster.world
    model_ranks = lay["tp"] * lay["pp"] * lay["cp"]
    if world % model_ranks:
        raise AssertionError(_("{what} {layout}: tp*pp*cp = {n} does not divide the {world} GPUs of {task}.").format(
            what=what, layout=layout, n=model_ranks, world=world, task=task))
    dp = world // model_ranks
    if "dp" in layout and layout["dp"] != dp:
        raise AssertionError(_("{what} {layout}: dp = GPUs / (tp*pp*cp) = {world} / {n} = {dp}, not {got}.").format(
            what=what, layout=layout, world=world, n=model_ranks, dp=dp, got=layout["dp"]))
    if global_batch % (dp * lay["micro_batch"]):
        raise AssertionError(_("{what} {layout}: the global batch {batch} must be a multiple of dp * micro_batch = "
                               "{dp} * {mb}; each replica runs whole micro-batches.").format(
            what=what, layout=layout, batch=global_batch, dp=dp, mb=lay["micro_batch"]))
    if lay["zero"] and dp * lay["cp"] == 1:
        raise AssertionError(_("{what} {layout}: ZeRO shards over the dp x cp ranks, and here dp*cp = 1; use zero=0 or "
                               "a layout with dp > 1.").format(what=what, layout=layout))
    e = planner.estimate(m, cluster, global_batch, **lay)
    best = planner.plan(m, cluster, global_batch)[0]
    if not e.fits:
        raise AssertionError(_(
            "{what} does not fit on {task}: {reason}.\n  {estimate}\nHint: more pp (or tp, inside a node) shards the "
            "weights and activations; ZeRO (zero=1, 2, 3) shards the gradients and optimizer state over dp; "
            "recompute=True keeps only each layer's input; a smaller micro_batch keeps fewer activations.").format(
            what=what, task=task, reason=e.reason, estimate=_describe(e)))
    if e.crosses["tp"]:
        raise AssertionError(_(
            "{what} puts tensor parallelism across nodes: tp={tp} > {gpus} GPUs per node, so its {volume:.0f} GB per "
            "GPU and step of all-reduces cross the {inter:g} GB/s network instead of {intra:g} GB/s NVLink (TP "
            "{tp_s:.2f} s per step).\nHint: TP sends the most (TP > DP > PP): keep tp <= {gpus} and let pp (or dp) "
            "cross the nodes.").format(what=what, tp=e.tp, gpus=cluster.gpus_per_node, volume=e.volume["tp"] / GB,
                                       inter=cluster.inter_gbps, intra=cluster.intra_gbps, tp_s=e.tp_s))
    if e.step_s > (1 + tolerance) * best.step_s:
        worst = max(("compute_s", "bubble_s", "tp_s", "dp_s", "pp_s", "cp_s"),
                    key=lambda k: getattr(e, k) - getattr(best, k))
        names = {"compute_s": _("compute (recomputation costs one more forward pass)"),
                 "bubble_s": _("pipeline bubble"), "tp_s": _("TP communication"),
                 "dp_s": _("exposed DP communication"), "pp_s": _("PP communication"), "cp_s": _("CP communication")}
        raise AssertionError(_(
            "{what} fits but is slow: {step:.2f} s per step, {more:.0f}% more than the best layout the planner finds "
            "({best:.2f} s); allowed: {allowed:.0f}%.\n  yours {yours}\n  best  {best_estimate}\nThe biggest "
            "difference: {worst} ({mine:.2f} s vs {theirs:.2f} s).").format(
            what=what, step=e.step_s, more=100 * (e.step_s / best.step_s - 1), best=best.step_s,
            allowed=100 * tolerance, yours=_describe(e), best_estimate=_describe(best), worst=names[worst],
            mine=getattr(e, worst), theirs=getattr(best, worst)))
    return e, best


@graded("parlab.cluster.planner:enumerate_layouts", "parlab.cluster.planner:plan")
def check_layout(fn, model=LAYOUT_TASK["model"], cluster: Cluster = LAYOUT_TASK["cluster"],
                 global_batch: int = LAYOUT_TASK["global_batch"], tolerance: float = LAYOUT_TASK["tolerance"]) -> None:
    """``fn()`` returns a layout dict for `model` on `cluster`; it must fit, keep TP in a node and be within
    `tolerance` (default 10%) of the planner's best step time."""
    layout = call_student(fn, what="choose_layout")
    e, best = judge_layout(layout, model, cluster, global_batch, tolerance, what="choose_layout()")
    print(_("choose_layout: {layout} fits ({gb:.1f} GB per GPU), {step:.2f} s per step, {off} from the planner's "
            "best ({best}, {best_step:.2f} s)").format(layout=e.layout, gb=e.total_bytes / GB, step=e.step_s,
                                                       off=f"{100 * (e.step_s / best.step_s - 1):.1f}%",
                                                       best=best.layout, best_step=best.step_s))


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
        raise AssertionError(_("search_layout called parlab.cluster.planner.plan or enumerate_layouts: write the "
                               "search yourself, with parlab.cluster.planner.estimate for each candidate."))

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
                               what=_("search_layout({model}, {nodes} x {gpus} GPUs of {mem:g} GB, batch "
                                      "{batch})").format(model=m.name, nodes=cluster.nodes,
                                                         gpus=cluster.gpus_per_node, mem=cluster.gpu_mem_gb,
                                                         batch=batch))
        lines.append(_("  {model} on {gpus} GPUs: {layout}, {step:.2f} s ({off:+.1f}% vs the planner's best)").format(
            model=m.name, gpus=cluster.world, layout=e.layout, step=e.step_s, off=100 * (e.step_s / best.step_s - 1)))
    print(_("search_layout finds a fitting layout within {tol} of the best on {n} tasks:").format(
        tol=f"{100 * tolerance:.0f}%", n=len(tasks)) + "\n" + "\n".join(lines))


protect(__name__)
