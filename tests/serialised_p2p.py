"""A gloo shim with NCCL's point-to-point rules, so CPU tests catch orders that would hang on GPUs.

gloo buffers a send and lets a rank's sends and receives to different peers proceed independently; NCCL
with eager communicators (``device_id=`` at init) does neither for large messages: a send completes only
when the peer has posted the matching receive, and all of a rank's p2p operations run one at a time, in post
order, on the group's one stream (see parlab/parallel/pipeline/plan.py). Inside ``with serialised_p2p():`` on a rank,
``torch.distributed.send / recv / isend / irecv`` (so every ``parlab.comm`` p2p call) go through one worker
thread per rank that runs them strictly in post order, and each send first waits for a token the receiver
sends only once its matching receive is at the head of *its* queue. An order that could deadlock on NCCL
therefore deadlocks here too (the run then ends in `parlab.RankTimeout`), whatever the message size. The token
carries the element count, so a send facing a receive of another size fails loudly instead of mixing data.
"""
from __future__ import annotations

import contextlib
import queue
import threading

import torch
import torch.distributed as dist

_TOKEN_TAG = 1 << 20        # tags the shim's own rendezvous tokens apart from the callers' data (tag 0 + n)


class _Work:
    """What isend/irecv return under the shim: wait() blocks until the worker ran the operation."""

    def __init__(self):
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self, timeout=None):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


class _SerialQueue:
    def __init__(self, send, recv):
        self._send, self._recv = send, recv
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="serialised-p2p", daemon=True)
        self._thread.start()

    def post(self, op: str, tensor: torch.Tensor, peer: int, group, tag: int) -> _Work:
        work = _Work()
        self._q.put((op, tensor, peer, group, tag, work))
        return work

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            op, tensor, peer, group, tag, work = item
            try:
                if op == "send":     # wait until the receiver's queue reached the matching receive
                    token = torch.empty(1, dtype=torch.long)
                    self._recv(token, src=peer, group=group, tag=_TOKEN_TAG + tag)
                    if int(token) != tensor.numel():
                        raise RuntimeError(f"serialised p2p: send of {tensor.numel()} elements to rank {peer} "
                                           f"faces a receive of {int(token)}: the two ranks post different orders")
                    self._send(tensor, dst=peer, group=group, tag=tag)
                else:
                    self._send(torch.tensor([tensor.numel()], dtype=torch.long), dst=peer, group=group,
                               tag=_TOKEN_TAG + tag)
                    self._recv(tensor, src=peer, group=group, tag=tag)
            except BaseException as exc:   # handed to whoever waits on the work
                work._error = exc
            work._done.set()


@contextlib.contextmanager
def serialised_p2p():
    """On this rank, run torch.distributed's p2p calls with NCCL's rules (see module docstring)."""
    orig = {name: getattr(dist, name) for name in ("send", "recv", "isend", "irecv")}
    q = _SerialQueue(orig["send"], orig["recv"])

    def isend(tensor, dst=None, group=None, tag=0, **kw):
        return q.post("send", tensor, dst, group, tag)

    def irecv(tensor, src=None, group=None, tag=0, **kw):
        if src is None:
            raise NotImplementedError("serialised_p2p: receive from any source is not modelled")
        return q.post("recv", tensor, src, group, tag)

    def send(tensor, dst=None, group=None, tag=0, **kw):
        isend(tensor, dst, group, tag).wait()

    def recv(tensor, src=None, group=None, tag=0, **kw):
        irecv(tensor, src, group, tag).wait()
        return src

    patched = {"send": send, "recv": recv, "isend": isend, "irecv": irecv}
    for name, fn in patched.items():
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in orig.items():
            setattr(dist, name, fn)
        q.close()
