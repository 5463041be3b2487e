"""A warm start for course kernels: a server process that has imported what course notebooks import (torch,
parlab, plotly) once, and forks a fresh Jupyter kernel from itself for each notebook.

Why: a kernel that runs a course notebook spends about 2 s of CPU before its first cell does anything, importing
ipykernel and torch, and 1.5 s more when its first `parlab.run` imports torch._dynamo for the ranks' optimizers.
`parlab grade` starts one kernel per submission (a class of 20 students and ten exercises: 200 kernels), the
figure check one per lesson. A fork of a process that has all this imported costs about 0.1 s. It is the
fork-server pattern of Python's own multiprocessing ('forkserver' start method with
`set_forkserver_preload`, docs.python.org/3/library/multiprocessing.html) applied to Jupyter kernels.

- `KernelServer`: the client's handle. Starts ``python -m parlab.course.kernel_server ADDRESS`` and stops it on
  `close` (or when the client dies: the server watches a pipe from it).
- `spawn`: a kernel from the server at an address, as a `ForkedKernel` (what jupyter_client needs of a Popen).
  `parlab.course.kernel.WarmProvisioner` calls it: the kernel provisioner (jupyter_client's documented way for a
  kernel spec to choose how its process starts) that the course's notebook clients use.
- `serve`: the server (`_Server`: its loop), one fork per request. It imports nothing of Jupyter's itself.

A forked kernel gets what a kernel started by ``Popen`` would: the request's argv, environment, working
directory and standard streams, the requesting process's resource limits (as a child inherits them), a session
of its own (as jupyter_client's launcher gives it, so that an interrupt or a kill reaches the ranks it forks),
and fresh seeds for `random` and numpy's global generator (torch's starts from the same fixed seed either way).
A request the server cannot honour is declined and started by ``Popen``: another interpreter, or other values of
the variables an interpreter or torch's thread pools read once at start (``PYTHON*``, ``OMP_*``, ``MKL_*``...).
When the client that asked for a kernel goes away (closes the connection, or is killed on a grading timeout),
the server kills the kernel's process group at once.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["KernelServer", "ForkedKernel", "spawn", "serve", "PRELOAD"]

# what the lessons, the exercises and the grader's set-up cell import, and orjson, which plotly imports to write its
# first figure (a name missing here is simply skipped)
# ipykernel is not among them: its traits read the kernel's environment when they are defined (JPY_PARENT_PID),
# and after torch it costs a kernel 0.08 s to import for itself
PRELOAD = ("torch", "torch._dynamo", "numpy", "parlab", "parlab.course.grading", "plotly.graph_objects", "plotly.io",
           "orjson")
# read once when an interpreter (or torch's thread pools, or the C allocator) starts: a request whose values
# differ from the server's cannot be served by a fork
FIXED_AT_START = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TORCH_", "LD_", "MALLOC_")
_RLIMITS = sorted({getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")})
_LAUNCHER = ["-m", "ipykernel_launcher"]


def _fixed(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(FIXED_AT_START)}


class KernelServer:
    """A running kernel server (see the module's docstring); a context manager. `address` is what a
    `WarmProvisioner` (or `spawn`) in this process or any of its children needs to reach it."""

    def __init__(self, preload=PRELOAD, env: dict | None = None):
        """`env`: the server's environment (default: ours); requests whose ``PYTHON*`` and thread variables
        differ from it are declined."""
        self._dir = tempfile.mkdtemp(prefix="parlab-kernels-")
        self.address = str(Path(self._dir) / "server.sock")
        # a session of its own: a Ctrl-C in the terminal reaches the client, whose exit closes the server's stdin
        self._proc = subprocess.Popen([sys.executable, "-m", "parlab.course.kernel_server", self.address, *preload],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      start_new_session=True, cwd=self._dir, env=env)
        self.ready = self._proc.stdout.readline().strip() == b"ready"     # '' if it died while importing
        if not self.ready:
            self.address = ""                                               # kernels start by Popen then

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()                                     # the server kills its kernels and exits
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc.stdout.close()
        for p in Path(self._dir).glob("*"):
            p.unlink(missing_ok=True)
        os.rmdir(self._dir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------------------------- the client

class ForkedKernel:
    """What `subprocess.Popen` offers jupyter_client, for a kernel the server forked: its pid, `poll`, `wait`,
    `send_signal`, `kill`, `terminate` and `returncode`. The exit status comes over the connection."""
    stdin = stdout = stderr = None

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self._conn, self.returncode, self._buffer = pid, conn, None, b""

    def _read(self, timeout: float | None) -> None:
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(4096)
        except (BlockingIOError, socket.timeout):
            return
        except OSError:
            data = b""
        if not data:                                          # the server went away: it killed its kernels first
            self._finish(-signal.SIGKILL)
            return
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            self._finish(json.loads(line)["exit"])

    def _finish(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(["kernel", str(self.pid)], timeout)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def spawn(address: str, cmd: list[str], env: dict | None = None, cwd: str | None = None,
          stdin=None, stdout=None, stderr=None) -> ForkedKernel | None:
    """Ask the server at `address` for a kernel running `cmd` (``python -m ipykernel_launcher ...``), with
    Popen's meaning of `env`, `cwd` and the three streams (None: /dev/null for stdin, ours for the others);
    None when it declines or cannot be reached (the caller starts the kernel with Popen then)."""
    if not address or any(v in (subprocess.PIPE, subprocess.STDOUT) for v in (stdin, stdout, stderr)):
        return None
    opened = []

    def fd(value, default):
        if value is None and default is not None:
            return default
        if value is None or value == subprocess.DEVNULL:
            opened.append(os.open(os.devnull, os.O_RDWR))
            return opened[-1]
        return value if isinstance(value, int) else value.fileno()

    request = json.dumps({"argv": list(cmd), "env": dict(os.environ if env is None else env),
                          "cwd": os.path.abspath(cwd or os.getcwd()),   # relative to ours, as Popen reads it
                          "rlimits": {r: resource.getrlimit(r) for r in _RLIMITS}}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        socket.send_fds(conn, [struct.pack("!I", len(request))], [fd(stdin, None), fd(stdout, 1), fd(stderr, 2)])
        conn.sendall(request)
        reply = b""
        while not reply.endswith(b"\n"):
            data = conn.recv(4096)
            if not data:
                raise ConnectionError("the kernel server closed the connection")
            reply += data
        pid = json.loads(reply).get("pid")
    except OSError:
        pid = None
    finally:
        for f in opened:
            os.close(f)
    if pid is None:                                           # declined (the reply says why) or unreachable
        conn.close()
        return None
    return ForkedKernel(pid, conn)


# ---------------------------------------------------------------------------------------------------- the server

def _decline(request: dict) -> str | None:
    """Why a fork cannot honour `request` (None: it can)."""
    argv = request["argv"]
    # the very path: another virtual environment's python resolves to the same binary but has other packages
    if len(argv) < 3 or argv[0] != sys.executable or argv[1:3] != _LAUNCHER:
        return "not this environment's ipykernel_launcher"
    if _fixed(request["env"]) != _fixed(os.environ):
        return "other interpreter or thread settings"
    inf = resource.RLIM_INFINITY
    for r, (_, hard) in request["rlimits"].items():
        mine = resource.getrlimit(int(r))[1]
        if mine != inf and (hard == inf or hard > mine):       # only root may raise a hard limit
            return "a resource limit above the server's"
    return None


def _become_kernel(request: dict, fds: list[int], start_dir: str) -> None:
    """In the forked child: take on the request's process state, then run ipykernel_launcher's main."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)          # as in a new interpreter
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        for r, (soft, hard) in request["rlimits"].items():
            resource.setrlimit(int(r), (soft, hard))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["JPY_PARENT_PID"] = str(os.getppid())          # the kernel leaves if the server dies
        import random
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        # ipykernel_launcher's own first step: the start folder leaves sys.path (IPython puts '' back)
        if sys.path and sys.path[0] in ("", start_dir):
            del sys.path[0]
        import importlib.util
        sys.argv = [importlib.util.find_spec("ipykernel_launcher").origin, *request["argv"][3:]]
        from ipykernel import kernelapp
        kernelapp.launch_new_instance()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _receive(conn: socket.socket):
    header, fds, _, _ = socket.recv_fds(conn, 4, 3)
    while len(header) < 4:
        more = conn.recv(4 - len(header))
        if not more:
            raise ConnectionError("short request")
        header += more
    size, body = struct.unpack("!I", header)[0], b""
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ConnectionError("short request")
        body += more
    return json.loads(body), fds


def serve(address: str, preload=PRELOAD) -> None:
    """The server: import `preload`, then fork a kernel for each request on the Unix socket `address` until
    stdin closes (the client's lifeline), killing every kernel still running then."""
    import gc
    import importlib

    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.freeze()                              # a kernel's collections never touch (and so copy) the preloaded pages
    _Server(address).run()


class _Server:
    """The server's state: the listening socket, one connection per running kernel (pid -> the client's
    connection), and a pipe that SIGCHLD wakes. `run` dispatches what `select` reports."""

    def __init__(self, address: str):
        import selectors
        self.start_dir = sys.path[0] if sys.path else ""
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(address)
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "lifeline")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "children")
        self.kernels: dict[int, socket.socket] = {}

    def run(self) -> None:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        while True:
            for key, _ in self.sel.select():
                if key.data == "accept":
                    self.accept()
                elif key.data == "lifeline":
                    if not os.read(sys.stdin.fileno(), 4096):            # the client closed it, or died
                        for pid in list(self.kernels):
                            _kill_group(pid)
                            self.forget(pid, None)
                        return
                elif key.data == "children":
                    os.read(self.wake_r, 4096)
                    self.reap()
                elif not key.fileobj.recv(1):            # a client's connection: it went away, so does its kernel
                    _kill_group(key.data)
                    self.forget(key.data, None)

    def accept(self) -> None:
        """One request: fork its kernel (or decline), answer with the pid, keep the connection for its exit."""
        import selectors
        conn, _ = self.listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            return
        why = _decline(request) if len(fds) == 3 else "three streams expected"
        pid = None if why else os.fork()
        if pid == 0:                             # the kernel: none of the server's sockets stay open in it
            self.sel.close()
            for s in (self.listener, conn, *self.kernels.values()):
                s.close()
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            _become_kernel(request, fds, self.start_dir)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"pid": pid} if pid else {"declined": why}).encode() + b"\n")
        except OSError:
            pass
        if pid:
            self.kernels[pid] = conn
            self.sel.register(conn, selectors.EVENT_READ, pid)
        else:
            conn.close()

    def reap(self) -> None:
        """Wait for every kernel that has exited and report its status to its client."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.forget(pid, os.waitstatus_to_exitcode(status))

    def forget(self, pid: int, report: int | None) -> None:
        """Close kernel `pid`'s connection, first sending its exit status `report` (if any)."""
        conn = self.kernels.pop(pid, None)
        if conn is None:
            return
        self.sel.unregister(conn)
        if report is not None:
            try:
                conn.sendall(json.dumps({"exit": report}).encode() + b"\n")
            except OSError:
                pass
        conn.close()


def _kill_group(pid: int) -> None:
    """SIGKILL to the kernel's process group (its ranks), and to the kernel itself: just after the fork it may not
    have called setsid yet, and then its group does not exist (nor has it any children)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


if __name__ == "__main__":
    serve(sys.argv[1], tuple(sys.argv[2:]) or PRELOAD)
