"""Run a lab module under the suite's GPU guards: ``python tests/lab_guard.py parlab.labs.NAME [options]``.

torchrun starts the lab's ranks as fresh processes, so the guards the rest of the suite gets from
tests/conftest.py (strict communication checks) and from tests/serialised_p2p.py (NCCL's point-to-point
rules on gloo) are entered here, around the lab's ``__main__``."""
import contextlib
import runpy
import sys

import torch

from parlab import comm
from serialised_p2p import serialised_p2p

if __name__ == "__main__":
    module, sys.argv = sys.argv[1], [sys.argv[1]] + sys.argv[2:]
    # with GPUs the labs pick NCCL (--backend auto), whose rules the shim only emulates on gloo (its tokens
    # are CPU tensors, which NCCL cannot send): there the real thing checks the order
    p2p_rules = contextlib.nullcontext() if torch.cuda.is_available() else serialised_p2p()
    with comm.strict(), p2p_rules:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
