"""Suite-wide setup: every test runs in `parlab.comm.strict()` mode.

Strict mode checks every tensor handed to communication (on the rank's device, contiguous, an NCCL dtype,
AVG only on floating types), so tests on CPU/gloo fail where NCCL on GPUs would. The fixture enters it in the
pytest process; ranks started by `parlab.run` fork from it and inherit it (the spawn start method, used by one
launch test only, starts fresh interpreters without it)."""
import os
from pathlib import Path

# torch's intra-op threads (libgomp's pool, two a process on 2 cores) spin after each parallel region before they
# sleep, unless OMP_WAIT_POLICY says PASSIVE. With three workers, their kernels and subprocesses sharing 2 cores,
# that spinning took the cores others waited for: the README's command 672 -> 604-622 busy CPU s, 341 -> 305-312 s
# (benchmarks/README.md).
# Set here, in the process that starts the workers (this conftest loads before it starts them) and before torch
# loads libgomp, which reads it once; every process of the suite inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

import nbval_kernel_retry  # noqa: F401  (a kernel that dies while starting is started again, for the suite's
                           # own nbval run of tests/notebooks/launcher.ipynb too: it failed one CI run so)

# torch is imported by the hooks below, in the processes that collect and run tests: the xdist controller, which
# only loads this file and starts the workers, never pays for it (1.2 CPU s).
# tests/notebooks/old_layout/ holds students' notebooks saved from the flat layout: tests/test_grade_redteam.py
# grades them through `parlab grade` (which runs them); nbval need not run them a second time.
collect_ignore_glob = ["notebooks/old_layout/*"]


def pytest_ignore_collect(collection_path, config):
    """tests/gpu/ needs CUDA (NCCL collectives, CUDA events, meta construction on a GPU): it is collected only
    where there is a device (`python -m parlab.labs.gpu_check` runs it on a GPU node), so a CPU run reports no
    skips; tests/test_labs.py::test_gpu_tests_import_on_cpu checks on every machine that the file still imports."""
    if collection_path.name == "gpu" and collection_path.parent == Path(__file__).parent:
        import torch
        return None if torch.cuda.is_available() else True
    return None


@pytest.fixture(autouse=True)
def _strict_comm():
    from parlab import comm
    with comm.strict():
        yield


# The README's command runs the suite on three pytest-xdist workers, a file at a time (`-n 3 --dist loadfile`, so a
# module's fixtures run once; three, not two, on 2 cores because many tests mostly wait: on subprocesses,
# timeouts, browsers), except the files whose tests run simulated ranks in the worker itself (`RANKS`): one worker
# runs them one after the other (`pytest_xdist_make_scheduler`). One 8-rank world already keeps both cores busy,
# and two or three at once cost far more CPU than the same worlds one after the other (test_hybrid,
# test_expert_tensor_parallel and test_zero: 58.9 busy CPU s one file after the other, 96.9 on three workers at
# once; benchmarks/README.md): gloo's ranks wake each other through sockets, and with more ranks than cores every
# hop waits for a core.
RANKS = {"test_zero.py", "test_hybrid.py", "test_expert_tensor_parallel.py", "test_expert_parallel.py", "test_fsdp.py",
         "test_data_parallel.py", "test_pipeline_parallel.py", "test_checkpoint.py", "test_ring_attention.py",
         "test_tensor_parallel.py", "test_sequence_parallel.py", "test_vocab_parallel_cross_entropy.py",
         "test_grad_accumulation.py", "test_meta_init.py", "test_mixed_precision.py", "test_memory_construction.py",
         "test_tp_comm.py", "test_dp_loss.py", "test_comm.py", "test_p2p_plan.py", "test_pipeline_program.py",
         "test_replay_model.py", "test_grade_redteam_checks.py", "test_grading_data_parallel.py",
         "test_grading_zero.py", "test_grading_tensor_parallel.py", "test_grading_context_parallel.py",
         "test_grading_pipeline.py", "test_grading_hybrid.py", "test_grade_fsdp.py", "test_grade_ulysses.py",
         "test_course.py"}
# Files (and the ranks' group) are handed out in collection order (`--no-loadscope-reorder`: xdist would otherwise
# sort them by their number of tests), so the longest go first: started last, one of them would leave the other
# workers idle at the end. Seconds per file measured with --durations=0 (benchmarks/README.md).
LONGEST_FIRST = ["ranks", "browser", "test_faults.py", "test_labs.py", "test_slurm.py", "test_grade_redteam.py",
                 "test_nbgrader.py", "test_notebooks.py", "test_launch.py"]
# The lessons' run and figure check in English and in Chinese: one unit of work, so that one worker's Chromium
# page (plotly.js loaded) and warm kernel server serve both languages (`chromium`, `lesson_kernels` below)
BROWSER = {"test_viz_browser.py", "test_i18n_browser.py"}
assert not {n for n in RANKS | BROWSER if not (Path(__file__).parent / n).exists()}, \
    "a file of RANKS or BROWSER was renamed or removed"


def _scope(path: str | Path) -> str:
    """The unit of work of a test file: "ranks" for the files of `RANKS`, "browser" for those of `BROWSER`, else
    the file's name."""
    name = Path(path).name
    return "ranks" if name in RANKS else "browser" if name in BROWSER else name


@pytest.fixture(scope="session")
def chromium():
    """One Chromium page with plotly.js loaded (`parlab.course.figcheck.Browser`) for the files of `BROWSER`:
    starting it and loading plotly.js cost ~3 CPU s, once per worker instead of once per file."""
    from parlab.course import figcheck
    with figcheck.Browser() as b:
        yield b


@pytest.fixture(scope="session")
def lesson_kernels():
    """The address of a warm kernel server (`parlab.course.kernel_server`) the lessons of both languages fork
    their kernels from (each language's kernels get their own PARLAB_LANG): one server's imports, ~2.4 CPU s."""
    from parlab.course.kernel_server import KernelServer
    with KernelServer() as server:
        assert server.ready
        yield server.address


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class RanksTogether(LoadFileScheduling):
        """--dist loadfile, with the files of `RANKS` one unit of work, and those of `BROWSER` another."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _scope(path) if _scope(path) in ("ranks", "browser") else super()._split_scope(nodeid)

    return RanksTogether(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_scope(item.path), len(rank)))      # stable: the rest keep their order
