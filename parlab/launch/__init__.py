"""parlab.launch: starting ranks, on one machine or under a cluster launcher.

    res = parlab.run(fn, 4, trace=True)      # 4 simulated ranks (processes, gloo on the CPU)
    ctx = parlab.init()                      # this process is one rank of torchrun or srun

Read in this order:

* ``ranks.py``     `run(fn, world_size)`: fork (or spawn) the ranks, rendezvous through a file store, bring back
                    results, output and traces in rank order; faults become `RankError`, `RankTimeout`,
                    `RankKilled`, never a hang.
* ``blame.py``     waiting for the ranks, and the exception that names the cause of a failure, not the peers
                    that saw its broken connection.
* ``child.py``     the rank's side of `run`: the process group, one thread, the trace, the report home.
* ``torchrun.py``  `init()` under torchrun or srun (SLURM's variables read), the device of this rank, a clean
                    exit.
* ``watch.py``     `Watch`: the labs' heartbeats in the store, who stopped answering, a job that ends instead of
                    hanging; `watch_peers` starts one per rank, and `report_failures` prints its report when
                    a collective fails.
"""
from parlab.launch.child import to_cpu
from parlab.launch.blame import RankError, RankKilled, RankTimeout
from parlab.launch.ranks import RunResult, choose_backend, run
from parlab.launch.torchrun import Context, check_timeout, init, local_world_size

__all__ = ["run", "RunResult", "RankError", "RankTimeout", "RankKilled", "choose_backend", "to_cpu", "init",
           "Context", "check_timeout", "local_world_size"]
