"""Run a lab module under the suite's GPU guards: ``python tests/lab_guard.py parlab.labs.NAME [options]``.

torchrun starts the lab's ranks as fresh processes, so the guards the rest of the suite gets from
tests/conftest.py (strict communication checks) and from tests/serialised_p2p.py (NCCL's point-to-point
rules on gloo) are entered here, around the lab's ``__main__``."""
import runpy
import sys

from parlab import comm
from serialised_p2p import serialised_p2p

if __name__ == "__main__":
    module, sys.argv = sys.argv[1], [sys.argv[1]] + sys.argv[2:]
    with comm.strict(), serialised_p2p():
        runpy.run_module(module, run_name="__main__", alter_sys=True)
