"""Suite-wide setup: every test runs in `parlab.comm.strict()` mode.

Strict mode checks every tensor handed to communication (on the rank's device, contiguous, an NCCL dtype,
AVG only on floating types), so tests on CPU/gloo fail where NCCL on GPUs would. The fixture enters it in the
pytest process; ranks started by `parlab.run` fork from it and inherit it (the spawn start method, used by one
launch test only, starts fresh interpreters without it)."""
import pytest

from parlab import comm


@pytest.fixture(autouse=True)
def _strict_comm():
    with comm.strict():
        yield
