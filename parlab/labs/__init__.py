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
* `Lab.train(step_fn, ...)`: the training loop with a tqdm progress bar on rank 0, timing (tokens/s
  from the steps after the first, which pays for warm-up), every traced call recorded, then the report:
  memory per rank and the merged Chrome trace, gathered to rank 0 with
  ``torch.distributed.gather_object`` (reporting is not training traffic, so it is not traced).
* `--timeout` (default 300 s) is the process group's timeout: a collective that waits longer for a rank
  that stopped answering (SIGSTOP, a hang, a dead node) fails instead of waiting torch's 600-s default.
  Every rank keeps a heartbeat counter and its current step in the rendezvous store (`Watch`, a daemon
  thread); a rank whose collective fails looks twice, a few heartbeats apart, and prints which rank
  stopped answering (its counter did not move) and the step each rank had reached.

Memory. On GPUs the report gives ``torch.cuda.max_memory_allocated`` twice, labelled: the peak of
construction (everything before the first step, since the process started) and the peak of training
(counter reset after construction); max_mem/rank is the larger. On CPUs (no allocator counter) it gives the
bytes of parameters, gradients and optimizer state the rank holds (`parlab.parallel.zero.memory.measure`) and the
process's peak resident set (``ru_maxrss``, which includes the Python and torch runtime) after
construction and at the end.

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
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from parlab.data import BatchSampler, CharTokenizer, load_corpus
from parlab.i18n import _
from parlab.labs.options import DTYPES, MIXED, parser, positive_float, positive_int
from parlab.launch import Context, init
from parlab.launch.watch import Watch, stopped_itself
from parlab.parallel.zero import measure
from parlab.models import GPT, GPTConfig
from parlab.trace import Trace, recording

__all__ = ["Lab", "start", "parser", "peak_memory", "LABS", "Watch", "stopped_itself", "positive_int", "positive_float"]

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
        summary line (a function: called then, for what the training measured)."""
        a, cuda = self.args, self.device.type == "cuda"
        tokens_per_step = a.batch * a.seq_len
        bar = None
        if self.ctx.is_main and not a.quiet:
            from tqdm import tqdm
            bar = tqdm(total=a.steps, desc=self.name, unit="step", file=sys.stdout, dynamic_ncols=True)
        built = peak_memory(self.device)                  # construction: everything before the first step
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        loss_value, t_first, t_end = float("nan"), None, None
        with recording(self.rank) as rec:
            t_start = time.perf_counter()
            for step in range(a.steps):
                if self.watch is not None:
                    self.watch.at_step(step)
                loss = step_fn(step)
                if cuda:
                    torch.cuda.synchronize(self.device)   # GPU work is asynchronous: time what finished
                if self.ctx.is_main and loss is not None:
                    loss_value = float(loss)
                if step == 0:
                    t_first = time.perf_counter()
                if bar is not None:
                    bar.set_postfix(loss=f"{loss_value:.4f}")
                    bar.update(1)
            t_end = time.perf_counter()
        if bar is not None:
            bar.close()
        timed = a.steps - 1 if a.steps > 1 else 1             # steps after the first (warm-up) one
        seconds = (t_end - t_first) if a.steps > 1 else (t_end - t_start)
        tps = tokens_per_step * timed / max(seconds, 1e-9)
        if cuda:
            trained = peak_memory(self.device)
            mem = {"construction_peak": built, "training_peak": trained, "max_allocated": max(built, trained)}
        else:
            mem = measure(list(params()), optimizer)
            mem.update({"rss_peak_after_construction": built, "rss_peak_at_end": peak_memory(self.device)})
        report = {"rank": self.rank, "memory": mem, "events": None if a.no_trace else rec.events}
        reports = gather_to_main(report)
        summary = {"lab": self.name, "world": self.world_size, "backend": self.ctx.backend, "steps": a.steps,
                   "loss": loss_value, "tokens_per_s": tps}
        if self.ctx.is_main:
            key = "max_allocated" if cuda else "total"
            self.log(_("memory per rank (torch.cuda.max_memory_allocated: peak of construction, peak of training "
                       "steps, the larger):") if cuda else
                     _("memory per rank (params + grads + optimizer state held, parlab.parallel.zero.memory.measure; "
                       "process peak RSS (incl. the runtime) after construction and at the end):"))
            for r in reports:
                self.log(f"  rank {r['rank']:>3}: " + ", ".join(f"{k} {_mb(v)}" for k, v in r["memory"].items()))
            summary["max_mem_per_rank"] = max(r["memory"].get(key, 0) for r in reports)
            if not a.no_trace:
                trace = Trace.merge(r["events"] for r in reports)
                trace.to_chrome(a.trace)
                self.trace = trace
                summary["trace"] = os.path.abspath(a.trace)
                self.log(_("trace: {messages} messages, {events} events from {ranks} ranks").format(
                    messages=len(trace.comm()), events=len(trace), ranks=len(trace.ranks)))
                if trace_report is not None:
                    trace_report(trace)
            extra = extra() if callable(extra) else extra
            self.log(f"summary: lab={self.name} world={self.world_size} backend={self.ctx.backend} steps={a.steps} "
                     f"loss={loss_value:.4f} tokens/s={tps:.0f} max_mem/rank={_mb(summary['max_mem_per_rank'])}"
                     + (f" {extra}" if extra else "") + (f" trace={a.trace}" if not a.no_trace else ""))
        return summary


def _report_failures(watch: Watch) -> None:
    """Make an uncaught communication error (a RuntimeError from the backend) print `Watch.report` first."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, RuntimeError):
            try:
                print(watch.report(value), file=sys.stderr, flush=True)
            except Exception:
                pass
        previous(kind, value, tb)

    sys.excepthook = hook


def peak_memory(device: torch.device) -> int:
    """Peak bytes so far: ``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak resident set
    (``ru_maxrss``; includes the Python and torch runtime; 0 where the platform has no `resource` module)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024        # macOS: bytes; Linux: KiB


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def gather_to_main(obj) -> list:
    """Every rank's `obj` on rank 0 (a list in rank order; empty elsewhere). Untraced: reporting only."""
    if dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


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
    watch = None
    if ctx.world_size > 1:
        try:
            store = dist.distributed_c10d._get_default_store()   # private API: guarded, the lab runs without it
        except Exception:
            store = None
        if store is not None:
            watch = Watch(store, ctx.rank, ctx.world_size, timeout=args.timeout)
            _report_failures(watch)
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
