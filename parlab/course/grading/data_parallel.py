"""Checks for exercise 02: DDP's gradient synchronisation, written by the student.

The student writes (exercises/solutions/02_ddp.ipynb):

* ``attach_grad_hooks(model)``: a post-accumulate-grad hook on every trainable
  parameter that all-reduces its gradient and divides by the world size;
* ``make_buckets(nbytes, cap_bytes)``: the greedy bucket layout (pure);
* ``BucketedGradSync(model, bucket_cap_bytes)``: gradients copied into flat
  buckets from the hooks, one asynchronous all-reduce per bucket launched as
  soon as the bucket is full, and ``finish()`` that waits, averages and writes
  ``p.grad`` back.

Every check trains the same tiny float64 GPT (tied embeddings, the position
table frozen) on simulated ranks, each rank on its slice of the global batch,
and compares every rank's gradients with one process on the whole batch
(`reference_grads`), the ground truth of data parallelism:
grad L = 1/N sum_r grad L_r. The trace counts the all-reduces: one per
parameter for the hooks, one per bucket (`parlab.parallel.data.buckets.assign_buckets`
layout, reverse registration order) for the buckets.
"""
from __future__ import annotations

import random

import torch

from parlab import comm
from parlab.corpus import BatchSampler, load_corpus
from parlab.parallel.data import assign_buckets
from parlab.models import GPT, GPTConfig
from parlab.i18n import _
from parlab.trace import mark
from parlab.course.grading.runner import TIMEOUT, call_student, run_student
from parlab.course.grading.guard import fresh_seed, graded, protect

__all__ = ["CFG", "FROZEN", "grader_model", "global_batch", "reference_grads", "check_hook_grads",
           "check_hook_all_reduce_calls", "check_make_buckets", "check_bucketed_grads",
           "check_bucketed_all_reduce_calls"]

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, n_embd=16)   # ~8k parameters, tied lm_head
FROZEN = ("wpe.weight",)        # requires_grad=False: must never be hooked or reduced
BATCH = 12                      # global batch, divisible by 2, 3 and 4 ranks
STEPS = 2                       # the second step catches state left over from the first
WORLD_SIZES = (2, 4)
# float64 everywhere; the ranks sum the same per-sample gradients in another order than one process does,
# so results agree to rounding (~1e-16 relative), far below any real mistake (a factor N, a missing rank)
TOL = dict(rtol=1e-9, atol=1e-12)

GRADER_REFS = (   # the grader's own answers: unavailable to the student's code while a check runs
    "parlab.course.grading.data_parallel:reference_grads",
    "parlab.course.grading.data_parallel:local_grads",
    "parlab.course.grading.data_parallel:bucket_layout",
)
HOOK_REFS = ("parlab.parallel.data.ddp:DistributedDataParallel", "parlab.parallel.data.naive:NaiveDataParallel", *GRADER_REFS)
BUCKET_REFS = ("parlab.parallel.data.buckets:assign_buckets", "parlab.parallel.data.buckets:GradBucket",
               "parlab.parallel.data.ddp:DistributedDataParallel", *GRADER_REFS)



def _hook_hint() -> str:
    return _("in the hook, comm.all_reduce(p.grad) sums the gradient over the ranks in place; then divide it by "
             "comm.get_world_size() so that every rank holds the average, the gradient of the whole batch.")


def _bucket_hint() -> str:
    return _("in on_grad_ready copy p.grad into its slice of the bucket's buffer and count it; when the bucket "
             "has all its gradients launch comm.all_reduce(buffer, async_op=True); in finish() wait for each "
             "bucket, divide by the world size and copy each slice back into p.grad; then reset the counters.")


# ---------------------------------------------------------------------- the model, the data, the reference
def grader_model() -> GPT:
    """The same float64 tiny GPT on every rank (seed 0), with the position table frozen."""
    model = GPT(CFG, seed=0, dtype=torch.float64)
    for name in FROZEN:
        model.get_parameter(name).requires_grad_(False)
    return model


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]   # a tied weight appears once


def global_batch(step: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step; the checks pass a `seed` drawn at grading time, so that the whole batch's
    gradients cannot be recomputed on one rank from public data instead of being communicated."""
    return BatchSampler(load_corpus(20_000), BATCH, CFG.seq_len, seed=seed).global_batch(step)   # (B, S) each


def reference_grads(steps: int = STEPS, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    """One process, the whole batch: the gradients of each step (the weights do not change between steps)."""
    model = grader_model()
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        model(*global_batch(step, seed))[1].backward()
        out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    return out


def local_grads(rank: int, world: int, step: int = 0, seed: int = 2) -> dict[str, torch.Tensor]:
    """The gradients rank `rank` computes on its own slice, before any communication."""
    model = grader_model()
    x, y = global_batch(step, seed)
    b = BATCH // world
    model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])[1].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------------- what runs on every rank
def _rank_train(setup, bucketed: bool, steps: int, seed: int, *setup_args):
    """Build the model, let the student's code attach to it, run `steps` backward passes on this rank's slice.
    Returns {"grads": [per step {name: grad}], "error": (step, type, message) or None}."""
    rank, world = comm.get_rank(), comm.get_world_size()
    model = grader_model()
    sync = setup(model, *setup_args)
    b = BATCH // world
    grads, error = [], None
    for step in range(steps):
        x, y = global_batch(step, seed)
        try:
            model(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])[1].backward()
            mark("backward done")
            if bucketed:
                sync.finish()
        except Exception as e:          # a failure in a later step is explained by the check, with its step
            if step == 0:
                raise
            error = (step, type(e).__name__, str(e))
            break
        grads.append({n: None if p.grad is None else p.grad.detach().clone()
                      for n, p in model.named_parameters() if p.requires_grad})
        model.zero_grad(set_to_none=True)
    return {"grads": grads, "error": error}


def _hooks(model, student_fn):
    student_fn(model)


def _bucketed(model, student_cls, cap_bytes):
    return student_cls(model, cap_bytes)


# ---------------------------------------------------------------------- comparing gradients
def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def _explain_grad(got, want, rank, world, step, name, hint, what, seed) -> str:
    where = _("{what} on {world} ranks, step {step}: rank {rank}, gradient of {name}").format(
        what=what, world=world, step=step, rank=rank, name=name)
    if got is None:
        return _("{where} is None: nothing was written into p.grad (or it was set to None).\nHint: {hint}").format(
            where=where, hint=hint)
    if got.shape != want.shape:
        return _("{where} has shape {shape}, expected {want}.\nHint: {hint}").format(
            where=where, shape=tuple(got.shape), want=tuple(want.shape), hint=hint)
    mine = local_grads(rank, world, step, seed)[name]
    diagnosis = _("It is not the average of the ranks' gradients.")
    if _close(got, want * world):
        diagnosis = _("It is the SUM over the ranks, not the average: divide by the world size.")
    elif _close(got, mine):
        diagnosis = _("It is this rank's own gradient: the all-reduce did not happen (or did not land in p.grad).")
    elif _close(got, mine / world):
        diagnosis = _("It is this rank's own gradient divided by the world size: the all-reduce is missing.")
    elif _close(got, want / world):
        diagnosis = _("It is the average divided by the world size once more: divide only once.")
    elif torch.count_nonzero(got) == 0:
        diagnosis = _("It is all zeros: the averaged values were never copied back into p.grad.")
    err = (got - want).abs().max().item()
    return _("{where} is wrong (largest error {err:.3g}):\n  expected {want}\n  got      {got}\n{why}\n"
             "Hint: {hint}").format(where=where, err=err, want=_show(want), got=_show(got), why=diagnosis, hint=hint)


def _show(t: torch.Tensor, k: int = 4) -> str:
    flat = t.reshape(-1)
    vals = ", ".join(f"{v:.6g}" for v in flat[:k].tolist())
    return f"[{vals}{', ...' if flat.numel() > k else ''}]"


def _compare_runs(results, world, want_steps, hint, what, seed, label="") -> None:
    for rank, res in enumerate(results):
        for step, (got, want) in enumerate(zip(res["grads"], want_steps)):
            for name, w in want.items():
                g = got.get(name)
                if g is None or not _close(g, w):
                    msg = _explain_grad(g, w, rank, world, step, name, hint, what + label, seed)
                    if step > 0:
                        msg += "\n" + _("Step 0 was right, so something kept from the previous step is wrong: "
                                         "reset the per-step state (arrival counters, pending works) at the end of "
                                         "finish(), and read p.grad afresh in every hook.")
                    raise AssertionError(msg)
        if res["error"] is not None:
            step, kind, message = res["error"]
            raise AssertionError(_("{what} on {world} ranks: step 0 was right, but step {step} raised {exc} on rank "
                                   "{rank}: {error}\nHint: reset the per-step state (arrival counters, pending "
                                   "works) at the end of finish(), so that the next backward starts afresh.").format(
                what=what + label, world=world, step=step, exc=kind, rank=rank, error=message))


# ---------------------------------------------------------------------- part 1: a hook per parameter
@graded(*HOOK_REFS)
def check_hook_grads(fn, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """After ``fn(model)`` and a backward on each rank's slice, every p.grad equals the whole-batch gradient."""
    for n in world_sizes:
        seed = fresh_seed()
        want = reference_grads(STEPS, seed)
        res = run_student(_rank_train, n, _hooks, False, STEPS, seed, fn, timeout=timeout, what="attach_grad_hooks")
        _compare_runs(res.results, n, want, _hook_hint(), "attach_grad_hooks", seed)
    print(_("attach_grad_hooks: every rank holds the whole-batch gradient on {sizes} ranks").format(
        sizes=", ".join(map(str, world_sizes))))


def _payloads(events) -> list[int]:
    return sorted(e.nbytes for e in events)


@graded(*HOOK_REFS)
def check_hook_all_reduce_calls(fn, world_size: int = 2, timeout: float = TIMEOUT) -> None:
    """From the trace: one all-reduce per trainable parameter per backward, of that parameter's size; the frozen
    parameter is never reduced, and nothing else is communicated."""
    model = grader_model()
    sizes = sorted(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    res = run_student(_rank_train, world_size, _hooks, False, 1, fresh_seed(), fn, timeout=timeout,
                      what="attach_grad_hooks")
    n_params = len(sizes)
    for r in range(world_size):
        events = res.trace.filter(rank=r).comm().events
        others = sorted({e.op for e in events if e.op != "all_reduce"})
        if others:
            raise AssertionError(_("rank {r} called comm.{ops}; gradient averaging needs only comm.all_reduce (sum), "
                                   "followed by a division.").format(r=r, ops=", comm.".join(others)))
        got = _payloads(events)
        if len(got) != n_params:
            more = (_("more: is a gradient reduced twice (a hook registered twice, or a hook that reduces every "
                      "parameter)?") if len(got) > n_params else
                    _("fewer: does every trainable parameter get a hook (model.parameters() with requires_grad)?"))
            raise AssertionError(_("rank {r} made {calls} all-reduce calls in one backward; the model has {n} "
                                   "trainable parameters (the tied embedding counts once, {frozen} is frozen), so "
                                   "expected {n}, one per parameter. You made {more}").format(
                r=r, calls=len(got), n=n_params, frozen=FROZEN[0], more=more))
        if got != sizes:
            raise AssertionError(_("rank {r}: the all-reduce payloads {got}... bytes are not the parameters' sizes "
                                   "{sizes}...; all-reduce p.grad itself, once per parameter.").format(
                r=r, got=got[:6], sizes=sizes[:6]))
    print(_("attach_grad_hooks: {n} all-reduces per backward on each rank, one per trainable parameter").format(
        n=n_params))


# ---------------------------------------------------------------------- part 2: buckets
BUCKET_CASES = (      # (nbytes, cap): what a greedy bucketing must do, edge cases included
    ([4, 4, 4], 8),
    ([16, 4, 4], 8),             # an item larger than the cap: a bucket of its own
    ([3, 5, 2, 6, 1], 8),        # exact fits: 3 + 5 == 8 stays together
    ([4, 4, 4, 4, 4], 100),      # everything in one bucket
    ([4, 4, 4], 1),              # one bucket per item
    ([1, 2, 3, 4, 5, 6, 7], 7),
)


def _random_bucket_cases(k: int = 3) -> list[tuple[list[int], int]]:
    """`k` cases drawn at grading time (so the answers cannot be copied from a run): 3-12 items of 1-64 bytes."""
    rng = random.Random(fresh_seed())
    return [([rng.randint(1, 64) for _item in range(rng.randint(3, 12))], rng.randint(1, 100)) for _case in range(k)]


@graded("parlab.parallel.data.buckets:assign_buckets", *GRADER_REFS)
def check_make_buckets(fn) -> None:
    """``make_buckets(nbytes, cap_bytes)`` equals the greedy layout of `parlab.parallel.data.buckets.assign_buckets`, on the
    edge cases and on cases drawn at grading time."""
    for nbytes, cap in list(BUCKET_CASES) + _random_bucket_cases():
        want = assign_buckets(nbytes, ["same dtype"] * len(nbytes), cap)
        got = call_student(fn, list(nbytes), cap, what="make_buckets")
        try:
            got = [[int(i) for i in b] for b in got]
        except TypeError:
            raise AssertionError(_("make_buckets({nbytes}, {cap}) returned {got!r}; expected a list of buckets, "
                                   "each a list of item indices, e.g. {want}").format(
                nbytes=nbytes, cap=cap, got=got, want=want)) from None
        if got != want:
            raise AssertionError(_(
                "make_buckets({nbytes}, cap_bytes={cap}):\n  expected {want}\n  got      {got}\nHint: go through "
                "the items in order and keep adding to the current bucket while its total stays <= cap_bytes; "
                "start a new bucket when the next item would go over (an item bigger than the cap gets a bucket "
                "of its own). Every index appears once, in order.").format(nbytes=nbytes, cap=cap, want=want, got=got))
    print(_("make_buckets matches the greedy layout on {n} edge cases and 3 random ones").format(n=len(BUCKET_CASES)))


def bucket_layout(cap_bytes: int) -> list[list[str]]:
    """The reference buckets of the grader model: names, reverse registration order, greedy up to the cap."""
    model = grader_model()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
    layout = assign_buckets([p.numel() * p.element_size() for _name, p in named], ["f"] * len(named), cap_bytes)
    return [[named[i][0] for i in idx] for idx in layout]


def _caps() -> dict[str, int]:
    total = sum(p.numel() * p.element_size() for p in grader_model().parameters() if p.requires_grad)
    return {"one bucket": 2 * total, "a few buckets": total // 3, "one bucket per parameter": 1}


def _cap_name(name: str) -> str:
    """A key of `_caps` as the student reads it."""
    return {"one bucket": _("one bucket"), "a few buckets": _("a few buckets"),
            "one bucket per parameter": _("one bucket per parameter")}[name]


def _rank_caps(student_cls, caps, seed):
    return {name: _rank_train(_bucketed, True, STEPS, seed, student_cls, cap) for name, cap in caps.items()}


@graded(*BUCKET_REFS)
def check_bucketed_grads(cls, world_sizes=WORLD_SIZES, timeout: float = TIMEOUT) -> None:
    """With one bucket, a few, and one per parameter: after backward and ``finish()`` every p.grad equals the
    whole-batch gradient, on every rank, two steps in a row."""
    caps = _caps()
    for n in world_sizes:
        seed = fresh_seed()
        want = reference_grads(STEPS, seed)
        res = run_student(_rank_caps, n, cls, caps, seed, timeout=timeout, what="BucketedGradSync")
        for name, cap in caps.items():
            _compare_runs([r[name] for r in res.results], n, want, _bucket_hint(), "BucketedGradSync", seed,
                          f" (bucket_cap_bytes={cap}: {_cap_name(name)})")
    print(_("BucketedGradSync: whole-batch gradients on {sizes} ranks with one bucket, a few, and one per parameter, "
            "two steps each").format(sizes=", ".join(map(str, world_sizes))))


@graded(*BUCKET_REFS)
def check_bucketed_all_reduce_calls(cls, world_size: int = 2, timeout: float = TIMEOUT) -> None:
    """From the trace: one asynchronous all-reduce per bucket per step, of the bucket's size, launched during
    backward (from the hooks), bucket 0 first."""
    cap = _caps()["a few buckets"]
    layout = bucket_layout(cap)
    model = grader_model()
    size = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    want = [sum(size[n] for n in bucket) for bucket in layout]            # bytes of each bucket, in order
    res = run_student(_rank_train, world_size, _bucketed, True, STEPS, fresh_seed(), cls, cap, timeout=timeout,
                      what="BucketedGradSync")
    for r in range(world_size):
        tr = res.trace.filter(rank=r)
        reduces = tr.filter(op="all_reduce").events
        others = sorted({e.op for e in tr.comm().events if e.op != "all_reduce"})
        if others:
            raise AssertionError(_("rank {r} called comm.{ops}; use only comm.all_reduce.").format(
                r=r, ops=", comm.".join(others)))
        if len(reduces) != STEPS * len(want):
            per = len(reduces) / STEPS
            why = (_(" That is one per parameter: all-reduce the bucket's flat buffer, not each gradient.")
                   if per == sum(len(b) for b in layout) else "")
            raise AssertionError(_("rank {r} made {per:g} all-reduce calls per step with bucket_cap_bytes={cap}; the "
                                   "layout has {n} buckets {layout}, so expected {n}, one per bucket.{why}\n"
                                   "Hint: {hint}").format(r=r, per=per, cap=cap, n=len(want), layout=layout, why=why,
                                                          hint=_bucket_hint()))
        got = [e.nbytes for e in reduces[:len(want)]]
        if got != want:
            raise AssertionError(_("rank {r}: the all-reduces of one step carry {got} bytes, in launch order; the "
                                   "buckets hold {want} bytes (bucket 0 first). Reduce each bucket's whole flat "
                                   "buffer once, when it is full.").format(r=r, got=got, want=want))
        if not all(e.asynchronous for e in reduces):
            raise AssertionError(_("rank {r}: the bucket all-reduces were blocking. Launch them with "
                                   "comm.all_reduce(buffer, async_op=True), keep the returned work, and call "
                                   "work.wait() in finish(): that is what lets communication overlap backward.").format(
                r=r))
        done = [e.start for e in tr.filter(op="backward done", kind="mark").events]
        if done and reduces[0].start > done[0]:
            raise AssertionError(_("rank {r}: the first bucket's all-reduce started after backward had finished. "
                                   "Launch each bucket from on_grad_ready as soon as its last gradient arrives, so it "
                                   "travels while backward computes the earlier layers; finish() only waits.").format(
                r=r))
    print(_("BucketedGradSync: {n} asynchronous all-reduces per step ({want} bytes), one per bucket, the first "
            "launched during backward").format(n=len(want), want=want))


protect(__name__)
