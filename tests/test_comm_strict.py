"""Strict mode of parlab.comm: each tensor NCCL would refuse or mishandle is stopped with a clear error."""
import torch
import torch.distributed as dist

import parlab
from parlab import comm
from parlab.comm import strict_mode as comm_strict


def _violations():
    """Each bad call on a 2-rank gloo group: the StrictCommError message (both ranks make the same calls, so a
    call that wrongly got through would still complete)."""
    out = {}
    bad = {
        "meta device": lambda: comm.all_reduce(torch.zeros(4, device="meta")),
        "non-contiguous": lambda: comm.all_reduce(torch.zeros(4, 4).T),
        "non-contiguous output": lambda: comm.all_gather(torch.zeros(4, 4).T, torch.zeros(2, 4)),
        "int16": lambda: comm.broadcast(torch.zeros(4, dtype=torch.int16), src=0),
        "complex": lambda: comm.send(torch.zeros(4, dtype=torch.complex64), dst=1 - dist.get_rank()),
        "avg on int": lambda: comm.all_reduce(torch.zeros(4, dtype=torch.int64), op=comm.ReduceOp.AVG),
        "avg on int reduce_scatter": lambda: comm.reduce_scatter(torch.zeros(2, dtype=torch.int32),
                                                                 torch.zeros(4, dtype=torch.int32),
                                                                 op=comm.ReduceOp.AVG),
    }
    if dist.get_rank() == 0:   # only the root holds a gather list (rank 1 would wait in the gather)
        bad["gather list"] = lambda: comm.gather(torch.zeros(4), [torch.zeros(4), torch.zeros(8)[::2]], dst=0)
    with comm.strict():
        for name, call in bad.items():
            try:
                call()
                out[name] = None
            except comm.StrictCommError as e:
                out[name] = str(e)
        with comm.strict(device="cuda:1"):   # a rank whose device is a GPU: CPU tensors are refused
            try:
                comm.all_reduce(torch.zeros(4))
                out["cpu on a gpu rank"] = None
            except comm.StrictCommError as e:
                out["cpu on a gpu rank"] = str(e)
        ok = torch.ones(4)                   # and good calls still work in strict mode
        comm.all_reduce(ok, op=comm.ReduceOp.AVG)
        comm.all_reduce(torch.ones(2, dtype=torch.int64))
        comm.all_gather_dim(torch.ones(2, 3).T, dim=1)   # the convenience makes its input contiguous itself
    out["ok"] = float(ok[0])
    return out


def test_strict_mode_stops_each_kind_of_bad_tensor_with_a_clear_message():
    res = parlab.run(_violations, 2, timeout=30, echo=False).results[0]
    assert "a tensor on meta but this rank communicates on cpu" in res["meta device"]
    assert "non-contiguous" in res["non-contiguous"] and ".contiguous()" in res["non-contiguous"]
    assert "all_gather: a non-contiguous" in res["non-contiguous output"]
    assert "dtype torch.int16 is not one NCCL supports" in res["int16"]
    assert "dtype torch.complex64" in res["complex"]
    assert "ReduceOp.AVG on torch.int64" in res["avg on int"] and "ReduceOp.SUM" in res["avg on int"]
    assert "reduce_scatter: ReduceOp.AVG on torch.int32" in res["avg on int reduce_scatter"]
    assert "gather: a non-contiguous" in res["gather list"]
    assert "on cpu but this rank communicates on cuda:1" in res["cpu on a gpu rank"]
    assert res["ok"] == 1.0


def test_strict_mode_is_a_scoped_context_not_a_global_switch():
    assert comm_strict._STRICT, "tests/conftest.py runs every test in strict mode"
    depth = len(comm_strict._STRICT)
    with comm.strict(device="cpu") as s:
        assert comm_strict._STRICT[-1] is s and s.device == torch.device("cpu")
    assert len(comm_strict._STRICT) == depth
