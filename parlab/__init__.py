"""parlab: learn how large models are trained on many GPUs by running it.

    import parlab
    res = parlab.run(fn, world_size=4, trace=True)   # simulated ranks (gloo on CPU) or one GPU per rank
    ctx = parlab.init()                               # the same code under torchrun
"""
from . import comm, trace
from .launch import RankError, RankKilled, RankTimeout, RunResult, run
from .torchrun import Context, init
from .trace import Trace, region

__version__ = "0.1.0"
__all__ = ["run", "init", "Context", "RunResult", "RankError", "RankTimeout", "RankKilled", "Trace", "region",
           "comm", "trace"]
