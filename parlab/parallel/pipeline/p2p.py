"""The pipeline executor's messages: activations forward, gradients backward, posted in one agreed order.

`PipelineParallel` (parlab.parallel.pipeline.executor) runs a schedule's actions; this module moves what flows between
its stages. A stage hands its output to the next stage (`put("act", s + 1, i, out)`) and its input gradient to
the previous one (`put("grad", s - 1, i, g)`); a stage takes what it needs with `get`. Two stages on the same
rank (interleaving) exchange through a local dictionary; stages on different ranks through `comm.isend` /
`comm.irecv`, posted in the merged order of `parlab.parallel.pipeline.plan.merged_plan` (every rank posts its sends and
receives with all peers in one order both sides agree on, so NCCL's serialised p2p queue cannot wait in a
cycle). Receives are posted early into fresh buffers; a send is posted when its tensor exists; completed
sends are waited (reaped) after every action and the rest at the end of the step (gloo requires every isend
to be waited).

References: D. Narayanan et al., SC 2021, arXiv:2104.04473, section 4.1 (the scatter/gather of pipeline
messages and their point-to-point implementation); NCCL documentation, "Point-to-point communication"
(group semantics of send/recv).
"""
from __future__ import annotations

import torch

from parlab import comm
from parlab.parallel.pipeline.plan import Post, merged_plan
from parlab.parallel.pipeline.schedules import Schedule


class StageMessages:
    """One rank's pipeline messages for a schedule: `begin` a step, `put` / `get` tensors, `end` the step."""

    def __init__(self, schedule: Schedule, rank: int, peers: list[int], group):
        self.schedule, self.rank, self.peers, self.group = schedule, rank, peers, group
        self.plan = merged_plan(schedule, rank)     # this rank's messages with every peer, in the merged order
        self.begin((0, 0, 0), torch.float32, torch.device("cpu"))

    def begin(self, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> None:
        """Start a step whose messages are all `shape`: (b, S/sp, H), of `dtype` on `device`."""
        self.shape, self.dtype, self.device = shape, dtype, device
        self.posted = 0                             # operations of self.plan posted so far
        self.recvs: dict[tuple, tuple] = {}         # message key -> (buffer, work) of a posted irecv
        self.sends: list = []                       # isend works not waited yet
        self.local: dict[tuple, torch.Tensor] = {}  # messages between two stages of this rank

    @staticmethod
    def source(kind: str, dst: int) -> int:
        """The stage a message for stage `dst` comes from: activations flow forward, gradients backward."""
        return dst - 1 if kind == "act" else dst + 1

    def put(self, kind: str, dst: int, i: int, t: torch.Tensor) -> None:
        """Hand stage `dst` its input (act) or output gradient (grad) for micro-batch i."""
        to = self.schedule.placement[dst]
        if to == self.rank:
            self.local[(kind, dst, i)] = t
        else:
            self._post_until(Post("send", to, (kind, dst, i)), t.contiguous())

    def get(self, kind: str, dst: int, i: int) -> torch.Tensor:
        """Stage `dst`'s input (act) or output gradient (grad) for micro-batch i: (b, S/sp, H)."""
        key = (kind, dst, i)
        if key in self.local:
            return self.local.pop(key)
        if key not in self.recvs:
            self._post_until(Post("recv", self.schedule.placement[self.source(kind, dst)], key))
        buf, work = self.recvs.pop(key)
        work.wait()
        return buf                                  # (b, S/sp, H)

    def reap(self) -> None:
        """Wait on (and so release the buffers of) the sends that have already completed."""
        pending = []
        for w in self.sends:
            if w.is_completed():
                w.wait()
            else:
                pending.append(w)
        self.sends = pending

    def end(self) -> None:
        """Wait on every send left (the gloo rule); every planned message must have been exchanged."""
        for w in self.sends:
            w.wait()
        self.sends = []
        left = self.plan[self.posted:]
        assert not left and not self.recvs, f"messages not exchanged this step: {left}"   # an executor bug

    def _post_until(self, target: Post, tensor: torch.Tensor | None = None) -> None:
        """Post this rank's messages in the merged order, up to and including `target`: receives as irecv into
        fresh buffers, and `target` itself (a send of `tensor`, or a receive)."""
        while self.posted < len(self.plan):
            post = self.plan[self.posted]
            kind, dst, i = post.key
            label = f"stage {self.source(kind, dst)} -> {dst} {kind} mb {i}"
            if post.op == "recv":
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)   # (b, S/sp, H)
                self.recvs[post.key] = (buf, comm.irecv(buf, self.peers[post.peer], group=self.group, label=label))
            elif post == target:
                self.sends.append(comm.isend(tensor, self.peers[post.peer], group=self.group, label=label))
            else:   # cannot happen for a schedule simulate() accepts: our own sends come in production order
                raise RuntimeError(f"pipeline rank {self.rank} would post {target} before its own {post}; "
                                   f"the message order does not fit this schedule")
            self.posted += 1
            if post == target:
                return
        raise RuntimeError(f"pipeline rank {self.rank}: {target} is not among its messages")
