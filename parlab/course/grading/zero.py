"""Checks for exercise 03 (ZeRO): the ZeRO-1 step written by hand, and the ZeRO memory formulas.

The student writes

    partition(flat, rank, world_size)       this rank's shard of a flat vector, zero-padded to N equal pieces
    Zero1(params, **adamw_kwargs).step()    ZeRO-1 around torch.optim.AdamW: reduce-scatter the averaged
                                            gradients, step the local shard, all-gather the parameters
    zero_memory(psi, nd, stage, param_bytes, grad_bytes, k)   {'params', 'grads', 'optimizer'} bytes per GPU

and each check compares with parlab's reference: `check_zero1_step` trains a float64 tiny GPT for a few steps on
simulated ranks and compares every parameter with single-process AdamW on the full batch;
`check_zero1_memory_and_traffic` counts the optimizer state each rank holds and the bytes it sent (trace);
`check_memory_formulas` compares with `parlab.parallel.zero.memory.model_state_bytes` and the ZeRO paper's figure 1;
`check_memory_measured` measures the bytes real parlab ranks hold at every stage (DP, ZeRO-1/2 with
`parlab.parallel.zero.optimizer.ShardedOptimizer`, ZeRO-3 with `parlab.parallel.zero.fsdp.FullyShardedDataParallel`) and compares the student's
formula with fp32 AdamW byte widths (4 + 4 + 8).

References: Rajbhandari et al., "ZeRO", arXiv:1910.02054, sections 3, 5 and 7; torch ZeroRedundancyOptimizer.
"""
from __future__ import annotations

import math
import random

import torch

from parlab import comm
from parlab.i18n import _
from parlab.corpus import BatchSampler, load_corpus
from parlab.parallel.zero import FullyShardedDataParallel
from parlab.parallel.zero import STAGES, measure, model_state_bytes
from parlab.models import GPT, GPTConfig
from parlab.parallel.zero import ShardedOptimizer
from parlab.course.grading.runner import TIMEOUT, call_student, run_student
from parlab.course.grading.guard import fresh_seed, graded, protect

ZERO1_REFS = (   # parlab's own answers: unavailable to the student's code while these checks run
    "parlab.parallel.zero.optimizer:ShardedOptimizer",
    "parlab.parallel.zero.fsdp:FullyShardedDataParallel",
    "parlab.course.grading.zero:reference_partition",
    "parlab.course.grading.zero:reference_adamw",
)

__all__ = ["check_partition", "check_zero1_step", "check_zero1_memory_and_traffic", "check_memory_formulas",
           "check_memory_measured", "reference_partition", "reference_adamw", "CFG", "ADAMW"]

# vocab 65 makes psi = 28,064: not a multiple of 3, so the 3-rank run needs padding
CFG = GPTConfig(vocab_size=65, seq_len=16, n_layer=2, n_head=2, n_embd=32)
ADAMW = dict(lr=1e-2, weight_decay=0.1)
BATCH, STEPS = 12, 3                   # 12 rows: divisible by 2, 3 and 4 ranks
# float64: only the order of the additions differs from one process (mean of per-rank means, averaged in
# the reduce-scatter), ~1e-16 relative; AdamW divides by sqrt(v) and may amplify that a little over 3 steps.
ATOL = 1e-10
PARTS = ("params", "grads", "optimizer")


def _sampler(seed: int = 1) -> BatchSampler:
    """The checks pass a `seed` drawn at grading time: the full batch's AdamW steps cannot be precomputed."""
    return BatchSampler(load_corpus(4000), batch_size=BATCH, seq_len=CFG.seq_len, seed=seed)


def _model() -> GPT:
    return GPT(CFG, seed=0, dtype=torch.float64)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


# ---------------------------------------------------------------------- references
def reference_partition(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Zero-pad `flat` to N * s elements, s = ceil(numel / N), and return elements [rank s, (rank + 1) s)."""
    s = -(-flat.numel() // world_size)
    padded = torch.zeros(world_size * s, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return padded[rank * s:(rank + 1) * s]


def reference_adamw(steps: int = STEPS, grad_scale: float = 1.0, seed: int = 1) -> list[torch.Tensor]:
    """Flat parameters after each step of single-process AdamW on the full batch (grad_scale: a wrong variant)."""
    model, sampler = _model(), _sampler(seed)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    out = []
    for step in range(steps):
        x, y = sampler.global_batch(step)
        model(x, y)[1].backward()
        if grad_scale != 1.0:
            for p in model.parameters():
                p.grad *= grad_scale
        opt.step()
        opt.zero_grad()
        out.append(_flat(model.parameters()).clone())
    return out


# ---------------------------------------------------------------------- part 1: partition
@graded("parlab.parallel.zero.optimizer:partition_parameters", "parlab.course.grading.zero:reference_partition",
        "parlab.course.grading.fsdp:shard_of")
def check_partition(fn) -> None:
    """``fn(flat, rank, world_size)`` returns rank's shard: equal lengths ceil(numel / N), zero padding at the end."""
    hint = _("s = ceil(numel / N) (in Python: -(-numel // N)); pad flat with zeros to N * s elements "
             "(torch.nn.functional.pad or torch.cat with torch.zeros), then take elements [rank * s, (rank + 1) * s).")
    cases = [(12, 4), (13, 4), (10, 3), (7, 2), (3, 4), (1, 2)]
    for numel, n in cases:
        flat = torch.arange(1, numel + 1, dtype=torch.float64)          # 1..numel: padding zeros stand out
        shards = [call_student(fn, flat.clone(), r, n, what="partition") for r in range(n)]
        want = [reference_partition(flat, r, n) for r in range(n)]
        where = _("partition of {numel} elements over {n} ranks").format(numel=numel, n=n)
        for r, (got, ref) in enumerate(zip(shards, want)):
            if not isinstance(got, torch.Tensor):
                raise AssertionError(_("{where}: rank {r} returned {kind}, expected a tensor.").format(
                    where=where, r=r, kind=type(got).__name__))
            if got.numel() != ref.numel():
                raise AssertionError(_(
                    "{where}: rank {r}'s shard has {got} elements, expected s = ceil({numel}/{n}) = {s} on every "
                    "rank. All shards must be equally long so that one all-gather of equal pieces rebuilds the vector "
                    "(gloo cannot gather unequal sizes).\nHint: {hint}").format(
                    where=where, r=r, got=got.numel(), numel=numel, n=n, s=ref.numel(), hint=hint))
            if not torch.equal(got.reshape(-1).to(ref.dtype), ref):
                if torch.equal(got.reshape(-1), flat[r::n][:got.numel()]):
                    why = _("It takes every N-th element: a shard must be one contiguous range.")
                else:
                    why = _("It is not the right slice of the padded vector.")
                raise AssertionError(_("{where}: rank {r}'s shard is wrong.\n  expected {want}\n  got      {got}\n"
                                       "{why}\nHint: {hint}").format(where=where, r=r, want=ref.tolist(),
                                                                     got=got.reshape(-1).tolist(), why=why, hint=hint))
    print(_("partition gives equal, zero-padded, contiguous shards in {n} cases").format(n=len(cases)))


# ---------------------------------------------------------------------- part 2: the ZeRO-1 step
def _optimizers(opt) -> list[torch.optim.Optimizer]:
    """The torch optimizers a student's object holds (usually ``opt.optim``)."""
    if isinstance(opt, torch.optim.Optimizer):
        return [opt]
    return [v for v in vars(opt).values() if isinstance(v, torch.optim.Optimizer)]


def _rank_zero1(student_cls, steps, seed):
    rank, n = comm.get_rank(), comm.get_world_size()
    model, sampler = _model(), _sampler(seed)
    opt = student_cls(model.parameters(), **ADAMW)
    flats = []
    for step in range(steps):
        x, y = sampler.shard(step, rank, n)                   # this rank's BATCH / N rows
        model(x, y)[1].backward()
        opt.step()
        for p in model.parameters():
            p.grad = None
        flats.append(_flat(model.parameters()).clone())
    optims = _optimizers(opt)
    state = sum(t.numel() for o in optims for s in o.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    stepped = sum(p.numel() for o in optims for g in o.param_groups for p in g["params"])
    return {"flats": flats, "n_optimizers": len(optims), "state_elements": state, "stepped_elements": stepped}


def _compare_training(results, n, what, seed):
    """Every rank's parameters after every step equal single-process AdamW's; else say what went wrong."""
    ref = reference_adamw(len(results[0]["flats"]), seed=seed)
    init = _flat(_model().parameters())
    names = [(name, p.numel()) for name, p in _model().named_parameters()]
    for step in range(len(ref)):
        for r, res in enumerate(results):
            got = res["flats"][step]
            err = (got - ref[step]).abs()
            if err.max() <= ATOL:
                continue
            i = int(err.argmax())
            off = 0
            for name, k in names:                            # which parameter holds element i
                if i < off + k:
                    break
                off += k
            msg = _("{what} on {n} ranks: after step {step}, rank {r}'s parameter '{name}' differs from "
                    "single-process AdamW on the full batch by up to {err:.3g}.").format(
                what=what, n=n, step=step + 1, r=r, name=name, err=err.max().item()) + "\n"
            others = [o["flats"][step] for o in results]
            if any(not torch.equal(o, others[0]) for o in others):
                stale = (got == (init if step == 0 else results[r]["flats"][step - 1])).float().mean().item()
                raise AssertionError(msg + _("The ranks hold different parameters ({stale:.0%} of rank {r}'s values "
                                             "did not change in this step): each rank updated only its shard and the "
                                             "others never received it.\nHint: after self.optim.step(), "
                                             "comm.all_gather the updated shard of every rank into a flat vector of "
                                             "N * s elements and copy it into the parameters (unflatten_into).").format(
                    stale=stale, r=r))
            if step == 0 and reference_adamw(1, grad_scale=n, seed=seed)[0].sub(got).abs().max() <= ATOL:
                raise AssertionError(msg + _("Your update equals AdamW with gradients summed over the ranks, not "
                                             "averaged.\nHint: comm.reduce_scatter(shard_grad, flat_grads, "
                                             "op=comm.ReduceOp.AVG): the mean of the per-rank mean losses is the "
                                             "global mean."))
            raise AssertionError(msg + _("All ranks agree with each other, so the all-gather works; the update itself "
                                         "is wrong.\nHint: each rank must step with the gradient averaged over all "
                                         "ranks (not its local one), for exactly its own shard: reduce-scatter the "
                                         "padded flat gradients with op=comm.ReduceOp.AVG into the shard's .grad, then "
                                         "self.optim.step()."))


@graded(*ZERO1_REFS)
def check_zero1_step(cls, world_sizes=(2, 3), steps: int = STEPS, timeout: float = TIMEOUT) -> None:
    """``Zero1(params, lr=..., weight_decay=...)`` trains a tiny float64 GPT on N ranks (each on its share of the
    batch) to the same parameters as one process running torch.optim.AdamW on the whole batch."""
    for n in world_sizes:
        seed = fresh_seed()
        res = run_student(_rank_zero1, n, cls, steps, seed, timeout=timeout, what="Zero1")
        _compare_training(res.results, n, "Zero1", seed)
    print(_("Zero1 matches single-process AdamW to {atol:g} after {steps} steps on {sizes} ranks (psi = "
            "{psi:,})").format(atol=ATOL, steps=steps, sizes=", ".join(map(str, world_sizes)), psi=CFG.param_count()))


@graded(*ZERO1_REFS)
def check_zero1_memory_and_traffic(cls, world_size: int = 4, steps: int = 2, timeout: float = TIMEOUT) -> None:
    """On 4 ranks: each rank's AdamW holds state for only its shard, psi / N elements (m and v), and each rank
    sends about 2 (N-1)/N psi elements per step, what one DP all-reduce sends (from the trace)."""
    n, psi = world_size, CFG.param_count()
    seed = fresh_seed()
    res = run_student(_rank_zero1, n, cls, steps, seed, timeout=timeout, what="Zero1")
    _compare_training(res.results, n, "Zero1", seed)
    s = -(-psi // n)
    for r, out in enumerate(res.results):
        if out["n_optimizers"] == 0:
            raise AssertionError(_("found no torch optimizer in your Zero1 object: keep the AdamW on the shard as "
                                   "self.optim (the notebook's skeleton does)."))
        if out["stepped_elements"] > s:
            raise AssertionError(_(
                "rank {r}'s optimizer steps {got:,} elements; under ZeRO-1 each rank steps only its shard, s = "
                "ceil(psi / N) = {s:,} of the {psi:,} parameters.\nHint: give torch.optim.AdamW the shard "
                "(self.shard), not the model's parameters or the whole flat vector.").format(
                r=r, got=out["stepped_elements"], s=s, psi=psi))
        if out["state_elements"] > 2 * s:
            raise AssertionError(_("rank {r}'s optimizer state holds {got:,} elements; ZeRO-1 keeps m and v only for "
                                   "its shard: 2 x {s:,} = {want:,}.").format(r=r, got=out["state_elements"], s=s,
                                                                              want=2 * s))
    elt = 8                                                           # float64
    want = 2 * (n - 1) / n * s * n * elt * steps                      # reduce-scatter + all-gather of N * s
    sent = res.trace.bytes_per_rank()
    ops = sorted({e.op for e in res.trace.comm().events})
    for r, b in sent.items():
        if b > 1.01 * want:
            extra = (_(" You call all_reduce: it sends twice what a reduce-scatter does, although each rank only "
                       "needs the averaged gradients of its own shard.") if "all_reduce" in ops else "")
            raise AssertionError(_(
                "rank {r} sent {sent:,.0f} bytes in {steps} steps ({ratio:.2f}x the ZeRO-1 budget); ZeRO-1 sends a "
                "reduce-scatter plus an all-gather of the {padded:,} padded elements per step: 2 (N-1)/N x {padded:,} "
                "x 8 bytes = {per_step:,.0f} bytes, the same as one DP all-reduce. Operations used: {ops}.{extra}\n"
                "Hint: comm.reduce_scatter(shard_grad, flat_grads, op=comm.ReduceOp.AVG), then comm.all_gather(flat, "
                "shard).").format(r=r, sent=b, steps=steps, ratio=b / want, padded=n * s, per_step=want / steps,
                                  ops=ops, extra=extra))
    for r in range(n):                     # under the budget, but not ZeRO-1's collectives (a DDP in disguise)
        got = sorted(e.op for e in res.trace.filter(rank=r).comm().events)
        if got != sorted(["reduce_scatter", "all_gather"] * steps):
            raise AssertionError(_(
                "rank {r} called {calls} in {steps} steps; ZeRO-1 makes one comm.reduce_scatter (the averaged "
                "gradients of this rank's shard) and one comm.all_gather (the updated shards) per step, and nothing "
                "else.\nHint: comm.reduce_scatter(shard_grad, flat_grads, op=comm.ReduceOp.AVG), then "
                "comm.all_gather(flat, shard).").format(
                r=r, calls=", ".join(f"comm.{op} x{got.count(op)}" for op in sorted(set(got))) or _("nothing"),
                steps=steps))
    print(_("Zero1 on {n} ranks: AdamW state for {s:,} of {psi:,} parameters per rank; {sent:,.0f} bytes sent per "
            "rank per step = 2 (N-1)/N x psi x 8 B, as DP").format(n=n, s=s, psi=psi, sent=max(sent.values()) / steps))


# ---------------------------------------------------------------------- part 3: memory formulas
def _stage_hint(part: str) -> str:
    return {"params": _("the weights are sharded only by ZeRO-3: params = param_bytes * psi, divided by nd when "
                        "stage >= 3."),
            "grads": _("the gradients are sharded from ZeRO-2 on: grads = grad_bytes * psi, divided by nd when "
                       "stage >= 2."),
            "optimizer": _("the optimizer state is sharded from ZeRO-1 on: optimizer = k * psi, divided by nd when "
                           "stage >= 1.")}[part]


def _student_bytes(fn, psi, nd, stage, **widths) -> dict:
    args = (psi, nd, stage) + tuple(widths[k] for k in ("param_bytes", "grad_bytes", "k") if k in widths)
    got = call_student(fn, *args, what="zero_memory")
    if not isinstance(got, dict) or any(p not in got for p in PARTS):
        raise AssertionError(_("zero_memory{args} returned {got!r}; return a dict with the keys 'params', 'grads' "
                               "and 'optimizer' (bytes per GPU).").format(args=args, got=got))
    return got


@graded("parlab.parallel.zero.memory:model_state_bytes", "parlab.parallel.zero.memory:max_params", "parlab.parallel.zero.memory:min_dp_size")
def check_memory_formulas(fn) -> None:
    """``fn(psi, nd, stage, param_bytes=2, grad_bytes=2, k=12)`` equals the ZeRO formulas for every stage, and
    reproduces the paper's figure 1 (psi = 7.5B, Nd = 64: 120, 31.4, 16.6, 1.9 GB)."""
    rng = random.Random(fresh_seed())                 # two cases drawn at grading time: not copied from a run
    cases = [(7.5e9, 64, {}), (1e6, 4, {}), (3e5, 8, dict(param_bytes=4, grad_bytes=4, k=8)),
             (1000, 1, {}), (5e9, 16, dict(param_bytes=2, grad_bytes=4, k=12))] + [
        (float(rng.randint(10 ** 5, 10 ** 10)), 2 ** rng.randint(0, 10),
         dict(param_bytes=rng.choice((1, 2, 4)), grad_bytes=rng.choice((2, 4)), k=rng.choice((4, 8, 12, 16))))
        for _case in range(2)]
    for psi, nd, widths in cases:
        for stage in STAGES:
            got = _student_bytes(fn, psi, nd, stage, **widths)
            want = model_state_bytes(psi, nd, stage, **widths)
            call = f"zero_memory(psi={psi:g}, nd={nd}, stage={stage}" + "".join(f", {k}={v}" for k, v in widths.items())
            for part in PARTS:
                if not math.isclose(float(got[part]), want[part], rel_tol=1e-9):
                    raise AssertionError(_("{call})['{part}'] = {got:,.6g} bytes, expected {want:,.6g} ({stage}).\n"
                                           "Hint: {hint}").format(call=call, part=part, got=float(got[part]),
                                                                  want=want[part], stage=STAGES[stage],
                                                                  hint=_stage_hint(part)))
    paper = [sum(_student_bytes(fn, 7.5e9, 64, s)[p] for p in PARTS) / 1e9 for s in STAGES]
    print(_("zero_memory reproduces the ZeRO paper's figure 1 (psi = 7.5B, Nd = 64): {stages}").format(
        stages=", ".join(f"{STAGES[s]} {gb:.1f} GB" for s, gb in zip(STAGES, paper))))


def _rank_measure_stages():
    """fp32 GPT, AdamW: one step at each stage; the bytes each rank holds afterwards."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    rank, n = comm.get_rank(), comm.get_world_size()
    x, y = BatchSampler(load_corpus(2000), 8, cfg.seq_len, seed=1).shard(0, rank, n)
    out = {}
    for stage in STAGES:
        model = GPT(cfg)
        if stage == 3:
            model = FullyShardedDataParallel(model)
        opt = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3) if stage in (1, 2)
               else torch.optim.AdamW(model.parameters(), lr=1e-3))
        model(x, y)[1].backward()
        if stage == 0:
            for p in model.parameters():
                comm.all_reduce(p.grad, op=comm.ReduceOp.AVG, label="dp grads")
        opt.step()
        out[stage] = measure(model.parameters(), opt)
    return {"psi": cfg.param_count(), "bytes": out}


@graded("parlab.parallel.zero.memory:model_state_bytes", "parlab.parallel.zero.memory:measure")
def check_memory_measured(fn, world_size: int = 4, timeout: float = TIMEOUT) -> None:
    """Measured on 4 simulated ranks (fp32 tiny GPT, AdamW, parlab's DP / ZeRO-1 / ZeRO-2 / FSDP): the bytes of
    params, grads and optimizer state, summed over the ranks, equal Nd x zero_memory(psi, Nd, stage, 4, 4, 8)
    to 1% (step counters and ZeRO-3's padding are the difference)."""
    nd = world_size
    res = run_student(_rank_measure_stages, nd, timeout=timeout, what=_("the measuring run (parlab's own code)"))
    psi = res.results[0]["psi"]
    widths = dict(param_bytes=4, grad_bytes=4, k=8)
    lines = []
    for stage in STAGES:
        got = _student_bytes(fn, psi, nd, stage, **widths)
        for part in PARTS:
            measured = sum(r["bytes"][stage][part] for r in res.results) / nd       # mean over the ranks
            formula = float(got[part])
            if not (formula > 0 and 0.99 <= measured / formula <= 1.01):
                raise AssertionError(_(
                    "{stage} on {nd} ranks, fp32 AdamW (4 + 4 + 8 bytes), psi = {psi:,}: the ranks hold {measured:,.0f} "
                    "bytes of {part} on average, your formula says {formula:,.0f} (ratio {ratio:.3f}).\n"
                    "Hint: {hint}").format(stage=STAGES[stage], nd=nd, psi=psi, measured=measured, part=part,
                                           formula=formula, ratio=measured / formula if formula else float("inf"),
                                           hint=_stage_hint(part)))
        total = sum(float(got[p]) for p in PARTS)
        lines.append(f"{STAGES[stage]} {sum(r['bytes'][stage]['total'] for r in res.results) / nd / total:.3f}")
    print(_("zero_memory matches the bytes measured on {nd} ranks (measured / formula: {ratios})").format(
        nd=nd, ratios=", ".join(lines)))


protect(__name__)
