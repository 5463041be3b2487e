"""Strict mode for parlab's communication: catch on gloo what NCCL would refuse or get wrong.

``with comm.strict(): ...`` (the test suite runs in it) checks every tensor handed to a `parlab.comm` call
before it reaches torch.distributed: on the rank's device (``cuda:<current>`` under NCCL, the CPU under gloo),
contiguous, of a dtype NCCL supports, and ReduceOp.AVG only on floating types. gloo accepts much that NCCL
refuses or mishandles, so on a CPU machine this is how GPU-only failures show up; a violation raises
`StrictCommError` saying what to change.

References: NCCL documentation, "Data types" (ncclDataType_t) and "Reduction operations" (ncclAvg on floating
types); torch.distributed ProcessGroupNCCL (dtype mapping, contiguity and device checks).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

__all__ = ["StrictCommError", "NCCL_DTYPES", "Strict", "strict"]


class StrictCommError(ValueError):
    """A tensor handed to communication that NCCL would refuse or mishandle (raised in strict mode)."""


# The dtypes ProcessGroupNCCL maps to an NCCL type (bool travels as uint8); float8 and complex need care
# (no reductions on float8 before NCCL 2.24; complex is viewed as real), so strict mode leaves them out.
NCCL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                         torch.int32, torch.int64, torch.bool})


class Strict:
    """The checks of strict mode; `device` is the rank's device (None: cuda:<current> under NCCL, else CPU)."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None

    def expected_device(self, group) -> torch.device:
        if self.device is not None:
            return self.device
        if "nccl" in str(dist.get_backend(group)):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def check(self, op: str, tensors, group=None, reduce_op=None) -> None:
        device = None
        for t in tensors:
            if t is None:
                continue
            device = device or self.expected_device(group)
            dev = t.device if t.device.type != "cuda" or t.device.index is not None else torch.device(
                "cuda", torch.cuda.current_device())
            if dev != device:
                raise StrictCommError(f"{op}: a tensor on {t.device} but this rank communicates on {device}; "
                                      f"create it with device=... or move it with .to({str(device)!r}) first")
            if not t.is_contiguous():
                raise StrictCommError(f"{op}: a non-contiguous tensor of shape {tuple(t.shape)} (a view such as "
                                      f"a transpose or a strided slice); NCCL needs one dense block: pass "
                                      f".contiguous()")
            if t.dtype not in NCCL_DTYPES:
                raise StrictCommError(f"{op}: dtype {t.dtype} is not one NCCL supports; use one of "
                                      f"{', '.join(sorted(str(d).replace('torch.', '') for d in NCCL_DTYPES))} "
                                      f"(e.g. .to(torch.float32) before, and back after)")
            if reduce_op == ReduceOp.AVG and not t.is_floating_point():
                raise StrictCommError(f"{op}: ReduceOp.AVG on {t.dtype}; an average needs a floating type: sum "
                                      f"(ReduceOp.SUM) and divide, or convert to float first")


_STRICT: list[Strict] = []   # active strict checks of this process, innermost last (like trace's recorders)


@contextlib.contextmanager
def strict(device: torch.device | str | None = None):
    """Check every tensor handed to communication inside the block (see module docstring); `device` overrides
    the rank's device (default: cuda:<current> under NCCL, the CPU otherwise)."""
    s = Strict(device)
    _STRICT.append(s)
    try:
        yield s
    finally:
        _STRICT.remove(s)


def _strict(op: str, group, *tensors, reduce_op=None) -> None:
    """Strict mode's check of one call (nothing when strict mode is off)."""
    if _STRICT:
        _STRICT[-1].check(op, tensors, group, reduce_op)


__all__ += ["strict", "Strict", "StrictCommError", "NCCL_DTYPES"]
