"""nbgrader's autograde with what ``parlab grade`` guards: `GuardedExecute`, installed by the course's
``exercises/nbgrader_config.py`` in place of nbgrader's own Execute preprocessor.

nbgrader runs a submission's cells and gives a graded cell its points when the cell raised nothing. So an answer
cell that rebinds the grading code (``grading.check_ring_all_reduce = print``) made every graded cell after it
pass: 12 of 12 under plain nbgrader, 0 and "tampered" under ``parlab grade``. `GuardedExecute` does what
``parlab grade``'s worker does (`parlab.course.gradebook.worker`):

* after each graded cell, a probe cell (not kept in the notebook) asks `parlab.course.grading.guard` whether
  the grading code or parlab was rebound; if so the graded cell gets an error output "Tampered: ...", which
  nbgrader scores 0, and the student reads why in the feedback;
* a notebook that tampered scores nothing, as under ``parlab grade``: the graded cells that ran before the
  rebinding get the same error output (a solution that rebinds the checks after its first parts passed earned
  them under nbgrader and 0 under ``parlab grade`` before: tests/test_nbgrader.py);
* the cells after the last graded one (demonstrations) are not run: they score nothing, and a slow one would
  only cost the class's grading time;
* each kernel is forked from one warm kernel server per autograde process (`parlab.course.kernel_server`: torch and
  parlab imported once, 2-3.5 s less CPU per notebook; ``GuardedExecute.warm_kernels = False`` turns it off);
* the kernel speaks the notebook's language: a notebook of the Chinese course (``metadata.parlab.lang``, written
  by `parlab.course.translated`) is run with ``PARLAB_LANG`` set to it, so its checks explain themselves in
  Chinese in the student's feedback whatever the language of the shell that runs nbgrader (without it, a class
  graded from an English shell read English failures in Chinese notebooks).

Everything else is nbgrader's Execute (its timeout, its kernel, its error handling), configured as usual.
"""
from __future__ import annotations

import atexit
import os

from nbclient.util import run_sync
from nbformat.v4 import new_code_cell, new_output
from nbgrader.preprocessors import Execute
from nbgrader.utils import is_grade
from traitlets import Bool

from parlab.course.gradebook.worker import TAMPER_PROBE, tampered_message, tampered_names

__all__ = ["GuardedExecute"]


class GuardedExecute(Execute):
    """nbgrader's Execute, with the tamper probe after each graded cell and nothing run after the last one."""
    warm_kernels = Bool(True, help="fork each kernel from a warm parlab kernel server").tag(config=True)
    # nbgrader makes a new GuardedExecute for every notebook it autogrades, so the server is the process's: started
    # with the first notebook, closed when autograde exits ({pid: server}: a forked process starts its own)
    _servers: dict = {}

    def create_kernel_manager(self):
        if not self.warm_kernels:
            return super().create_kernel_manager()
        from parlab.course.kernel import warm_kernel_manager
        from parlab.course.kernel_server import KernelServer
        server = self._servers.get(os.getpid())
        if server is None:
            server = self._servers[os.getpid()] = KernelServer()
            atexit.register(server.close)
        return warm_kernel_manager(self, server.address)

    def preprocess(self, nb, resources=None, km=None):
        graded = [i for i, cell in enumerate(nb.cells) if is_grade(cell)]
        self._last_graded = graded[-1] if graded else len(nb.cells) - 1
        self._rebound: list[str] = []
        nb, resources = super().preprocess(nb, resources, km)
        if self._rebound:                              # parlab grade's rule: a notebook that tampers scores 0
            message = tampered_message(", ".join(dict.fromkeys(self._rebound)))
            for i in graded:
                if not any(out.get("ename") == "Tampered" for out in nb.cells[i].get("outputs", [])):
                    nb.cells[i].outputs.append(new_output("error", ename="Tampered", evalue=message,
                                                          traceback=[message]))
        return nb, resources

    async def async_start_new_kernel(self, **kwargs):
        lang = self.nb.metadata.get("parlab", {}).get("lang")
        if lang:                                       # the Chinese course's notebooks: feedback in Chinese
            kwargs["env"] = {**(kwargs.get("env") or os.environ), "PARLAB_LANG": lang}
        await super().async_start_new_kernel(**kwargs)

    start_new_kernel = run_sync(async_start_new_kernel)     # nbclient's sync face, bound to this coroutine

    def preprocess_cell(self, cell, resources, index):
        if index > self._last_graded:                  # a demonstration after the last check: not run
            return cell, resources
        cell, resources = super().preprocess_cell(cell, resources, index)
        if is_grade(cell):
            bad = self._tampered(cell, index)
            if bad:
                self._rebound += bad
                message = tampered_message(", ".join(bad))
                cell.outputs.append(new_output("error", ename="Tampered", evalue=message, traceback=[message]))
        return cell, resources

    def _tampered(self, cell, index: int) -> list[str]:
        """The names the guard finds rebound, from a probe run in the same kernel (its output is read, not kept)."""
        probe = new_code_cell(TAMPER_PROBE)
        self.execute_cell(probe, index, store_history=False)
        self.nb["cells"][index] = cell                 # nbclient writes the executed cell back at its index
        return tampered_names("".join(out.get("text", "") for out in probe.get("outputs", [])))
