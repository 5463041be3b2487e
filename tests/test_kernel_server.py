"""Kernels forked by the warm kernel server (`parlab.course.kernel_server`) are what a kernel started by Popen
is: the client's environment, folder, session of its own and fresh random seeds; a request the server cannot
honour starts by Popen; and a kernel dies with the client that asked for it. (The grader's memory limit, CPU and
wall timeouts and killed kernels, now all through the server, are tried in tests/test_grade_redteam.py.)"""
import json
import os
import signal
import sys
import time

import nbformat
import pytest

from parlab.course.kernel import execute
from parlab.course.kernel_server import KernelServer, spawn

PROBE = ("import json, os, sys, random\n"
         "print(json.dumps({'pid': os.getpid(), 'ppid': os.getppid(), 'pgid': os.getpgid(0), 'cwd': os.getcwd(),\n"
         "                  'lang': os.environ.get('PARLAB_LANG'), 'argv0': sys.argv[0], 'random': random.random(),\n"
         "                  'torch': 'torch' in sys.modules}))")


def _probe(cwd, server: str, lang: str = "zh_CN") -> dict:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(PROBE)])
    execute(nb, cwd, server=server, lang=lang)
    return json.loads(nb.cells[0].outputs[0]["text"])


@pytest.fixture(scope="module")
def server():
    with KernelServer() as ks:
        assert ks.ready
        yield ks


def test_a_forked_kernel_is_the_kernel_popen_would_start(server, tmp_path, monkeypatch):
    first = _probe(tmp_path, server.address)
    monkeypatch.chdir(tmp_path.parent)                         # a folder relative to ours, as Popen reads it
    second = _probe(tmp_path.name, server.address, lang="en")
    for k in (first, second):
        assert k["ppid"] == server._proc.pid                   # forked by the server, not started by us
        assert k["pgid"] == k["pid"]                           # a session of its own, as jupyter_client's launcher
        assert k["cwd"] == str(tmp_path) and k["argv0"].endswith("ipykernel_launcher.py")
        assert k["torch"]                                      # imported already: what the fork saves
    assert (first["lang"], second["lang"]) == ("zh_CN", "en")  # each request's environment, not the server's
    assert first["random"] != second["random"]                 # seeded afresh, as a new interpreter would be


def test_a_request_the_server_cannot_honour_starts_by_popen(server, tmp_path):
    # a server started under another PYTHONPATH cannot give our kernel our sys.path: it declines
    with KernelServer(env=dict(os.environ, PYTHONPATH=str(tmp_path))) as other:
        assert other.ready
        k = _probe(tmp_path, other.address)
        assert k["ppid"] == os.getpid() and k["pgid"] == k["pid"]
    assert spawn("", [sys.executable, "-m", "ipykernel_launcher"]) is None          # no server: Popen
    for other in (["python3", "-m", "ipykernel_launcher"], [sys.executable, "-m", "other_module"]):
        assert spawn(server.address, other) is None            # another environment's python, another program


def test_the_kernel_dies_with_the_client_that_asked_for_it(server, tmp_path):
    kernel = spawn(server.address, [sys.executable, "-m", "ipykernel_launcher", "-f", str(tmp_path / "k.json")],
                   cwd=tmp_path)
    assert kernel is not None and kernel.poll() is None
    kernel._conn.close()                                        # the client goes away (a grading timeout kills it)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:                          # the server kills and reaps it
        try:
            os.kill(kernel.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(kernel.pid, signal.SIGKILL)
        pytest.fail("the kernel outlived its client")
