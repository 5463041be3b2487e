"""A lab's ranks as torchrun starts them, without torchrun: forked from the calling process with the environment
torchrun gives its workers (`torchrun_env`).

torchrun's agent hosts the rendezvous store and starts each worker with RANK, LOCAL_RANK, WORLD_SIZE, ...,
MASTER_ADDR and MASTER_PORT of that store and TORCHELASTIC_USE_AGENT_STORE=True
(torch/distributed/elastic/agent/server/local_elastic_agent.py); `run_forked` forks a process that hosts the
store and then the workers, so a lab's code runs as under torchrun without importing torch and parlab again in
every rank (2.5-3 s of CPU each). Used by tests/test_labs.py (every lab) and tests/test_slurm.py (the run an srun
job is compared with).
"""
import multiprocessing
import os
import runpy
import sys

import torch


def torchrun_env(rank: int, world: int, port: int) -> dict:
    """What torchrun --standalone --nproc_per_node=`world` sets for worker `rank` (one node, first attempt)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(world), "WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "parlab-test", "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1"}


def _worker(module: str, argv: list, env: dict, out: str, cwd: str) -> None:
    """One forked rank: its output to `out` (file descriptors and fresh stream objects, as parlab.run's ranks),
    then lab_guard.py's guards around the lab's ``__main__``."""
    from parlab import comm
    from serialised_p2p import serialised_p2p
    code = 1
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.chdir(cwd)
        os.environ.update(env)
        torch.set_num_threads(1)                     # OMP_NUM_THREADS=1, read by torch only when it starts
        sys.argv = [module, *argv]
        with comm.strict(), serialised_p2p():
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        sys.excepthook(*sys.exc_info())              # what the interpreter does with an uncaught exception
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _host_store(ranks: int, conn) -> None:
    """The rendezvous store's process (torchrun's agent's part): serves until the process that forked it kills
    it, or goes away itself."""
    import signal

    from parlab.launch.child import _die_with_parent
    _die_with_parent()                                              # as parlab.run's ranks: dies with the test
    store = torch.distributed.TCPStore("127.0.0.1", 0, ranks, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    while True:
        signal.pause()


def start_forked(module: str, argv: list, ranks: int, folder) -> tuple:
    """Start the ranks of ``python -m module argv`` as torchrun would, without waiting: (the process hosting the
    rendezvous store, as torchrun's agent does: the caller kills it once the ranks are done; the ranks' processes).
    Rank r writes to ``folder/rank<r>.out``.

    The store lives in a process of its own, not in a thread of this one: its server thread looks up the names of
    the ranks that connect (getnameinfo), and a rank forked while it held glibc's resolver lock inherited the
    lock held and waited for it forever (seen once in CI: one rank of four stuck in getnameinfo)."""
    import torch._dynamo  # noqa: F401  (what every rank's optimizer imports: once, here)
    import parlab.labs  # noqa: F401
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    host = ctx.Process(target=_host_store, args=(ranks, send), name="rendezvous-store")
    host.start()
    if not receive.poll(60):
        host.kill()
        raise RuntimeError("the rendezvous store's process did not start within 60 s")
    port = receive.recv()
    procs = [ctx.Process(target=_worker, args=(module, argv, torchrun_env(r, ranks, port),
                                               str(folder / f"rank{r}.out"), str(folder))) for r in range(ranks)]
    for p in procs:
        p.start()
    return host, procs


def run_forked(module: str, argv: list, ranks: int, tmp_path, timeout: float = 300) -> str:
    """Run ``python -m module argv`` on `ranks` ranks as torchrun would; the ranks' output, in rank order. Every
    rank must exit with 0."""
    host, procs = start_forked(module, argv, ranks, tmp_path)
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs + [host]:
            if p.is_alive():
                p.kill()
            p.join()
    out = "".join((tmp_path / f"rank{r}.out").read_text() for r in range(ranks))
    assert [p.exitcode for p in procs] == [0] * ranks, f"{module} failed:\n{out[-4000:]}"
    return out
