"""A pytest plugin for the suite's own nbval runs (tests/test_notebooks.py): a kernel that dies while starting is
started again.

A Jupyter kernel's ports are picked by the client (bound to port 0, then let go) and bound by the kernel a moment
later; while the suite runs, other tests open sockets all the time (gloo ranks, other kernels), one can take a port
in between, and the kernel exits with "Address already in use" before it answers kernel_info
(jupyter/jupyter_client#154; it failed one CI run). nbval starts each notebook's kernel once, so this plugin
retries that start, as `parlab.course.kernel.client` does for parlab's own runs; nothing else of nbval changes:
no cell has run when a start fails.
"""
import nbval.kernel

STARTS = 3
_start_new_kernel = nbval.kernel.start_new_kernel


def start_new_kernel(*args, **kwargs):
    for attempt in range(1, STARTS + 1):
        try:
            return _start_new_kernel(*args, **kwargs)
        except RuntimeError:                    # nbval has shut the dead kernel down: start another on new ports
            if attempt == STARTS:
                raise


nbval.kernel.start_new_kernel = start_new_kernel
