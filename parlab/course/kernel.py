"""Running course notebooks: each in a fresh Jupyter kernel (`execute`, through `client`), and executed lessons
turned into offline HTML handouts (`export_html`, ``parlab course html``).

`client` is nbclient's NotebookClient with the two repairs the course needs: waits on the kernel in short slices
(nbclient's lost-reply stall on widget cells, jupyter/nbclient#312) and a kernel that dies while starting started
again (a port raced away, jupyter/jupyter_client#154). The grader's worker (`parlab.course.gradebook.worker`) runs
submissions through the same client.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.provisioning import LocalProvisioner
from traitlets import Unicode

from parlab.course.kernel_server import spawn
from parlab.course.notebooks import read

__all__ = ["execute", "client", "export_html", "KERNEL_STARTS", "WarmProvisioner", "kernel_specs",
           "warm_kernel_manager", "write_kernel_spec"]


def execute(nb: nbformat.NotebookNode, cwd: str | Path, timeout: float = 300.0,
            poll: float = 0.5, lang: str | None = None, server: str = "") -> nbformat.NotebookNode:
    """Run every cell of `nb` in a fresh kernel started in `cwd`, in place (outputs kept); returns `nb`.

    A cell that takes more than `timeout` seconds raises nbclient's CellTimeoutError. Works around
    nbclient's lost-reply stall (jupyter/nbclient#312): on cells that open widgets, the kernel's reply can
    sit unnoticed on the client's socket until the wait times out (measured here: lesson 07 under plain
    nbclient stalled a cell for the full 90 s timeout in 2 of 3 runs, and forever without a timeout).
    Waiting in slices of `poll` seconds makes every wake-up also look at the socket, so a stall lasts at
    most `poll` seconds. `lang`: the language parlab speaks in that kernel (``PARLAB_LANG``; default: ours).
    `server`: the address of a `parlab.course.kernel_server.KernelServer` that forks the kernel (default: none,
    the kernel is a new process)."""
    import os

    # the kernel's own stderr only carries jupyter_client's shutdown noise ("KeyboardInterrupt caught in
    # kernel", sent on purpose before shutdown); errors in cells come back in the notebook and raise here
    env = {**os.environ, **({"PARLAB_LANG": lang} if lang else {})}
    client(nb, poll, server=server, timeout=timeout, kernel_name="python3",
           resources={"metadata": {"path": str(cwd)}}).execute(stderr=subprocess.DEVNULL, env=env)
    return nb


KERNEL_STARTS = 3


def client(nb: nbformat.NotebookNode, poll: float = 0.5, server: str = "", **kwargs):
    """nbclient's NotebookClient for `nb` (`kwargs` are its options), with two repairs the course needs, and
    its kernel forked by the kernel server at `server` when one is given (`parlab.course.kernel_server`: 0.1 s
    of CPU to start instead of 2 to 3.5 s):

    - waits on the kernel in slices of `poll` seconds (`_sliced`; jupyter/nbclient#312);
    - a kernel that dies while starting is started again, up to `KERNEL_STARTS` times. The client picks the
      kernel's ports (binds port 0, then lets go) and the kernel binds them a moment later; on a busy machine
      another process (a rank's gloo socket, another kernel) can take one in between, and the kernel exits
      with "Address already in use" before it answers kernel_info (jupyter/jupyter_client#154). Nothing of the
      notebook has run then, so starting again on fresh ports changes nothing it computes; for the grader it
      means a student is not scored "crashed" for the machine's race (tests/test_course.py provokes it)."""
    from jupyter_core.utils import run_sync
    from nbclient import NotebookClient

    class _Client(NotebookClient):
        def create_kernel_manager(self):
            return warm_kernel_manager(self, server) if server else super().create_kernel_manager()

        async def async_start_new_kernel(self, **kw):
            self._start_kwargs = kw                        # kept for a second start
            await super().async_start_new_kernel(**kw)

        async def async_start_new_kernel_client(self):
            for attempt in range(1, KERNEL_STARTS + 1):
                try:
                    kc = await super().async_start_new_kernel_client()
                    break
                except RuntimeError:                       # "Kernel died before replying to kernel_info"
                    if attempt == KERNEL_STARTS:
                        raise
                    # nbclient has shut the dead kernel down and dropped its manager: a new one, new ports
                    self.km = self.create_kernel_manager()
                    await self.async_start_new_kernel(**self._start_kwargs)
            for channel in (kc.shell_channel, kc.iopub_channel):
                channel.get_msg = _sliced(channel.get_msg, poll)
            return kc

        # nbclient's blocking forms wrap the base class's coroutines: wrap ours (the grader calls these)
        start_new_kernel = run_sync(async_start_new_kernel)
        start_new_kernel_client = run_sync(async_start_new_kernel_client)

    return _Client(nb, **kwargs)


class WarmProvisioner(LocalProvisioner):
    """jupyter_client's LocalProvisioner, whose kernel is forked by the parlab kernel server at `server`
    (`parlab.course.kernel_server.KernelServer.address`) when that server serves the request, and started by
    Popen otherwise. Registered as ``parlab-warm`` (pyproject.toml's entry points), named by `kernel_specs`."""
    server = Unicode("", config=True, help="address of a parlab kernel server (KernelServer.address)")

    async def launch_kernel(self, cmd, **kwargs):
        kernel = spawn(self.server, cmd, env=kwargs.get("env"), cwd=kwargs.get("cwd"), stdin=kwargs.get("stdin"),
                       stdout=kwargs.get("stdout"), stderr=kwargs.get("stderr"))
        if kernel is None:
            return await super().launch_kernel(cmd, **kwargs)
        self.process, self.pid, self.pgid = kernel, kernel.pid, kernel.pid    # its own session: pgid == pid
        self.cwd = kwargs.get("cwd", Path.cwd())
        return self.connection_info


def warm_kernel_manager(nb_client, server: str):
    """The KernelManager an nbclient client (`nb_client`, also nbgrader's Execute) would create, its kernel forked
    by the kernel server at `server`; set as the client's ``km``."""
    nb_client.km = nb_client.kernel_manager_class(kernel_name=nb_client.kernel_name or "python3",
                                                  config=nb_client.config, kernel_spec_manager=kernel_specs(server))
    return nb_client.km


def kernel_specs(server: str) -> KernelSpecManager:
    """A KernelSpecManager whose every kernel name gives this environment's python kernel (ipykernel's own spec,
    as nbval's --nbval-current-env does), forked by the kernel server at `server` (if not empty)."""
    import ipykernel.kernelspec

    class WarmKernelSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            spec = ipykernel.kernelspec.get_kernel_dict()
            if server:
                spec["metadata"] = {**spec.get("metadata", {}), "kernel_provisioner": {
                    "provisioner_name": "parlab-warm", "config": {"server": server}}}
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES, **spec)

    return WarmKernelSpecs()


def write_kernel_spec(folder: str | Path, server: str, name: str = "python3") -> Path:
    """Write the kernel spec `name` of `kernel_specs(server)` (with ipykernel's logos) into the Jupyter data folder
    `folder` (``folder/kernels/<name>/``), for a Jupyter server or nbval given ``JUPYTER_PATH=folder``; returns
    `folder`. Named ``python3``, it is the kernel every course notebook asks for."""
    import json
    import shutil

    import ipykernel.kernelspec
    spec = Path(folder) / "kernels" / name
    shutil.copytree(ipykernel.kernelspec.RESOURCES, spec, dirs_exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps(kernel_specs(server).get_kernel_spec(name).to_dict()))
    return Path(folder)


def _sliced(get_msg, poll: float):
    """`get_msg(timeout)` that waits in slices of `poll` seconds, each ending with a fresh look at the socket."""
    from queue import Empty
    from time import monotonic

    async def get(timeout=None):
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            left = poll if deadline is None else min(poll, max(0.0, deadline - monotonic()))
            try:
                return await get_msg(timeout=left)
            except Empty:
                if deadline is not None and monotonic() >= deadline:
                    raise
    return get


def export_html(paths, out: str | Path, timeout: float = 300.0, lang: str | None = None, executed=False) -> list[Path]:
    """Execute each notebook in its own folder (unless `executed`: they carry outputs; several are run in kernels
    forked by one `KernelServer`) and write NAME.html into `out`; returns the pages written.
    The pages read fully offline (`parlab.course.handout`): plotly figures carry their own plotly.js, formulas are
    typeset by the MathJax copied into ``out/mathjax/``, and each widget shows its controls' initial values and
    the figure it drew for them."""
    from nbconvert import HTMLExporter

    from parlab.course.handout import drop_remote_scripts, offline_mathjax, static_widgets

    import contextlib

    from parlab.course.kernel_server import KernelServer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mathjax = offline_mathjax(out)
    pages = []
    paths = list(map(Path, paths))
    # several notebooks to run: their kernels forked from one warm server (3 s less CPU each)
    with KernelServer() if not executed and len(paths) > 1 else contextlib.nullcontext() as server:
        for path in paths:
            nb = read(path) if executed else execute(read(path), path.resolve().parent, timeout=timeout, lang=lang,
                                                     server=server.address if server else "")
            static_widgets(nb)
            html, _ = HTMLExporter(mathjax_url=mathjax).from_notebook_node(nb)
            page = out / (path.stem + ".html")
            page.write_text(drop_remote_scripts(html), encoding="utf-8")
            pages.append(page)
    return pages
