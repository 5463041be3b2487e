"""Red team, in process: for each of exercises 02-10, the cheats a student who wants the points without the work
would try, run against that exercise's checks; each must fail, with a message that says why.

The cheats are written here as a student would write them in a notebook (this file is outside the parlab
package, so the guard treats its code as the student's): parlab's answer reached by another name (a default
argument, a partial, a copy made before the check, importlib.reload, inspect.getsource + exec, a subclass, a
private autograd Function), torch.distributed called directly so that nothing is traced, the computation done
on one rank from public inputs or from the grader's own helpers, answers hard-coded from the public cases,
tolerances or comparisons of the grading code rebound, the trace edited by hand. `CHEATS` is the table:
(exercise, what, run, message). Each must fail; none of them may leave anything rebound (`untouched`).

The folder-level red team (parlab grade on notebooks: try/except, deleted cells, loops, deadlocks, os._exit,
memory) is tests/test_grade_redteam.py.
"""
import functools
import importlib.util
import inspect
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F

from parlab import comm
from parlab.parallel.zero import memory
from parlab.parallel import pipeline as schedules
from parlab.parallel import topology
from parlab.parallel.context import ring as ra
from parlab.parallel.context import ulysses as sp
from parlab.parallel.data import assign_buckets
from parlab.course.grading import (context_parallel as g06, data_parallel as g02, expert as g10, fsdp as g09,
                            hybrid as g07, pipeline as g05, sequence_parallel as g08, tensor_parallel as g04, zero as g03)
from parlab.course import grading as g00
from parlab.course.grading import guard


# ---------------------------------------------------------------------- 02 DDP
def _greedy(nbytes, cap):
    buckets, size = [], 0
    for i, b in enumerate(nbytes):
        if not buckets or size + b > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += b
    return buckets


SEEN_BUCKETS = {(tuple(nb), cap): _greedy(nb, cap) for nb, cap in g02.BUCKET_CASES}   # "copied from a run"


def buckets_hard_coded(nbytes, cap_bytes):
    return SEEN_BUCKETS.get((tuple(nbytes), cap_bytes), [list(range(len(nbytes)))])


def buckets_default_arg(nbytes, cap_bytes, _parlab=assign_buckets):
    return _parlab(nbytes, ["x"] * len(nbytes), cap_bytes)


_PARTIAL = functools.partial(assign_buckets)
_TOOLS = {"buckets": assign_buckets}
_COPY = types.FunctionType(assign_buckets.__code__, assign_buckets.__globals__, "my_buckets")


def _fresh_module(name):
    """A fresh copy of a parlab module, as importlib.reload would give it (without disturbing the real one)."""
    spec = importlib.util.find_spec(name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _exec_source(fn):
    ns = dict(fn.__globals__)
    exec(textwrap.dedent(inspect.getsource(fn)), ns)                    # noqa: S102  (the cheat)
    return ns[fn.__name__]


def buckets_reloaded(nbytes, cap_bytes):
    return _fresh_module("parlab.parallel.data.buckets").assign_buckets(nbytes, ["x"] * len(nbytes), cap_bytes)


_RELOADED_BEFORE = _fresh_module("parlab.parallel.data.buckets").assign_buckets
_EXECED_BEFORE = _exec_source(assign_buckets)


def hooks_untraced(model):
    import torch.distributed as dist
    world = dist.get_world_size()

    def average(p):
        dist.all_reduce(p.grad)                                        # not through parlab.comm: not traced
        p.grad /= world
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(average)


def hooks_from_the_grader(model):
    """No communication: every rank copies the grader's own whole-batch gradients into p.grad."""
    names = {id(p): n for n, p in model.named_parameters()}
    steps = {"n": 0, "seen": 0}
    ref = g02.reference_grads()
    trainable = sum(p.requires_grad for p in model.parameters())

    def copy_in(p):
        p.grad.copy_(ref[steps["n"]][names[id(p)]])
        steps["seen"] += 1
        if steps["seen"] == trainable:
            steps["n"], steps["seen"] = steps["n"] + 1, 0
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(copy_in)


def hooks_from_public_batch(model):
    """No communication: every rank recomputes the whole batch's gradients from the public data and model."""
    names = {id(p): n for n, p in model.named_parameters()}
    step = {"n": 0, "seen": 0}
    trainable = sum(p.requires_grad for p in model.parameters())
    refs = []
    twin = g02.GPT(g02.CFG, seed=0, dtype=torch.float64)
    twin.get_parameter("wpe.weight").requires_grad_(False)
    for s in range(g02.STEPS):
        twin.zero_grad(set_to_none=True)
        twin(*g02.BatchSampler(g02.load_corpus(20_000), 12, g02.CFG.seq_len, seed=2).global_batch(s))[1].backward()
        refs.append({n: p.grad.clone() for n, p in twin.named_parameters() if p.requires_grad})

    def copy_in(p):
        p.grad.copy_(refs[step["n"]][names[id(p)]])
        comm.all_reduce(torch.zeros_like(p.grad))                      # keeps the trace looking right
        step["seen"] += 1
        if step["seen"] == trainable:
            step["n"], step["seen"] = step["n"] + 1, 0
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(copy_in)


class BucketsPerParameter:
    """'Buckets' that all-reduce every gradient on its own, synchronously: DDP without the bucketing."""

    def __init__(self, model, cap):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world = comm.get_world_size()
        for p in self.params:
            p.register_post_accumulate_grad_hook(lambda p: comm.all_reduce(p.grad))

    def finish(self):
        for p in self.params:
            p.grad /= self.world


class BucketsInFinish:
    """One all-reduce per bucket, but all of them after backward, blocking: no overlap at all."""

    def __init__(self, model, cap):
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.buckets = [[params[i] for i in b] for b in _greedy([p.numel() * p.element_size() for p in params], cap)]
        self.world = comm.get_world_size()

    def finish(self):
        for bucket in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            comm.all_reduce(flat)
            flat /= self.world
            off = 0
            for p in bucket:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()


def _ddp_tolerance_loosened():
    g02.TOL["rtol"] = 1e9                                              # "my gradients are close enough"


# ---------------------------------------------------------------------- 03 ZeRO
def partition_from_fsdp_helper(flat, rank, world_size):
    return g09.shard_of(flat, rank, world_size)


def memory_default_arg(psi, nd, stage, param_bytes=2, grad_bytes=2, k=12, _m=memory.model_state_bytes):
    return _m(psi, nd, stage, param_bytes, grad_bytes, k)


def memory_exec_copy(psi, nd, stage, param_bytes=2, grad_bytes=2, k=12):
    return _MSB_COPY(psi, nd, stage, param_bytes, grad_bytes, k)


_MSB_COPY = _exec_source(memory.model_state_bytes)
MEMORY_CASES = [(7.5e9, 64, 2, 2, 12), (1e6, 4, 2, 2, 12), (3e5, 8, 4, 4, 8), (1000, 1, 2, 2, 12),
                (5e9, 16, 2, 4, 12), (28_352, 4, 4, 4, 8)]          # the public cases, and the measured model's
SEEN_MEMORY = {(psi, nd, stage, pb, gb, k): {"params": pb * psi / (nd if stage >= 3 else 1),
                                             "grads": gb * psi / (nd if stage >= 2 else 1),
                                             "optimizer": k * psi / (nd if stage >= 1 else 1)}
               for psi, nd, pb, gb, k in MEMORY_CASES for stage in range(4)}      # "copied from runs"


def memory_hard_coded(psi, nd, stage, param_bytes=2, grad_bytes=2, k=12):
    return SEEN_MEMORY.get((psi, nd, stage, param_bytes, grad_bytes, k), {"params": 0, "grads": 0, "optimizer": 0})


class Zero1FromTheGrader:
    """No optimizer work: after each step, copy the grader's own single-process AdamW result into the model."""

    def __init__(self, params, **kw):
        self.params = list(params)
        self.optim = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **kw)
        self.k = 0
        self.traj = g03.reference_adamw(g03.STEPS)

    @torch.no_grad()
    def step(self):
        flat = self.traj[self.k]
        self.k += 1
        off = 0
        for p in self.params:
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()


class Zero1LikeDDP:
    """DDP in disguise: all-reduce every gradient and step a full AdamW on every rank, with a shard-sized decoy
    optimizer as self.optim for the memory check."""

    def __init__(self, params, **kw):
        self.params = list(params)
        n = sum(p.numel() for p in self.params)
        s = -(-n // comm.get_world_size())
        self.optim = torch.optim.AdamW([torch.zeros(s, requires_grad=True)], **kw)     # the decoy
        self._hidden = [torch.optim.AdamW(self.params, **kw)]                          # the real one

    @torch.no_grad()
    def step(self):
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        comm.all_reduce(flat, op=comm.ReduceOp.AVG)
        off = 0
        for p in self.params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        self._hidden[0].step()


class Zero1Untraced(Zero1LikeDDP):
    """The same, with the all-reduce through torch.distributed (invisible to the trace)."""

    @torch.no_grad()
    def step(self):
        import torch.distributed as dist
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self._hidden[0].step()


def _zero_tolerance_loosened():
    g03.ATOL = 1e9


# ---------------------------------------------------------------------- 04 tensor parallel
class ColumnGathersWeights(torch.autograd.Function):
    """Right numbers, wrong sharding: backward all-gathers grad_y and the weight and computes grad_x in full."""

    @staticmethod
    def forward(ctx, x, w, b, group):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        n = comm.get_world_size()
        gy_full = comm.all_gather_dim(gy.unsqueeze(0).contiguous(), 0)      # (n, B, S, out/tp)
        w_full = comm.all_gather_dim(w.unsqueeze(0).contiguous(), 0)        # (n, out/tp, in)
        gx = sum(gy_full[k] @ w_full[k] for k in range(n))
        return gx, gy.flatten(0, 1).t() @ x.flatten(0, 1), gy.sum((0, 1)), None


class ColumnUntraced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, group):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, gy):
        import torch.distributed as dist
        x, w = ctx.saved_tensors
        gx = gy @ w
        dist.all_reduce(gx)                                            # invisible to the trace
        return gx, gy.flatten(0, 1).t() @ x.flatten(0, 1), gy.sum((0, 1)), None


class ColumnFromPublicData(torch.autograd.Function):
    """No communication: the full x.grad from the grader's data (dense gy and W), which it draws the same way."""

    @staticmethod
    def forward(ctx, x, w, b, group):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        _x, w_full, _b, gy_full = g04._dense_linear()
        comm.all_reduce(torch.zeros(gy.shape[:-1] + (w.shape[1],), dtype=gy.dtype))   # the expected trace
        return gy_full @ w_full, gy.flatten(0, 1).t() @ x.flatten(0, 1), gy.sum((0, 1)), None


class CrossEntropyGathersLogits(torch.autograd.Function):
    """All-gather the whole (B, S, V) logits and call F.cross_entropy: correct, and exactly what TP avoids."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        n, r = comm.get_world_size(), comm.get_rank()
        full = comm.all_gather_dim(logits.unsqueeze(0).contiguous(), 0)   # (n, B, S, V/tp)
        full = torch.cat(list(full), -1).requires_grad_(True)
        with torch.enable_grad():
            loss = F.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
        ctx.save_for_backward(full, loss)
        ctx.r, ctx.n = r, n
        return loss.detach()

    @staticmethod
    def backward(ctx, g):
        full, loss = ctx.saved_tensors
        (grad,) = torch.autograd.grad(loss, full, g)
        return grad.chunk(ctx.n, -1)[ctx.r], None, None


class CrossEntropySubclass(__import__("parlab.parallel.tensor.loss", fromlist=["x"])._VocabParallelCrossEntropy):
    pass


_PRIVATE_CE = __import__("parlab.parallel.tensor.loss", fromlist=["x"])._VocabParallelCrossEntropy


class CrossEntropyPrivate(torch.autograd.Function):
    """parlab's private autograd Function, called from the student's own class."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        return _PRIVATE_CE.forward(ctx, logits, targets, group, "ce")

    @staticmethod
    def backward(ctx, g):
        return _PRIVATE_CE.backward(ctx, g)[0], None, None


def _patch_cross_entropy():
    F.cross_entropy = lambda *a, **k: torch.zeros(a[0].shape[0], dtype=a[0].dtype, requires_grad=True)


# ---------------------------------------------------------------------- 05 pipeline
SEEN_1F1B = {(p, m, r): [str(a) for a in schedules.one_f_one_b(p, m).actions[r]]
             for p, m in g05.CASES for r in range(p)}                        # "copied from a run"


def one_f_one_b_looked_up(p, m, r):                  # only what a run of the public cases showed
    return SEEN_1F1B[p, m, r]


def one_f_one_b_hard_coded(p, m, r):
    return SEEN_1F1B.get((p, m, r), [f"{r}F{i}" for i in range(m)] + [f"{r}B{i}" for i in range(m)])


_SCHEDULES = {"1f1b": schedules.one_f_one_b}


def one_f_one_b_from_dict(p, m, r):
    return list(_SCHEDULES["1f1b"](p, m).actions[r])


def one_f_one_b_reloaded(p, m, r):
    return list(_fresh_module("parlab.parallel.pipeline").one_f_one_b(p, m).actions[r])


SEEN_BUBBLES = {(p, m, v): (p - 1) / (v * m + p - 1) for p, m, v in g05.BUBBLE_CASES}


def bubble_hard_coded(p, m, v=1):
    return SEEN_BUBBLES.get((p, m, v), 0.0)


def bubble_simulated_by_copy(p, m, v=1):
    sim = _SIMULATE_COPY(schedules.one_f_one_b(p, m) if v == 1 else schedules.interleaved_1f1b(p, m, v))
    return sim.bubble_fraction


_SIMULATE_COPY = types.FunctionType(schedules.simulate.__code__, schedules.simulate.__globals__, "sim",
                                    schedules.simulate.__defaults__)


# ---------------------------------------------------------------------- 06 ring attention
def merge_copy_of_parlab(o1, l1, o2, l2):
    return _MERGE(o1, l1, o2, l2)


_MERGE = _exec_source(ra.merge_partials)


def ring_step_from_public_inputs(q, kv, out, lse, step):
    """No ring: rebuild the grader's full q, k, v from its public seed and attend locally; send as expected."""
    P, r = comm.get_world_size(), comm.get_rank()
    if step < P - 1:
        buf = torch.empty_like(kv)
        reqs = [comm.isend(kv, (r + 1) % P), comm.irecv(buf, (r - 1) % P)]
        for req in reqs:
            req.wait()
    qf, kf, vf = g06.qkv(g06.C * P, seed=P)
    full = ra.causal_attention(qf, kf, vf, causal=False) if hasattr(ra, "causal_attention") else \
        g06.causal_attention(qf, kf, vf, causal=False)
    mine = full[..., r * g06.C:(r + 1) * g06.C, :]
    return mine, torch.zeros(mine.shape[:-1], dtype=mine.dtype), (buf if step < P - 1 else kv)


def ring_step_untraced(q, kv, out, lse, step):
    import torch.distributed as dist
    P, r = comm.get_world_size(), comm.get_rank()
    last = step == P - 1
    if not last:
        buf = torch.empty_like(kv)
        reqs = [dist.isend(kv, (r + 1) % P), dist.irecv(buf, (r - 1) % P)]
    o, l = ra.attention_block(q, kv[0], kv[1])
    out, lse = (o, l) if out is None else merge_copy_of_parlab(out, lse, o, l)
    if last:
        return out, lse, kv
    for req in reqs:
        req.wait()
    return out, lse, buf


def zigzag_positions_by_sharding(S, P, rank):
    return _SHARD(torch.arange(S), P, rank, "zigzag", dim=0)


_SHARD = functools.partial(ra.shard_sequence)


# ---------------------------------------------------------------------- 07 hybrid layout
class MyGrid(topology.ParallelGrid):
    """'My own' grid class."""


def groups_4d_subclass(world, tp, cp, pp):
    grid = MyGrid(world, tp=tp, cp=cp, pp=pp)
    return {d: grid.groups(d) for d in ("tp", "cp", "dp", "pp")}


_GRIDS = {(w, tp, cp, pp): topology.ParallelGrid(w, tp=tp, cp=cp, pp=pp) for w, tp, cp, pp in g07.LAYOUTS_4D}


SEEN_GROUPS = {k: {d: g.groups(d) for d in ("tp", "cp", "dp", "pp")} for k, g in _GRIDS.items()}   # "from a run"


def groups_4d_looked_up(world, tp, cp, pp):
    return SEEN_GROUPS[world, tp, cp, pp]


def groups_4d_prebuilt(world, tp, cp, pp):
    """ParallelGrid objects built before the check starts (the constructor is not called during the check)."""
    grid = _GRIDS[world, tp, cp, pp]
    return {d: grid.groups(d) for d in ("tp", "cp", "dp", "pp")}


def choose_layout_by_planner():
    from parlab.cluster.costs import Cluster, model_preset
    from parlab.cluster.planner import plan
    best = plan(model_preset("llama-65b"), Cluster(nodes=4), 128)[0]
    return dict(tp=best.tp, pp=best.pp, micro_batch=best.micro_batch, zero=best.zero, recompute=best.recompute)


_PLAN = __import__("parlab.cluster.planner", fromlist=["x"]).plan


def search_layout_default_arg(model, cluster, global_batch, _plan=_PLAN):
    best = _plan(model, cluster, global_batch)[0]
    return dict(tp=best.tp, pp=best.pp, micro_batch=best.micro_batch, zero=best.zero, recompute=best.recompute)


def _seen_layouts():
    """The answers printed by a passing run, for each public task (what a student could copy)."""
    from parlab.cluster import planner
    out = {}
    for name, cluster, batch in g07.SEARCH_TASKS:
        best = planner.plan(g07._model(name), cluster, batch)[0]
        out[name, cluster.nodes, cluster.gpu_mem_gb, batch] = dict(
            tp=best.tp, pp=best.pp, micro_batch=best.micro_batch, zero=best.zero, recompute=best.recompute)
    return out


def search_layout_hard_coded(model, cluster, global_batch):
    return SEEN_LAYOUTS.get((model.name, cluster.nodes, cluster.gpu_mem_gb, global_batch), dict(tp=1, pp=1))


SEEN_LAYOUTS = {}


# ---------------------------------------------------------------------- 08 Ulysses
def seq_to_head_untraced(x):
    import torch.distributed as dist
    P = dist.get_world_size()
    *L, nh, s, hd = x.shape
    send = x.reshape(*L, P, nh // P, s, hd).movedim(-4, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.movedim(0, -3).reshape(*L, nh // P, P * s, hd)


def seq_to_head_fresh_module(x):
    """A freshly imported copy of parlab.parallel.context.ulysses, made inside the rank while the check runs."""
    return _fresh_module("parlab.parallel.context.ulysses").seq_to_head(x)


def ulysses_private_function(q, k, v):
    """parlab's private autograd Functions, reached under their private names."""
    qkv = sp._SeqToHead.apply(torch.stack([q, k, v]), None, "x")
    out = g08.causal_attention(qkv[0], qkv[1], qkv[2], causal=True)
    return sp._HeadToSeq.apply(out, None, "y")


def ulysses_gathers_everything(q, k, v):
    """All-gather the whole sequence and attend locally (correct output; not Ulysses)."""
    r = comm.get_rank()
    full = []
    for t in (q, k, v):
        buf = comm.all_gather_dim(t.detach().unsqueeze(0).contiguous(), 0)   # (P, B, nh, S/P, hd)
        full.append(torch.cat(list(buf), 2))
    out = g08.causal_attention(*full, causal=True)
    c = q.shape[2]
    return out[:, :, r * c:(r + 1) * c] + 0 * (q + k + v)


# ---------------------------------------------------------------------- 09 FSDP
def gather_full_untraced(shard):
    import torch.distributed as dist
    full = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype)
    dist.all_gather_into_tensor(full, shard)
    return full


def _gather(shard):
    full = torch.empty(comm.get_world_size() * shard.numel(), dtype=shard.dtype)
    comm.all_gather(full, shard)
    return full


_KEPT = {}


class FSDPKeepsFullInAGlobal(torch.autograd.Function):
    """Keeps the gathered parameters in a module-level dict (not in ctx), re-gathers in backward only for the trace,
    and computes with the kept copy."""

    @staticmethod
    def forward(ctx, x, shard):
        full = _gather(shard)
        _KEPT["full"] = full
        ctx.save_for_backward(x, shard)
        return g09.unit_forward(x, full)

    @staticmethod
    def backward(ctx, gy):
        x, shard = ctx.saved_tensors
        _gather(shard)                                                 # for the trace only
        full = _KEPT.pop("full").requires_grad_(True)
        with torch.enable_grad():
            xx = x.detach().requires_grad_(True)
            dx, dfull = torch.autograd.grad(g09.unit_forward(xx, full), (xx, full), gy)
        dshard = torch.empty_like(shard)
        comm.reduce_scatter(dshard, dfull)
        return dx, dshard / comm.get_world_size()


def fsdp_private(x, shard):
    from parlab.parallel.zero import fsdp as pf
    flat = pf._Flat.__new__(pf._Flat)
    return pf._GatherParams.apply(shard, flat, None)


class FSDPPrivate:
    apply = staticmethod(fsdp_private)


# ---------------------------------------------------------------------- any exercise: rebinding what a check uses
def _patch_trace_method():
    from parlab.trace import Trace
    Trace.filter = lambda self, **k: self                              # every filter lets everything through


def _patch_tensor_sub():
    torch.Tensor.__sub__ = lambda a, b: torch.zeros_like(a)            # every difference is zero


def buckets_patch_during_the_check(nbytes, cap_bytes):
    """Rebinds a comparison from inside the student's function, while the check runs."""
    import math
    math.isclose = lambda *a, **k: True
    return [list(range(len(nbytes)))]


def head_to_seq_private(x):
    return sp._a2a_head_to_seq(x, None, "mine")


class CrossEntropyHidesItsGather(CrossEntropyGathersLogits):
    """Gathers the logits, then deletes the all-gather's event from the trace."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        from parlab.trace.events import _ACTIVE
        rec = _ACTIVE[-1]
        n = len(rec.events)
        out = CrossEntropyGathersLogits.forward(ctx, logits, targets, group)
        del rec.events[n:]                                             # no trace of the gather
        for _ in range(3):                                             # and the 3 all-reduces the check expects
            comm.all_reduce(torch.zeros(targets.shape, dtype=logits.dtype))
        return out


def ring_step_fake_trace(q, kv, out, lse, step):
    """All-gathers K/V, then writes the sends the check wants straight into the trace."""
    from parlab.trace.events import _ACTIVE, Event
    P, r = comm.get_world_size(), comm.get_rank()
    rec = _ACTIVE[-1]
    if step < P - 1:
        rec.events.append(Event(rank=r, kind="p2p", op="send", start=0.0, end=0.0, group=tuple(range(P)),
                                peer=(r + 1) % P, numel=kv.numel(), nbytes=kv.numel() * 8, dtype="float64"))
    o, l = ra.attention_block(q, kv[0], kv[1])                          # no ring at all: this rank's block only
    return o, l, kv


# ---------------------------------------------------------------------- the table
CALLED = "you called parlab's {}; write your own"
UNTRACED = r"you called torch\.distributed\.{} directly; communicate through parlab\.comm"
TAMPERED = "tampered: .*{}"

def reduce_scatter_builtin(chunks):            # exercise 00 with the library's collectives, not messages
    n, r = comm.get_world_size(), comm.get_rank()
    comm.reduce_scatter(chunks[r], torch.cat(chunks))


def all_gather_builtin(chunks):
    n, r = comm.get_world_size(), comm.get_rank()
    out = torch.empty(n * chunks[0].numel(), dtype=chunks[0].dtype)
    comm.all_gather(out, chunks[r].clone())
    for c, piece in zip(chunks, out.chunk(n)):
        c.copy_(piece)


def all_reduce_builtin(x):
    comm.all_reduce(x)
    return x


CHEATS = [
    # (exercise, what the student does, how to run it against the check, what the failure must say)
    ("00", "reduce-scatter: comm.reduce_scatter instead of messages",
     lambda: g00.check_ring_reduce_scatter(reduce_scatter_builtin, world_sizes=(2,)),
     r"called comm\.reduce_scatter: this exercise builds it from point-to-point messages only"),
    ("00", "all-gather: comm.all_gather instead of messages",
     lambda: g00.check_ring_all_gather(all_gather_builtin, world_sizes=(2,)), r"called comm\.all_gather"),
    ("00", "all-reduce: comm.all_reduce instead of messages",
     lambda: g00.check_ring_all_reduce(all_reduce_builtin, world_sizes=(2,)), r"called comm\.all_reduce"),
    ("02", "buckets: the greedy layouts seen in a run, hard-coded",
     lambda: g02.check_make_buckets(buckets_hard_coded), r"make_buckets\(.*\n  expected"),
    ("02", "buckets: parlab's assign_buckets as a default argument",
     lambda: g02.check_make_buckets(buckets_default_arg), CALLED.format("assign_buckets")),
    ("02", "buckets: functools.partial made before the check",
     lambda: g02.check_make_buckets(lambda nb, cap: _PARTIAL(nb, ["x"] * len(nb), cap)),
     CALLED.format("assign_buckets")),
    ("02", "buckets: parlab's function kept in a dict",
     lambda: g02.check_make_buckets(lambda nb, cap: _TOOLS["buckets"](nb, ["x"] * len(nb), cap)),
     CALLED.format("assign_buckets")),
    ("02", "buckets: types.FunctionType copy made before the check",
     lambda: g02.check_make_buckets(lambda nb, cap: _COPY(nb, ["x"] * len(nb), cap)), CALLED.format("assign_buckets")),
    ("02", "buckets: importlib (a fresh module) during the check",
     lambda: g02.check_make_buckets(buckets_reloaded), CALLED.format("assign_buckets")),
    ("02", "buckets: a reloaded module made before the check",
     lambda: g02.check_make_buckets(lambda nb, cap: _RELOADED_BEFORE(nb, ["x"] * len(nb), cap)),
     CALLED.format("assign_buckets")),
    ("02", "buckets: inspect.getsource + exec",
     lambda: g02.check_make_buckets(lambda nb, cap: _EXECED_BEFORE(nb, ["x"] * len(nb), cap)),
     CALLED.format("assign_buckets")),
    ("02", "hooks: torch.distributed.all_reduce instead of comm",
     lambda: g02.check_hook_grads(hooks_untraced, world_sizes=(2,)), UNTRACED.format("all_reduce")),
    ("02", "hooks: the grader's reference gradients copied into p.grad",
     lambda: g02.check_hook_grads(hooks_from_the_grader, world_sizes=(2,)), CALLED.format("reference_grads")),
    ("02", "hooks: whole-batch gradients recomputed from the public batch, a dummy all-reduce for the trace",
     lambda: g02.check_hook_grads(hooks_from_public_batch, world_sizes=(2,)), r"gradient of .* is wrong"),
    ("02", "buckets: one synchronous all-reduce per parameter",
     lambda: g02.check_bucketed_all_reduce_calls(BucketsPerParameter), "That is one per parameter"),
    ("02", "buckets: every bucket reduced in finish(), blocking",
     lambda: g02.check_bucketed_all_reduce_calls(BucketsInFinish), "blocking|after backward had finished"),
    ("02", "the gradient tolerance loosened in the grading module",
     lambda: (_ddp_tolerance_loosened(), g02.check_hook_grads(hooks_untraced, world_sizes=(2,))),
     TAMPERED.format("data_parallel.TOL")),
    ("03", "partition: exercise 09's given shard_of helper",
     lambda: g03.check_partition(partition_from_fsdp_helper), CALLED.format("shard_of")),
    ("03", "memory: model_state_bytes as a default argument",
     lambda: g03.check_memory_formulas(memory_default_arg), CALLED.format("model_state_bytes")),
    ("03", "memory: a copy of model_state_bytes by inspect.getsource + exec",
     lambda: g03.check_memory_formulas(memory_exec_copy), CALLED.format("model_state_bytes")),
    ("03", "memory: the paper's numbers and the public cases, hard-coded",
     lambda: g03.check_memory_formulas(memory_hard_coded), r"zero_memory\(psi="),
    ("03", "Zero1: the grader's single-process AdamW copied into the model",
     lambda: g03.check_zero1_step(Zero1FromTheGrader, world_sizes=(2,)), CALLED.format("reference_adamw")),
    ("03", "Zero1: DDP (all-reduce + full AdamW) with a shard-sized decoy optimizer",
     lambda: g03.check_zero1_memory_and_traffic(Zero1LikeDDP, world_size=2), r"reduce_scatter"),
    ("03", "Zero1: the same through torch.distributed (untraced)",
     lambda: g03.check_zero1_step(Zero1Untraced, world_sizes=(2,)), UNTRACED.format("all_reduce")),
    ("03", "the parameter tolerance rebound in the grading module",
     lambda: (_zero_tolerance_loosened(), g03.check_partition(partition_from_fsdp_helper)),
     TAMPERED.format("zero.ATOL")),
    ("04", "column: backward all-gathers grad_y and the weights instead of one all-reduce",
     lambda: g04.check_column_parallel_linear(ColumnGathersWeights, tp_sizes=(2,)), r"communicated in backward"),
    ("04", "column: torch.distributed.all_reduce in backward (untraced)",
     lambda: g04.check_column_parallel_linear(ColumnUntraced, tp_sizes=(2,)), UNTRACED.format("all_reduce")),
    ("04", "column: x.grad computed from the grader's public data, a dummy all-reduce for the trace",
     lambda: g04.check_column_parallel_linear(ColumnFromPublicData, tp_sizes=(2,)), r"x\.grad is wrong"),
    ("04", "cross-entropy: all-gather the logits and F.cross_entropy",
     lambda: g04.check_vocab_parallel_cross_entropy_traffic(CrossEntropyGathersLogits, tp=2),
     r"more than one value per token"),
    ("04", "cross-entropy: a subclass of parlab's private autograd Function",
     lambda: g04.check_vocab_parallel_cross_entropy(CrossEntropySubclass, tp_sizes=(2,)),
     CALLED.format("_VocabParallelCrossEntropy")),
    ("04", "cross-entropy: parlab's private forward/backward called from the student's class",
     lambda: g04.check_vocab_parallel_cross_entropy(CrossEntropyPrivate, tp_sizes=(2,)),
     CALLED.format("_VocabParallelCrossEntropy")),
    ("04", "cross-entropy: F.cross_entropy patched to agree with a wrong answer",
     lambda: (_patch_cross_entropy(), g04.check_vocab_parallel_cross_entropy(CrossEntropyGathersLogits)),
     TAMPERED.format("cross_entropy")),
    ("05", "1F1B: the public cases' schedules hard-coded",
     lambda: g05.check_1f1b_reference(one_f_one_b_hard_coded), r"1F1B for p=\d+, m=\d+, rank \d+"),
    ("05", "1F1B valid: the public cases' schedules looked up",
     lambda: g05.check_1f1b_valid(one_f_one_b_looked_up, run_case=None), r"raised KeyError"),
    ("05", "1F1B: parlab's one_f_one_b from a dict of schedules",
     lambda: g05.check_1f1b_reference(one_f_one_b_from_dict), CALLED.format("one_f_one_b")),
    ("05", "1F1B: a freshly imported copy of parlab.parallel.pipeline",
     lambda: g05.check_1f1b_reference(one_f_one_b_reloaded), CALLED.format("one_f_one_b")),
    ("05", "bubble: the public cases' values hard-coded",
     lambda: g05.check_bubble_of_step(bubble_hard_coded), r"bubble_of_step\(p=\d+, m=\d+, v=\d+\) returned"),
    ("05", "bubble: a types.FunctionType copy of simulate",
     lambda: g05.check_bubble_of_step(bubble_simulated_by_copy), CALLED.format("simulate")),
    ("06", "merge: a copy of merge_partials by inspect.getsource + exec",
     lambda: g06.check_merge_partials(merge_copy_of_parlab), CALLED.format("merge_partials")),
    ("06", "merge: a copy of merge_partials handed in as the answer itself",
     lambda: g06.check_merge_partials(_MERGE), CALLED.format("merge_partials")),
    ("06", "zigzag positions: a functools.partial of parlab's shard_positions handed in",
     lambda: g06.check_zigzag_positions(functools.partial(ra.shard_positions, layout="zigzag")),
     CALLED.format("shard_positions")),
    ("06", "ring step: full attention from the grader's public inputs, sends for show",
     lambda: g06.check_ring_step(ring_step_from_public_inputs, world_sizes=(2,)), r"output differs"),
    ("06", "ring step: torch.distributed isend/irecv (untraced)",
     lambda: g06.check_ring_step(ring_step_untraced, world_sizes=(2,)), UNTRACED.format("(isend|irecv)")),
    ("06", "zigzag positions: parlab's shard_sequence through a partial",
     lambda: g06.check_zigzag_positions(zigzag_positions_by_sharding), CALLED.format("shard_sequence")),
    ("07", "groups: a subclass of ParallelGrid",
     lambda: g07.check_groups_4d(groups_4d_subclass), CALLED.format("ParallelGrid")),
    ("07", "groups: ParallelGrid objects built before the check",
     lambda: g07.check_groups_4d(groups_4d_prebuilt), CALLED.format("ParallelGrid")),
    ("07", "groups: the public layouts' groups looked up",
     lambda: g07.check_groups_4d(groups_4d_looked_up), r"raised KeyError"),
    ("07", "layout: parlab.cluster.planner.plan's best layout",
     lambda: g07.check_layout(choose_layout_by_planner), CALLED.format("(plan|enumerate_layouts)")),
    ("07", "search: parlab.cluster.planner.plan as a default argument",
     lambda: g07.check_layout_search(search_layout_default_arg), r"(called parlab's plan|planner\.plan)"),
    ("07", "search: the layouts printed by a passing run, hard-coded",
     lambda: (SEEN_LAYOUTS.update(_seen_layouts()), g07.check_layout_search(search_layout_hard_coded)),
     r"search_layout\("),
    ("08", "seq_to_head: torch.distributed.all_to_all_single (untraced)",
     lambda: g08.check_seq_to_head(seq_to_head_untraced, world_sizes=(2,)), UNTRACED.format("all_to_all_single")),
    ("08", "seq_to_head: a freshly imported parlab.parallel.context.ulysses, inside the ranks",
     lambda: g08.check_seq_to_head(seq_to_head_fresh_module, world_sizes=(2,)),
     r"you called parlab's .*\bseq_to_head; write your own"),
    ("08", "attention: parlab's private _SeqToHead / _HeadToSeq",
     lambda: g08.check_ulysses_attention(ulysses_private_function, world_sizes=(2,)), CALLED.format("_SeqToHead")),
    ("08", "attention: all-gather the whole sequence and attend locally",
     lambda: g08.check_ulysses_traffic(ulysses_gathers_everything), r"called comm\.all_gather"),
    ("08", "head_to_seq: parlab's private _a2a_head_to_seq",
     lambda: g08.check_head_to_seq(head_to_seq_private, world_sizes=(2,)), CALLED.format("_a2a_head_to_seq")),
    ("09", "gather: torch.distributed.all_gather_into_tensor (untraced)",
     lambda: g09.check_gather_full(gather_full_untraced, world_sizes=(2,)), UNTRACED.format("all_gather_into_tensor")),
    ("09", "unit: the full parameters kept in a global between forward and backward",
     lambda: g09.check_fsdp_unit_trace(FSDPKeepsFullInAGlobal), r"kept .* full"),
    ("09", "unit: parlab's private _GatherParams",
     lambda: g09.check_fsdp_unit_grads(FSDPPrivate, world_sizes=(2,)), CALLED.format("_GatherParams")),
    ("04", "cross-entropy: the logits all-gathered, then the event deleted from the trace",
     lambda: g04.check_vocab_parallel_cross_entropy_traffic(CrossEntropyHidesItsGather, tp=2),
     r"tampered: .*trace was edited by hand"),
    ("06", "ring step: the sends written into the trace by hand",
     lambda: g06.check_ring_traffic(ring_step_fake_trace), r"tampered: .*trace was edited by hand"),
    ("any", "parlab.trace.Trace.filter rebound in an earlier cell",
     lambda: (_patch_trace_method(), g09.check_gather_full(gather_full_untraced)), TAMPERED.format("Trace.filter")),
    ("any", "torch.Tensor.__sub__ rebound in an earlier cell",
     lambda: (_patch_tensor_sub(), g06.check_merge_partials(merge_copy_of_parlab)), TAMPERED.format("Tensor.__sub__")),
    ("any", "math.isclose rebound from inside the student's function, during the check",
     lambda: g02.check_make_buckets(buckets_patch_during_the_check), TAMPERED.format("math.isclose")),
]


# ---------------------------------------------------------------------- 10 mixture of experts
def balance_through_route(probs, expert, E):
    """parlab's route() on the log-probabilities: its aux loss is the balance loss (alpha 1)."""
    from parlab.models import route
    return route(probs.log(), expert.shape[1], aux_loss_coeff=1.0).aux_loss


def balance_detached(probs, expert, E):
    """The right number, computed outside autograd: no gradient reaches the router."""
    T, k = expert.shape
    f = torch.bincount(expert.reshape(-1), minlength=E).double() / (T * k)
    return torch.tensor(float(E * (f * probs.detach().mean(0)).sum()), dtype=torch.float64)


def capacity_first_come(expert, weight, E, cap):
    """Keeps the first tokens that chose an expert (arrival order), not the highest weights."""
    keep, seen = torch.zeros_like(expert, dtype=torch.bool), [0] * E
    for i, e in enumerate(expert.reshape(-1).tolist()):
        keep.view(-1)[i] = seen[e] < cap
        seen[e] += 1
    return keep


def dispatch_untraced(x_sorted, counts):
    import torch.distributed as dist
    P = dist.get_world_size()
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send, recv = counts.view(P, -1).sum(1).tolist(), recv_counts.view(P, -1).sum(1).tolist()
    out = x_sorted.new_empty((sum(recv), x_sorted.shape[1]))
    dist.all_to_all_single(out, x_sorted, recv, send)
    return out


def dispatch_even_padded(x_sorted, counts):
    """Every rank pads its blocks to the largest and sends even splits (right rows, not the traffic asked for)."""
    P = comm.get_world_size()
    recv_counts = torch.empty_like(counts)
    comm.all_to_all(recv_counts, counts)
    send, recv = counts.view(P, -1).sum(1).tolist(), recv_counts.view(P, -1).sum(1).tolist()
    most = torch.tensor([max(send + recv)])
    comm.all_reduce(most, op=comm.ReduceOp.MAX)
    blocks = torch.split(x_sorted, send)
    padded = torch.cat([torch.cat([b, b.new_zeros(int(most) - len(b), b.shape[1])]) for b in blocks])
    out = torch.empty_like(padded)
    comm.all_to_all(out, padded)
    return torch.cat([blk[:n] for blk, n in zip(out.chunk(P), recv)])


def dispatch_private_rows(x_sorted, counts):
    from parlab.parallel.expert import comm as d
    P = comm.get_world_size()
    recv_counts = d.exchange_counts(counts).reshape(-1)
    return d.all_to_all_rows(x_sorted, counts.view(P, -1).sum(1).tolist(), recv_counts.view(P, -1).sum(1).tolist())


CHEATS += [
    ("10", "balance: parlab's route() and its aux loss",
     lambda: g10.check_load_balancing_loss(balance_through_route), CALLED.format("(route|load_balancing_loss)")),
    ("10", "balance: the right number outside autograd",
     lambda: g10.check_load_balancing_loss(balance_detached), r"does not depend on probs through autograd"),
    ("10", "capacity: the first tokens in arrival order",
     lambda: g10.check_capacity(capacity_first_come), r"keeps the first tokens in order"),
    ("10", "dispatch: torch.distributed.all_to_all_single (untraced)",
     lambda: g10.check_dispatch(dispatch_untraced, world_sizes=(2,)), UNTRACED.format("all_to_all_single")),
    ("10", "dispatch: blocks padded to even splits, plus an all-reduce",
     lambda: g10.check_dispatch_traffic(dispatch_even_padded), r"called \['all_to_all', 'all_reduce', 'all_to_all'\]"),
    ("10", "dispatch: parlab's exchange_counts and all_to_all_rows",
     lambda: g10.check_dispatch(dispatch_private_rows, world_sizes=(2,)), CALLED.format("(exchange_counts|all_to_all_rows)")),
]


@pytest.fixture
def untouched():
    """Undo what a cheat rebinds in the grading modules or torch, so the next test starts clean."""
    import math
    from parlab.trace import Trace
    saved = (dict(g02.TOL), g03.ATOL, F.cross_entropy, Trace.filter, torch.Tensor.__sub__, math.isclose)
    yield
    g02.TOL.clear()
    g02.TOL.update(saved[0])
    g03.ATOL, F.cross_entropy, Trace.filter, torch.Tensor.__sub__, math.isclose = saved[1:]
    assert guard.tampered() == []


@pytest.mark.parametrize("case", CHEATS, ids=[f"{ex} {what}" for ex, what, *_ in CHEATS])
def test_cheat_fails_with_a_reason(case, untouched):
    ex, what, run, says = case
    with pytest.raises(AssertionError) as err:
        run()
    assert __import__("re").search(says, str(err.value)), f"{ex} {what}: {err.value}"
