"""Exercise 02's checks pass the reference solution and reject the mistakes students make, saying what is wrong:
a sum instead of an average, a gradient never all-reduced, a hook registered twice or on a frozen parameter, an
off-by-one bucket boundary, per-step state never reset, one all-reduce per parameter instead of per bucket,
blocking all-reduces, all-reduces launched only after backward. Plus the lesson's figures (parlab.viz.data_parallel).
"""
import pytest
import torch

from parlab import comm
from parlab.course.grading import data_parallel as grading
from parlab.viz import data_parallel as dpviz
from parlab.viz import from_records


# ---------------------------------------------------------------------- the reference solution (as in the notebook)
def attach_grad_hooks(model):
    world = comm.get_world_size()

    def average(p):
        comm.all_reduce(p.grad)
        p.grad /= world

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(average)


def make_buckets(nbytes, cap_bytes):
    buckets, size = [], 0
    for i, b in enumerate(nbytes):
        if not buckets or size + b > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += b
    return buckets


class BucketedGradSync:
    def __init__(self, model, bucket_cap_bytes):
        self.world = comm.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        layout = make_buckets([p.numel() * p.element_size() for p in params], bucket_cap_bytes)
        self.buckets = [[params[j] for j in idx] for idx in layout]
        self.buffers = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype) for b in self.buckets]
        self.where = {}
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.where[p] = (i, offset)
                offset += p.numel()
        self.ready = [0] * len(self.buckets)
        self.works = [None] * len(self.buckets)
        for p in params:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def copy_in(self, p):
        i, offset = self.where[p]
        self.buffers[i][offset: offset + p.numel()].copy_(p.grad.reshape(-1))
        self.ready[i] += 1
        return i

    def launch(self, i):
        self.works[i] = comm.all_reduce(self.buffers[i], async_op=True, label=f"grad bucket {i}")

    def on_grad_ready(self, p):
        i = self.copy_in(p)
        if self.ready[i] == len(self.buckets[i]):
            self.launch(i)

    def copy_out(self, i):
        for p in self.buckets[i]:
            _, offset = self.where[p]
            p.grad.copy_(self.buffers[i][offset: offset + p.numel()].view_as(p))

    def reset(self):
        self.ready = [0] * len(self.buckets)
        self.works = [None] * len(self.buckets)

    def finish(self):
        for i in range(len(self.buckets)):
            self.works[i].wait()
            self.buffers[i] /= self.world
            self.copy_out(i)
        self.reset()


# ---------------------------------------------------------------------- wrong answers
def hooks_sum_only(model):
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: comm.all_reduce(p.grad))


def hooks_no_all_reduce(model):
    world = comm.get_world_size()

    def divide(p):
        p.grad /= world

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(divide)


def hooks_twice(model):                  # right gradients (the average of equal averages), twice the calls
    attach_grad_hooks(model)
    attach_grad_hooks(model)


def hooks_on_every_parameter(model):     # forgets requires_grad: torch refuses a hook on the frozen wpe
    world = comm.get_world_size()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: (comm.all_reduce(p.grad), p.grad.div_(world)))


def buckets_strict(nbytes, cap_bytes):   # closes a bucket when it is exactly full: off by one
    buckets, size = [], 0
    for i, b in enumerate(nbytes):
        if not buckets or size + b >= cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += b
    return buckets


def buckets_never_close(nbytes, cap_bytes):
    return [list(range(len(nbytes)))]


class NoAverage(BucketedGradSync):
    def finish(self):
        for i in range(len(self.buckets)):
            self.works[i].wait()
            self.copy_out(i)
        self.reset()


class NoReset(BucketedGradSync):
    def reset(self):
        pass


class PerParameter(BucketedGradSync):    # right gradients, one all-reduce per gradient instead of per bucket
    def on_grad_ready(self, p):
        comm.all_reduce(p.grad)
        self.copy_in(p)

    def finish(self):
        for i in range(len(self.buckets)):
            self.buffers[i] /= self.world
            self.copy_out(i)
        self.reset()


class Blocking(BucketedGradSync):
    def launch(self, i):
        comm.all_reduce(self.buffers[i], label=f"grad bucket {i}")
        self.works[i] = _Done()


class _Done:
    def wait(self):
        pass


class AllAtTheEnd(BucketedGradSync):     # right gradients, but no overlap: everything launched in finish()
    def on_grad_ready(self, p):
        self.copy_in(p)

    def finish(self):
        for i in range(len(self.buckets)):
            self.launch(i)
        super().finish()


# ---------------------------------------------------------------------- the reference passes
def test_reference_solution_passes_every_check(capsys):
    grading.check_hook_grads(attach_grad_hooks, world_sizes=(2, 4))
    grading.check_hook_all_reduce_calls(attach_grad_hooks)
    grading.check_make_buckets(make_buckets)
    grading.check_bucketed_grads(BucketedGradSync, world_sizes=(2, 4))
    grading.check_bucketed_all_reduce_calls(BucketedGradSync)
    out = capsys.readouterr().out
    assert out.count("\n") == 5 and "one per bucket" in out


def test_reference_gradients_are_the_mean_of_the_slices():
    want = grading.reference_grads(1)[0]
    for world in (2, 4):
        slices = [grading.local_grads(r, world) for r in range(world)]
        for name, w in want.items():
            torch.testing.assert_close(sum(s[name] for s in slices) / world, w, **grading.TOL)
    assert grading.FROZEN[0] not in want and "wte.weight" in want and "lm_head.weight" not in want   # tied: once


# ---------------------------------------------------------------------- wrong answers are rejected, with the reason
@pytest.mark.parametrize("fn, says", [
    (hooks_sum_only, "SUM over the ranks, not the average"),
    (hooks_no_all_reduce, "own gradient divided by the world size: the all-reduce is missing"),
    (hooks_on_every_parameter, "raised RuntimeError"),
])
def test_hook_grads_rejects(fn, says):
    with pytest.raises(AssertionError, match=says) as e:
        grading.check_hook_grads(fn, world_sizes=(2,))
    assert "rank" in str(e.value) and "Hint" in str(e.value) or "RuntimeError" in str(e.value)


def test_hook_calls_reject_a_gradient_reduced_twice():
    grading.check_hook_grads(hooks_twice, world_sizes=(2,))          # the gradients are right ...
    with pytest.raises(AssertionError, match=r"made \d+ all-reduce calls.*reduced twice"):
        grading.check_hook_all_reduce_calls(hooks_twice)             # ... the count is not


@pytest.mark.parametrize("fn, case", [(buckets_strict, "[4, 4, 4]"), (buckets_never_close, "[4, 4, 4]")])
def test_make_buckets_rejects(fn, case):
    with pytest.raises(AssertionError, match=r"make_buckets\(" + case.replace("[", r"\[").replace("]", r"\]")) as e:
        grading.check_make_buckets(fn)
    assert "expected" in str(e.value) and "<= cap_bytes" in str(e.value)


def test_unwritten_code_says_so():
    def unwritten(*args):
        raise NotImplementedError

    with pytest.raises(AssertionError, match="is not written yet"):
        grading.check_make_buckets(unwritten)
    with pytest.raises(AssertionError, match="is not written yet"):
        grading.check_hook_grads(unwritten, world_sizes=(2,))


@pytest.mark.parametrize("cls, says", [
    (NoAverage, "SUM over the ranks, not the average"),
    (NoReset, "(?s)step 1.*Step 0 was right"),
])
def test_bucketed_grads_rejects(cls, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_bucketed_grads(cls, world_sizes=(2,))


@pytest.mark.parametrize("cls, says", [
    (PerParameter, "That is one per parameter"),
    (Blocking, "blocking"),
    (AllAtTheEnd, "started after backward had finished"),
])
def test_bucketed_calls_reject(cls, says):
    with pytest.raises(AssertionError, match=says):
        grading.check_bucketed_all_reduce_calls(cls)


def test_bucket_layout_is_reverse_registration_order():
    layout = grading.bucket_layout(1)                                 # one bucket per parameter
    assert [b[0] for b in layout] == grading.trainable_names(grading.grader_model())[::-1]
    assert len(grading.bucket_layout(10 ** 9)) == 1


# ---------------------------------------------------------------------- the lesson's figures and trace readings
def _ddp_step_records():
    """Two ranks, two steps of a made-up DDP trace: backward spans, two bucket all-reduces, a grad sync."""
    recs = []
    for step in range(2):
        t = 10.0 * step
        for r in range(2):
            g = dict(rank=r, group=[0, 1], kind="collective", op="all_reduce", asynchronous=True)
            recs += [dict(rank=r, op="forward", start=t, end=t + 1),
                     dict(rank=r, op="backward", start=t + 1, end=t + 2, label="until bucket 0 ready"),
                     dict(g, start=t + 2, end=t + 3.5, nbytes=300, label="grad bucket 0"),
                     dict(rank=r, op="backward", start=t + 2, end=t + 3, label="until bucket 1 ready"),
                     dict(g, start=t + 3, end=t + 4, nbytes=100, label="grad bucket 1"),
                     dict(rank=r, op="backward", start=t + 3, end=t + 3.2, label="rest of backward"),
                     dict(rank=r, op="grad sync", start=t + 3.2, end=t + 4)]
    return from_records(recs)


def test_split_steps_and_overlap():
    steps = dpviz.split_steps(_ddp_step_records(), lambda e: e.kind == "compute" and e.op == "forward")
    assert len(steps) == 2 and all(len(s.events) == 14 for s in steps)
    ov = dpviz.ddp_overlap(steps[1], rank=0)
    assert ov["buckets"] == 2
    assert ov["launched_early"] == pytest.approx(300 / 400)            # bucket 0 only: bucket 1 starts with the rest
    assert ov["backward_s"] == pytest.approx(2.2) and ov["wait_s"] == pytest.approx(0.8)
    assert ov["hidden"] == pytest.approx((1.2 + 0.2) / 2.5)           # all-reduce time inside [1, 3.2]
    with pytest.raises(ValueError, match="no backward spans"):
        dpviz.ddp_overlap(steps[1].filter(op="forward"), rank=0)


def test_phase_and_memory_bars_share_axes_and_legend():
    traffic = {"naive": {"replicate model": {0: 8e6, 1: 8e6}, "reduce grads": {0: 0, 1: 8e6}},
               "DDP": {"grad bucket": {0: 6e6, 1: 6e6}}}
    fig = dpviz.phase_bars(traffic, steps=2)
    bars = {(d.name, d.xaxis): list(d.y) for d in fig.data}
    assert bars[("replicate model", "x")] == [4.0, 4.0] and bars[("grad bucket", "x2")] == [3.0, 3.0]
    assert fig.layout.barmode == "stack" and fig.layout.yaxis2.matches == "y"   # one scale for both panels
    mem = dpviz.memory_bars({"naive": [{"params": 2e6, "optimizer": 4e6}, {"params": 2e6, "optimizer": 0}],
                             "DDP": [{"params": 2e6, "optimizer": 4e6}] * 2})
    shown = [d.name for d in mem.data if d.showlegend]
    assert shown == ["params", "optimizer"]                                # each category in the legend once
    assert [list(d.y) for d in mem.data if d.name == "optimizer"] == [[4.0, 0.0], [4.0, 4.0]]
