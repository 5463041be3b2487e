"""Standalone labs: each strategy (and the 4D composition) as a script for torchrun, on CPUs or GPUs.

    torchrun --nproc_per_node=8 -m parlab.labs.tensor_parallel --layers 4 --hidden 256 --steps 50
    python -m parlab.labs.data_parallel --steps 5            # one rank, no torchrun needed

Every lab is short because the common scaffolding lives here:

* `start(name, description, add_args)`: command-line options (model size, batch, steps, dtype, trace
  path), `parlab.init()` (NCCL on ``cuda:LOCAL_RANK`` when GPUs are present, gloo on the CPU; one node or
  many through torchrun's rendezvous), the dense tiny GPT (`Lab.model()` on this rank's device, or
  ``Lab.model(meta=True)`` on the meta device for strategies that keep only a part of it: pipeline, tensor
  parallel, ZeRO-3 and hybrid materialise only their part, on the device, with the dense model's values,
  so no process ever holds the whole model) and the shipped character corpus with a
  `BatchSampler` (every rank can recompute the global batch of any step: no data loader);
* `Lab.train(step_fn, ...)` (``loop.py``): the training loop with a tqdm progress bar on rank 0, timing
  (tokens/s from the steps after the first, which pays for warm-up), every traced call recorded, then the
  report: memory per rank and the merged Chrome trace, gathered to rank 0 with
  ``torch.distributed.gather_object`` (reporting is not training traffic, so it is not traced).
* `--timeout` (default 300 s) is the process group's timeout: a collective that waits longer for a rank
  that stopped answering (SIGSTOP, a hang, a dead node) fails instead of waiting torch's 600-s default.
  Every rank keeps a heartbeat counter and its current step in the rendezvous store
  (`parlab.launch.watch.Watch`, a daemon thread, started by `watch_peers`); a rank whose collective fails looks
  twice, a few heartbeats apart, and prints which rank stopped answering (its counter did not move) and the
  step each rank had reached.
* ``options.py``: the options every lab shares; ``gpu_check.py``: the first run on a machine with GPUs (every
  lab under torchrun, the suite's GPU tests, a results table).

Memory (``loop.py`` says how each number is measured). On GPUs the report gives the allocator's peak of
construction and peak of training; max_mem/rank is the larger. On CPUs it gives the bytes of parameters,
gradients and optimizer state the rank holds and the process's peak resident set after construction and at the
end.

Precision (``--dtype``). float32 / float64: parameters, gradients, optimizer state and compute all in that
dtype. bfloat16: mixed precision with fp32 master weights: parameters, gradients and AdamW state stay
float32 and the forward (and so the backward) runs under ``torch.autocast(dtype=torch.bfloat16)``: matmuls
in bf16, reductions such as layer norm and the loss in fp32 (Micikevicius et al., "Mixed Precision
Training", arXiv:1710.03740). bf16 has fp32's exponent range, so no loss scaling is needed.

Only rank 0 prints. The last line is the summary, e.g.
``summary: lab=pipeline world=4 backend=gloo steps=10 loss=3.1021 tokens/s=8123 max_mem/rank=1.2 MB trace=...``.
Open the trace at https://ui.perfetto.dev or chrome://tracing: one row per rank.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from parlab.corpus import BatchSampler, CharTokenizer, load_corpus
from parlab.i18n import _
from parlab.labs import loop
from parlab.labs.loop import gather_to_main, peak_memory
from parlab.labs.options import DTYPES, MIXED, parser, positive_float, positive_int
from parlab.launch import Context, init
from parlab.launch.watch import Watch, stopped_itself, watch_peers
from parlab.models import GPT, GPTConfig
from parlab.trace import Trace

__all__ = ["Lab", "start", "parser", "peak_memory", "gather_to_main", "LABS", "Watch", "stopped_itself",
           "positive_int", "positive_float"]

LABS = ("data_parallel", "zero", "tensor_parallel", "pipeline", "context_parallel", "expert_parallel", "hybrid")


@dataclass
class Lab:
    """What a lab script works with: its options, where this rank runs, the model config and the data."""
    name: str
    args: argparse.Namespace
    ctx: Context
    config: GPTConfig
    sampler: BatchSampler
    trace: Trace | None = None   # after `train`, on rank 0: the merged trace of all ranks
    watch: "Watch | None" = None  # heartbeats and steps of every rank, to name one that stops answering

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype: float32 in mixed precision (--dtype bfloat16), else --dtype."""
        return torch.float32 if self.args.dtype in MIXED else DTYPES[self.args.dtype]

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.args.dtype]

    def autocast(self):
        """Context for the forward (and backward): bf16 autocast in mixed precision, else nothing."""
        if self.args.dtype in MIXED:
            return torch.autocast(self.device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()

    def log(self, *parts) -> None:
        """Print on rank 0 only."""
        if self.ctx.is_main:
            print(*parts, flush=True)

    def model(self, host: bool = False, meta: bool = False) -> GPT:
        """The dense tiny GPT, the same on every rank (seeded init), on this rank's device; with ``host=True``
        on the CPU; with ``meta=True`` on the meta device (no memory, no values yet), for a strategy that
        keeps only a part of it and materialises just that part on the device, with the dense model's values
        (`parlab.parallel.meta_init.materialize`: pipeline, tensor parallel, ZeRO-3 and hybrid do)."""
        device = torch.device("meta") if meta else torch.device("cpu") if host else self.device
        return GPT(self.config, seed=self.args.seed, dtype=self.dtype, device=device)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of `step` (B, S), the same on every rank; strategies take their part of it."""
        x, y = self.sampler.global_batch(step)
        return x.to(self.device), y.to(self.device)

    def train(self, step_fn: Callable[[int], torch.Tensor | None], params: Callable[[], Iterable[torch.Tensor]],
              optimizer: torch.optim.Optimizer | None = None, extra: str | Callable[[], str] = "",
              trace_report: Callable[[Trace], None] | None = None) -> dict:
        """Run ``step_fn(step)`` (one optimizer step; returns the loss, valid at least on rank 0) for --steps
        steps, then report. `params()` gives the tensors this rank keeps, for CPU memory accounting;
        `trace_report(trace)` runs on rank 0 before the summary line, with the merged trace; `extra` ends the
        summary line (a function: called then, for what the training measured). The loop and the report are
        `parlab.labs.loop.train`."""
        return loop.train(self, step_fn, params, optimizer, extra, trace_report)


def start(name: str, description: str, add_args: Callable[[argparse.ArgumentParser], None] | None = None,
          argv: list[str] | None = None, check: Callable[[argparse.Namespace], str | None] | None = None) -> Lab:
    """Parse the options, start torch.distributed (`parlab.init`) and set up model config and data. `check(args)`
    returns what is wrong with a combination of the lab's own options (or None): refused like a bad option,
    before anything starts."""
    p = parser(name, description)
    if add_args is not None:
        add_args(p)
    args = p.parse_args(argv)
    if check is not None and (problem := check(args)):
        p.error(problem)
    tok = CharTokenizer()
    if args.vocab < tok.vocab_size:
        p.error(_("--vocab {vocab} is smaller than the corpus alphabet ({n} characters)").format(
            vocab=args.vocab, n=tok.vocab_size))
    try:
        config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads,
                           n_embd=args.hidden)
    except ValueError as e:
        p.error(str(e))
    if not args.no_trace:                    # found now, not after the training (rank 0 writes it at the end)
        folder = os.path.dirname(os.path.abspath(args.trace))
        if os.path.isdir(args.trace) or not os.path.isdir(folder):
            p.error(_("--trace {trace}: that is a folder; name a file in it").format(trace=args.trace)
                    if os.path.isdir(args.trace) else
                    _("--trace {trace}: the folder {folder} does not exist; create it, or pass --no-trace").format(
                        trace=args.trace, folder=folder))
    try:
        ctx = init(args.backend, timeout=args.timeout)
    except RuntimeError as e:       # the launch environment is wrong (MASTER_ADDR empty, a plain `python` in a
        if not str(e).startswith("parlab.init()"):      # multi-task job): said once, by the first task, no traceback
            raise
        if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            print(_("error: {error}").format(error=e), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    watch = watch_peers(ctx.rank, ctx.world_size, timeout=args.timeout)
    torch.manual_seed(args.seed)
    tokens = load_corpus(n_chars=max(20_000, 4 * args.batch * args.seq_len), seed=args.seed)
    lab = Lab(name, args, ctx, config, BatchSampler(tokens, args.batch, args.seq_len, seed=args.seed), watch=watch)
    precision = (_("{dtype} autocast, fp32 master weights").format(dtype=args.dtype) if args.dtype in MIXED
                 else args.dtype)
    lab.log(_("[{name}] world {world} ({backend}, {device}); model: {layers} layers, hidden {hidden}, {heads} heads, "
              "seq {seq_len}, vocab {vocab}, {params:.2f}M params, {precision}; global batch {batch} x "
              "{seq_len}").format(
        name=name, world=ctx.world_size, backend=ctx.backend, device=ctx.device.type, layers=args.layers,
        hidden=args.hidden, heads=args.heads, seq_len=args.seq_len, vocab=args.vocab,
        params=config.param_count() / 1e6, precision=precision, batch=args.batch))
    return lab
