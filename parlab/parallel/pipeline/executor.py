"""Pipeline parallelism: run any schedule over this rank's stages of the tiny GPT, with point-to-point messages.

`PipelineParallel(model, schedule, group)` keeps on this rank only the stages `schedule.placement` gives it
(`parlab.parallel.pipeline.stages`: a balanced run of blocks per stage, the embedding on stage 0, the head and
the loss on stage S - 1), and `step(x, y)` runs this rank's
list of actions from `parlab.parallel.pipeline` (any valid schedule: GPipe, 1F1B, interleaved, ZB-H1, your own):

    F  s i   input: token ids (s = 0), else the activation of stage s - 1   (recv, or a local hand-off)
             output: sent to stage s + 1; on the last stage the loss of micro-batch i (`module.loss`), / m
    B  s i   gradient of the output (recv from stage s + 1; the loss itself on the last stage) ->
             parameter gradients accumulate in .grad; the input gradient is sent to stage s - 1
    I  s i   the same, but only the input gradient (and the gradients of every layer output), graph kept
    W  s i   the weight gradients from what I kept: Linear dW = dY^T X, db = sum dY; any other module
             with parameters (LayerNorm, Embedding, tensor-parallel layers) by autograd from its own output
             back to its own parameters. Nobody waits for a W.

The loss is the mean over the batch's non-ignored targets (ignore_index -100, padding), exactly as the unsplit
model computes it: micro-batch i's mean loss (`module.loss`) is weighted by n_i / N, its share of the N counted
targets, so micro-batches with more padding count less (not 1/m each). With tied embeddings (GPT-2's
lm_head.weight is wte.weight) the first and last stage each hold a copy; after the last micro-batch they add
their two gradients (one p2p exchange, as Megatron's embedding group does with an all-reduce [3]). With
`dp_group`, gradients are then averaged over data-parallel replicas in one all-reduce, once per step; N is
then the count over all D replicas (one all-reduce of one integer on the last stage, "loss average (token
count)") and the weights are D n_i / N, so the average of the replicas' gradients is the gradient of the global
mean even when the replicas hold different numbers of padded targets.

Gradient accumulation. `step` adds into `.grad` like `backward`: k steps without zeroing give the sum of the k
batches' gradients. The gradients already there are set aside during the step, so that the tied-embedding
exchange and the data-parallel average act only on what this step added (adding the exchanged copy again would
count the earlier steps twice).

Communication. Sends are non-blocking (`comm.isend`, every work waited at the end of the step) and a
rank waits only for the data it needs: exactly the model `parlab.parallel.pipeline.simulation` checks for deadlock.
Messages carry no tag, so two ranks must agree on the order of the messages between them. On NCCL a large
send also completes only once its receive is posted, and with eager communicators (`device_id=` at init)
all of a rank's sends and receives run one at a time, whatever the peer. Agreeing per pair is then not
enough (with interleaving, three ranks' first queued sends can wait on each other in a cycle), so every
rank posts all its messages in one order merged across peers, `plan.merged_plan` (the global order
`simulation.message_sequence`; the schedule is data, known to every rank): a rank about to send first posts
the receives that come before it in that order (`comm.irecv`, non-blocking), and a rank about to need a
message posts up to its receive and waits for it. `plan.serialised_run` checks this against a model
of one serialised queue per rank.

Every action is a traced region ("forward", "backward", "backward_input", "backward_weight", labelled
"stage s mb i") and every message is labelled ("stage 1 -> 2 act mb 3", "stage 2 -> 1 grad mb 3");
`measured_spans(trace)` turns a trace back into per-rank (start, end, Action) spans to lay over
`simulate(schedule).spans`.

References
    [1] Y. Huang et al., "GPipe", NeurIPS 2019, arXiv:1811.06965.
    [2] D. Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021, arXiv:2006.09503.
    [3] D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
        Megatron-LM", SC 2021, arXiv:2104.04473 (interleaved stages; embedding group for tied weights).
    [4] P. Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:2401.10241 (B = I + W).
"""
from __future__ import annotations

import re
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from parlab import comm
from parlab.corpus import micro_batches
from parlab.models import GPT, count_targets, weighted_mean_loss
from parlab.parallel.pipeline.p2p import StageMessages
from parlab.parallel.pipeline.schedules import KINDS, Action, Schedule
from parlab.parallel.pipeline.simulation import unit_cost, validate
from parlab.parallel.pipeline.stages import PipelineStages
from parlab.trace import Trace, region

__all__ = ["PipelineParallel", "set_aside_grads", "add_back_grads", "measured_spans",
           "measured_bubble", "measured_costs"]


@dataclass
class _StepState:
    """What one `PipelineParallel.step` carries from action to action."""
    micro: list                       # m x ((b, S) inputs, (b, S) targets)
    last: bool                        # this rank holds the last stage (computes the loss)
    counts: list | None               # non-ignored targets per micro-batch (last stage)
    weights: list | None              # each micro-batch's loss weight, D n_i / N (last stage)
    earlier: dict                     # gradients of earlier steps, set aside (accumulation)
    loss_sum: torch.Tensor            # () the weighted losses summed
    saved: dict = field(default_factory=dict)   # (stage, mb) -> (input, output, captures): F's, for B or I
    kept: dict = field(default_factory=dict)    # (stage, mb) -> (captures, output grads): I's, for W


class PipelineParallel(PipelineStages):
    """This rank's stages of `model` under `schedule`, on the pipeline group `group` (default: world), and the
    step that runs the schedule's actions on them.

    `module` (from `PipelineStages`) is a copy of the model in which the blocks (and embedding / head) of other ranks' stages are
    None, so parameter names stay those of the full model. `step(x, y)` runs one training step's schedule on
    the whole batch (x, y), each (B, S), split into `schedule.microbatches` micro-batches; it accumulates
    gradients into `.grad` as `backward` does (zero them between optimizer steps; k steps without zeroing give
    the sum of the k batches' gradients) and returns the mean loss on the rank holding the last stage (None
    elsewhere). x and y live on the stages' device (`device`, or the model's).

    Memory of construction. By default `model` is left untouched and `module` is a deep copy: for a moment
    the rank holds two full models. `copy=False` hands the model over instead: its other stages are dropped
    in place (the caller's `model` is then this rank's part) and nothing is copied. `device` then moves only
    the kept part there, so build the dense model on the CPU and pass the GPU as `device`:

        pipe = PipelineParallel(GPT(config, seed=0), schedule, copy=False, device=torch.device("cuda", local))

    and the GPU never holds more than this rank's stages (the host holds the full model for a moment). To skip
    the host's dense copy too, build the model on the meta device (no memory) and let `device` materialise only
    the kept stages there, with the dense model's values (`parlab.parallel.meta_init.materialize`):

        pipe = PipelineParallel(GPT(config, seed=0, device="meta"), schedule, copy=False, device=gpu)

    `loss_group` (default `dp_group`): the ranks whose batches make up the global batch and whose gradients are
    averaged afterwards (by `dp_group` here, or by the caller, e.g. a ZeRO optimizer): the mean loss divides by
    their total number of non-ignored targets. The returned loss is then this replica's share, D * (its sum) / N,
    whose average over the group is the global mean (the local mean when all hold equally many targets).

    `sequence_split` (default 1): with Megatron sequence parallelism the hidden states between stages are
    split along the sequence over the tp ranks, so every message is (b, S/tp, H); pass tp.

    `device_time` (seconds, default 0) emulates an accelerator: every action also waits device_time x its unit
    cost (`simulation.unit_cost`: F = 1, B = 2, I = W = 1, divided by v) inside its traced span, as a CPU waits
    for a GPU kernel. When 4 simulated ranks share 2 CPU cores, their real compute slows each other down; a
    device time well above the real compute makes the measured timeline show the schedule itself, in units
    of device_time comparable with `simulate(schedule)`."""

    def __init__(self, model: GPT, schedule: Schedule, group=None, dp_group=None, device_time: float = 0.0,
                 sequence_split: int = 1, loss_group=None, copy: bool = True,
                 device: torch.device | str | None = None):
        validate(schedule)
        p = comm.get_world_size(group)
        if schedule.ranks != p:
            raise ValueError(f"schedule {schedule.name!r} is for {schedule.ranks} ranks but the pipeline group has "
                             f"{p}; build it with {p} stages")
        if not device_time >= 0:
            raise ValueError(f"device_time is seconds of emulated device work per unit cost, >= 0; "
                             f"got {device_time!r}")
        if not (isinstance(sequence_split, int) and sequence_split >= 1):
            raise ValueError(f"sequence_split must be a positive integer, got {sequence_split!r}")
        super().__init__(model, schedule, group, copy=copy, device=device)   # this rank's stages
        self.dp_group, self.device_time = dp_group, float(device_time)
        self.loss_group = dp_group if loss_group is None else loss_group
        self.sequence_split = sequence_split                  # SP: stages exchange (b, S/tp, H)
        # this rank's messages with every peer (pipeline ranks), in the one order merged across peers
        self.messages = StageMessages(schedule, self.rank, self.peers, group)
        self._split = any(a.kind in "IW" for a in schedule.actions[self.rank])
        self._captures: list | None = None
        self._hooked: weakref.WeakSet = weakref.WeakSet()   # (not ids: a replaced module's id can be reused)
        self.register_split_backward_hooks()

    def register_split_backward_hooks(self) -> None:
        """For schedules with I and W: record the output (and, for nn.Linear, the input) of every module that
        owns parameters, so W can compute their gradients later. Called by the constructor and again at the start
        of every step, so that modules put in after construction (layers sharded for tensor parallelism, expert
        layers) are recorded too: a module without the hook would get no gradient at all (I computes only the
        gradients of what was recorded), silently."""
        if not self._split:
            return
        for mod in self.module.modules():
            if mod not in self._hooked and any(True for _ in mod.parameters(recurse=False)):
                mod.register_forward_hook(self._capture)
                self._hooked.add(mod)

    def _capture(self, mod, inputs, output):
        if self._captures is not None:
            self._captures.append((mod, inputs[0] if isinstance(mod, nn.Linear) else None, output))

    # ------------------------------------------------------------------ one training step
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One training step in three phases: `_begin_step` (micro-batches, message shapes, loss weights, the
        gradients of earlier steps set aside), this rank's actions in the schedule's order (`_run_forward`,
        `_run_backward` for B and for I, `_run_weight_grads` for W), and `_finish_step` (every message waited,
        tied and data-parallel gradients synced, the earlier gradients added back)."""
        st = self._begin_step(x, y)
        run = {"F": self._run_forward, "B": self._run_backward, "I": self._run_backward, "W": self._run_weight_grads}
        for a in self.schedule.actions[self.rank]:
            run[a.kind](a, st)
            self.messages.reap()
        return self._finish_step(st)

    def _begin_step(self, x: torch.Tensor, y: torch.Tensor) -> "_StepState":
        if self.device.type == "meta":
            raise ValueError("this rank's stages are still on the meta device: build PipelineParallel with "
                             "device=..., or call pipe.to(device), which materialises them there")
        micro = micro_batches(x, y, self.schedule.microbatches)   # m x ((b, S), (b, S))
        b, T = micro[0][0].shape
        if T % self.sequence_split:
            raise ValueError(f"sequence length {T} does not split over sequence_split={self.sequence_split} "
                             f"(the tensor-parallel ranks of sequence parallelism); use a multiple of it")
        shape = (b, T // self.sequence_split, self.module.config.n_embd)   # every message: (b, S/sp, H)
        self.messages.begin(shape, self.dtype, self.device)
        last = self.schedule.stages - 1 in self.my_stages
        counts, weights = self._loss_weights([t for _, t in micro]) if last else (None, None)
        earlier = set_aside_grads(self.module.parameters())  # accumulation: sync only this step's grads
        self.register_split_backward_hooks()                 # modules replaced since construction (ZB: I and W)
        return _StepState(micro, last, counts, weights, earlier,
                          torch.zeros((), dtype=self.dtype, device=self.device))

    def _run_forward(self, a: Action, st: "_StepState") -> None:
        """F: receive the stage's input (outside the compute span), run the stage, keep what B needs, send on."""
        s, i, S = a.stage, a.mb, self.schedule.stages
        inp = st.micro[i][0] if s == 0 else self.messages.get("act", s, i).requires_grad_()
        with region(KINDS[a.kind], label=f"stage {s} mb {i}"):
            self._captures = [] if self._split else None
            out = self.forward_stage(s, inp)                  # (b, S, H), or logits (b, S, V) on the last stage
            if s == S - 1:
                # the module's own loss: GPT.loss, or a TP stage's vocab-parallel cross-entropy
                # weighted by its share of the batch's targets: the mean over all of them
                out = weighted_mean_loss(self.module.loss, out, st.micro[i][1], st.counts[i], st.weights[i])
                st.loss_sum += out.detach()
            st.saved[(s, i)] = (inp, out, self._captures)
            self._captures = None
            self._device(a)
        if s < S - 1:
            self.messages.put("act", s + 1, i, out.detach())

    def _run_backward(self, a: Action, st: "_StepState") -> None:
        """B (input and weight gradients at once) or I (the input gradient, and every captured layer output's
        gradient kept for W): receive dL/d(out), backpropagate through the stage, send dL/d(in) back."""
        s, i = a.stage, a.mb
        inp, out, caps = st.saved.pop((s, i))
        grad = None if s == self.schedule.stages - 1 else self.messages.get("grad", s, i)   # dL/d(out): (b, S, H)
        with region(KINDS[a.kind], label=f"stage {s} mb {i}"):
            if a.kind == "B":
                torch.autograd.backward(out, grad)
                gin = inp.grad if s > 0 else None
            else:
                wrt = ([inp] if s > 0 else []) + [c[2] for c in caps]
                g = torch.autograd.grad(out, wrt, grad, retain_graph=True, allow_unused=True)
                gin = g[0] if s > 0 else None
                st.kept[(s, i)] = (caps, g[1:] if s > 0 else g)
            self._device(a)
        if s > 0:
            self.messages.put("grad", s - 1, i, gin)

    def _run_weight_grads(self, a: Action, st: "_StepState") -> None:
        """W: the weight gradients from what I kept (nobody waits for them)."""
        with region(KINDS[a.kind], label=f"stage {a.stage} mb {a.mb}"):
            _weight_grads(*st.kept.pop((a.stage, a.mb)))
            self._device(a)

    def _finish_step(self, st: "_StepState") -> torch.Tensor | None:
        self.messages.end()                                   # every isend waited (gloo rule)
        self._sync_tied()
        if self.dp_group is not None:
            comm.average_grads(self.module.parameters(), self.dp_group, "pipeline dp grads")
        add_back_grads(st.earlier)
        return st.loss_sum if st.last else None

    def _loss_weights(self, targets: list[torch.Tensor]) -> tuple[list[int], list[float]]:
        """Per micro-batch: its number n_i of non-ignored targets, and its loss weight D n_i / N (see above)."""
        counts = torch.stack([count_targets(t) for t in targets])         # (m,) int64
        total = counts.sum()                                               # ()
        D = comm.get_world_size(self.loss_group) if self.loss_group is not None else 1
        if D > 1:
            comm.all_reduce(total, group=self.loss_group, label="loss average (token count)")
        n, total = counts.tolist(), int(total)
        return n, [c * D / total if c else 0.0 for c in n]

    def _device(self, a: Action) -> None:
        """The emulated accelerator's share of action `a` (nothing when device_time is 0)."""
        if self.device_time:
            time.sleep(self.device_time * unit_cost(a, self.schedule.chunks))


def set_aside_grads(params) -> dict:
    """Take the gradients accumulated so far off the parameters (.grad = None): {param: grad}."""
    earlier = {}
    for q in params:
        if q.grad is not None:
            earlier[q], q.grad = q.grad, None
    return earlier


@torch.no_grad()
def add_back_grads(earlier: dict) -> None:
    """Put the set-aside gradients back, plus what was accumulated since (in place: .grad stays the same tensor)."""
    for q, g in earlier.items():
        if q.grad is not None:
            g.add_(q.grad)
        q.grad = g


@torch.no_grad()
def _weight_grads(caps, gys) -> None:
    """W: accumulate weight gradients from each layer's output gradient (and, for Linear, its saved input)."""
    for (mod, x, y), gy in zip(caps, gys):
        if gy is None:
            continue
        if isinstance(mod, nn.Linear):                        # y = x W^T + b
            g2 = gy.reshape(-1, gy.shape[-1])                 # (N, out)
            grads = [g2.T @ x.reshape(-1, x.shape[-1])]       # dW = dY^T X: (out, in)
            if mod.bias is not None:
                grads.append(g2.sum(0))                       # db = sum over rows of dY: (out,)
            prms = [mod.weight] + ([mod.bias] if mod.bias is not None else [])
        else:   # LayerNorm, Embedding, tensor-parallel layers: backward through the module's own graph only
            prms = [q for q in mod.parameters(recurse=False) if q.requires_grad]
            with torch.enable_grad():
                grads = torch.autograd.grad(y, prms, gy, retain_graph=True, allow_unused=True)
        for q, g in zip(prms, grads):
            if g is not None:
                g = g.to(q.dtype)                             # autocast: bf16 dW for an fp32 master weight
                q.grad = g.clone() if q.grad is None else q.grad + g


# ---------------------------------------------------------------------- measured timelines
_LABEL = re.compile(r"^stage (\d+) mb (\d+)$")
_KIND = {name: k for k, name in KINDS.items()}


def measured_spans(trace: Trace) -> dict[int, list[tuple[float, float, Action]]]:
    """Per global rank, the (start, end, Action) spans the executor recorded, seconds from the first of them."""
    evs = [e for e in trace.events if e.kind == "compute" and e.op in _KIND and _LABEL.match(e.label)]
    t0 = min((e.start for e in evs), default=0.0)
    out: dict[int, list] = defaultdict(list)
    for e in evs:
        s, i = map(int, _LABEL.match(e.label).groups())
        out[e.rank].append((e.start - t0, e.end - t0, Action(s, _KIND[e.op], i)))
    return {r: sorted(v, key=lambda t: t[0]) for r, v in sorted(out.items())}


def measured_bubble(trace: Trace) -> float:
    """Idle fraction of the measured pipeline step over all ranks: 1 - compute time / (ranks * makespan)."""
    spans = measured_spans(trace)
    if not spans:
        raise ValueError("the trace holds no pipeline actions; run the step under parlab.run(..., trace=True)")
    makespan = max(e for sp in spans.values() for _, e, _ in sp)
    busy = sum(e - s for sp in spans.values() for s, e, _ in sp)
    return 1 - busy / (len(spans) * makespan)


def measured_costs(trace: Trace) -> dict[tuple[int, str], float]:
    """Mean measured seconds of each (stage, kind); `simulate(schedule, costs=lambda a: c[(a.stage, a.kind)])`
    then predicts the step from the real per-action costs (comparable with `measured_bubble`)."""
    acc: dict[tuple[int, str], list[float]] = defaultdict(list)
    for sp in measured_spans(trace).values():
        for t0, t1, a in sp:
            acc[(a.stage, a.kind)].append(t1 - t0)
    return {k: sum(v) / len(v) for k, v in acc.items()}
