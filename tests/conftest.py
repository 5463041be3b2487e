"""Suite-wide setup: every test runs in `parlab.comm.strict()` mode.

Strict mode checks every tensor handed to communication (on the rank's device, contiguous, an NCCL dtype,
AVG only on floating types), so tests on CPU/gloo fail where NCCL on GPUs would. The fixture enters it in the
pytest process; ranks started by `parlab.run` fork from it and inherit it (the spawn start method, used by one
launch test only, starts fresh interpreters without it)."""
import pytest
import torch

import nbval_kernel_retry  # noqa: F401  (a kernel that dies while starting is started again, for the suite's
                           # own nbval run of tests/notebooks/launcher.ipynb too: it failed one CI run so)
from parlab import comm

# tests/gpu/ needs CUDA (NCCL collectives, CUDA events, meta construction on a GPU): it is collected only where
# there is a device (`python -m parlab.labs.gpu_check` runs it on a GPU node), so a CPU run reports no skips;
# tests/test_labs.py::test_gpu_tests_import_on_cpu checks on every machine that the file still imports.
# tests/notebooks/old_layout/ holds students' notebooks saved from the flat layout: tests/test_grade_redteam.py
# grades them through `parlab grade` (which runs them); nbval need not run them a second time.
collect_ignore_glob = ["notebooks/old_layout/*"] + ([] if torch.cuda.is_available() else ["gpu/*"])


@pytest.fixture(autouse=True)
def _strict_comm():
    with comm.strict():
        yield


# The README's command runs the suite on three pytest-xdist workers, a file at a time (`-n 3 --dist loadfile`, so a
# module's fixtures run once; three, not two, on 2 cores because many tests mostly wait: on subprocesses,
# timeouts, browsers). Files are handed out in collection order (`--no-loadscope-reorder`: xdist would otherwise
# sort them by their number of tests), so the longest go first: started last, one of them would leave the other
# workers idle at the end. Seconds per file measured with --durations=0 (benchmarks/README.md).
LONGEST_FIRST = ["test_viz_browser.py", "test_i18n_browser.py", "test_faults.py", "test_labs.py", "test_slurm.py", "test_grade_redteam.py",
                 "test_nbgrader.py",
                 "test_notebooks.py", "test_zero.py", "test_launch.py", "test_hybrid.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))      # stable: the rest keep their order
