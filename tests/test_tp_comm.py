"""The conjugate TP/SP operators: each forward and backward computes what its docstring says, and the
trace shows exactly one collective of the stated kind in the stated direction."""
import pytest
import torch
import torch.distributed as dist

import parlab
from parlab.parallel.tensor import mappings as tp_comm

# (parlab.run forks ranks with one torch thread each; the timeout turns a deadlock into a failure)
RUN = dict(timeout=60, echo=False)

OPS = {  # name -> (function, collective in forward, collective in backward)
    "f": (tp_comm.copy_to_tp, None, "all_reduce"),
    "g": (tp_comm.reduce_from_tp, "all_reduce", None),
    "scatter_to_tp": (tp_comm.scatter_to_tp, None, "all_gather"),
    "gather_from_tp": (tp_comm.gather_from_tp, "all_gather", None),
    "scatter_to_sp": (tp_comm.scatter_to_sp, None, "all_gather"),
    "gather_from_sp": (tp_comm.gather_from_sp, "all_gather", "reduce_scatter"),
    "reduce_scatter_to_sp": (tp_comm.reduce_scatter_to_sp, "reduce_scatter", "all_gather"),
}


def _every_op():
    """Each op on a rank-dependent input x (B=2, S=4, H=4); backward of sum(out * w) with a rank-dependent w."""
    r = dist.get_rank()
    out = {}
    for name, (fn, _, _) in OPS.items():
        x = (torch.arange(32, dtype=torch.float64).view(2, 4, 4) + 100 * r).requires_grad_()
        y = fn(x, label=name)
        w = torch.arange(y.numel(), dtype=torch.float64).view_as(y) * (r + 1)  # upstream gradient
        (y * w).sum().backward()
        out[name] = (y.detach(), w, x.grad)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_forward_and_backward_do_what_they_say(tp):
    res = parlab.run(_every_op, tp, trace=True, **RUN)
    xs = [torch.arange(32, dtype=torch.float64).view(2, 4, 4) + 100 * r for r in range(tp)]
    for r, out in enumerate(res.results):
        ws = {name: [o[name][1] for o in res.results] for name in OPS}
        # f: identity forward; backward sums the gradients of all ranks
        y, _, gx = out["f"]
        assert torch.equal(y, xs[r]) and torch.equal(gx, sum(ws["f"]))
        # g: forward sums the inputs; backward passes the gradient through
        y, w, gx = out["g"]
        assert torch.equal(y, sum(xs)) and torch.equal(gx, w)
        # last dim: scatter keeps my slice, its backward gathers every rank's slice gradient
        y, _, gx = out["scatter_to_tp"]
        assert torch.equal(y, xs[r].chunk(tp, -1)[r]) and torch.equal(gx, torch.cat(ws["scatter_to_tp"], -1))
        y, w, gx = out["gather_from_tp"]
        assert torch.equal(y, torch.cat(xs, -1)) and torch.equal(gx, w.chunk(tp, -1)[r])
        # sequence (dim 1)
        y, _, gx = out["scatter_to_sp"]
        assert torch.equal(y, xs[r].chunk(tp, 1)[r]) and torch.equal(gx, torch.cat(ws["scatter_to_sp"], 1))
        y, w, gx = out["gather_from_sp"]
        assert torch.equal(y, torch.cat(xs, 1))
        assert torch.equal(gx, sum(ws["gather_from_sp"]).chunk(tp, 1)[r])       # reduce-scatter of the grads
        y, w, gx = out["reduce_scatter_to_sp"]
        assert torch.equal(y, sum(xs).chunk(tp, 1)[r])
        assert torch.equal(gx, torch.cat(ws["reduce_scatter_to_sp"], 1))          # all-gather of the grads


@pytest.mark.parametrize("tp", [2, 4])
def test_each_op_is_one_traced_collective_in_the_stated_direction(tp):
    tr = parlab.run(_every_op, tp, trace=True, **RUN).trace
    for r in range(tp):
        for name, (_, fwd, bwd) in OPS.items():
            evs = [e for e in tr.filter(rank=r).comm() if e.label.startswith(name + " ")]
            got = sorted((e.label.rsplit(" ", 1)[1], e.op) for e in evs)
            want = sorted([("fwd", fwd)] * (fwd is not None) + [("bwd", bwd)] * (bwd is not None))
            assert got == want, name
            assert all(e.group == tuple(range(tp)) for e in evs)


def test_a_group_of_one_communicates_nothing():
    res = parlab.run(_every_op, 1, trace=True, **RUN)
    assert len(res.trace.comm()) == 0
    y, w, gx = res.results[0]["f"]
    assert torch.equal(gx, w)


def _odd_sequence():
    x = torch.zeros(2, 3, 4)  # S = 3 cannot be split over 2 ranks
    tp_comm.reduce_scatter_to_sp(x)


def test_sequence_not_divisible_is_a_clear_error():
    with pytest.raises(parlab.RankError, match="size 3 over 2 ranks; choose a sequence length that is a multiple"):
        parlab.run(_odd_sequence, 2, **RUN)
