"""The training loop every lab runs (`train`, which `Lab.train` calls) and its report: time, memory, the trace.

`train` runs the lab's ``step_fn(step)`` for --steps steps (`_run_steps`: a tqdm bar on rank 0, the step published
to the `Watch`, every traced call recorded, tokens/s timed from the steps after the first, which pays for
warm-up), measures this rank's memory (`_memory`), gathers every rank's report to rank 0 (`gather_to_main`, with
``torch.distributed.gather_object``: reporting is not training traffic, so it is not traced) and prints it there
(`_report`): memory per rank, the merged Chrome trace, the summary line.

Memory. On GPUs ``torch.cuda.max_memory_allocated`` twice, labelled: the peak of construction (everything before
the first step, since the process started) and the peak of training (counter reset after construction);
max_mem/rank is the larger. On CPUs (no allocator counter): the bytes of parameters, gradients and optimizer state
the rank holds (`parlab.parallel.zero.memory.measure`) and the process's peak resident set (`peak_memory`:
``ru_maxrss``, which includes the Python and torch runtime) after construction and at the end.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from parlab.i18n import _
from parlab.parallel.zero import measure
from parlab.trace import Trace, recording

__all__ = ["train", "peak_memory", "gather_to_main"]


def train(lab, step_fn: Callable[[int], torch.Tensor | None], params: Callable[[], Iterable[torch.Tensor]],
          optimizer: torch.optim.Optimizer | None = None, extra: str | Callable[[], str] = "",
          trace_report: Callable[[Trace], None] | None = None) -> dict:
    """`Lab.train`: run ``step_fn(step)`` for the lab's --steps steps, then report (see the module docstring).
    Returns the summary: lab, world, backend, steps, loss, tokens_per_s (on rank 0 also max_mem_per_rank and the
    trace's path)."""
    a, cuda = lab.args, lab.device.type == "cuda"
    built = peak_memory(lab.device)                  # construction: everything before the first step
    if cuda:
        torch.cuda.reset_peak_memory_stats(lab.device)
    loss_value, seconds, events = _run_steps(lab, step_fn)
    timed = a.steps - 1 if a.steps > 1 else 1             # steps after the first (warm-up) one
    tps = a.batch * a.seq_len * timed / max(seconds, 1e-9)
    report = {"rank": lab.rank, "memory": _memory(lab, built, params, optimizer),
              "events": None if a.no_trace else events}
    reports = gather_to_main(report)
    summary = {"lab": lab.name, "world": lab.world_size, "backend": lab.ctx.backend, "steps": a.steps,
               "loss": loss_value, "tokens_per_s": tps}
    if lab.ctx.is_main:
        _report(lab, reports, summary, extra, trace_report)
    return summary


def _run_steps(lab, step_fn) -> tuple[float, float, list]:
    """The loop: (the last loss seen on rank 0, the seconds of the timed steps, this rank's recorded events)."""
    a, cuda = lab.args, lab.device.type == "cuda"
    bar = None
    if lab.ctx.is_main and not a.quiet:
        from tqdm import tqdm
        bar = tqdm(total=a.steps, desc=lab.name, unit="step", file=sys.stdout, dynamic_ncols=True)
    loss_value, t_first = float("nan"), None
    with recording(lab.rank) as rec:
        t_start = time.perf_counter()
        for step in range(a.steps):
            if lab.watch is not None:
                lab.watch.at_step(step)
            loss = step_fn(step)
            if cuda:
                torch.cuda.synchronize(lab.device)    # GPU work is asynchronous: time what finished
            if lab.ctx.is_main and loss is not None:
                loss_value = float(loss)
            if step == 0:
                t_first = time.perf_counter()
            if bar is not None:
                bar.set_postfix(loss=f"{loss_value:.4f}")
                bar.update(1)
        t_end = time.perf_counter()
    if bar is not None:
        bar.close()
    seconds = (t_end - t_first) if a.steps > 1 else (t_end - t_start)
    return loss_value, seconds, rec.events


def _memory(lab, built: int, params, optimizer) -> dict:
    """This rank's memory: the allocator's peaks on CUDA; the state held and the peak RSS on the CPU."""
    if lab.device.type == "cuda":
        trained = peak_memory(lab.device)
        return {"construction_peak": built, "training_peak": trained, "max_allocated": max(built, trained)}
    mem = measure(list(params()), optimizer)
    mem.update({"rss_peak_after_construction": built, "rss_peak_at_end": peak_memory(lab.device)})
    return mem


def _report(lab, reports: list[dict], summary: dict, extra, trace_report) -> None:
    """On rank 0: every rank's memory, the merged trace (written, and `trace_report` run on it), the summary line."""
    a, cuda = lab.args, lab.device.type == "cuda"
    key = "max_allocated" if cuda else "total"
    lab.log(_("memory per rank (torch.cuda.max_memory_allocated: peak of construction, peak of training "
              "steps, the larger):") if cuda else
            _("memory per rank (params + grads + optimizer state held, parlab.parallel.zero.memory.measure; "
              "process peak RSS (incl. the runtime) after construction and at the end):"))
    for r in reports:
        lab.log(f"  rank {r['rank']:>3}: " + ", ".join(f"{k} {_mb(v)}" for k, v in r["memory"].items()))
    summary["max_mem_per_rank"] = max(r["memory"].get(key, 0) for r in reports)
    if not a.no_trace:
        trace = Trace.merge(r["events"] for r in reports)
        trace.to_chrome(a.trace)
        lab.trace = trace
        summary["trace"] = os.path.abspath(a.trace)
        lab.log(_("trace: {messages} messages, {events} events from {ranks} ranks").format(
            messages=len(trace.comm()), events=len(trace), ranks=len(trace.ranks)))
        if trace_report is not None:
            trace_report(trace)
    extra = extra() if callable(extra) else extra
    lab.log(f"summary: lab={lab.name} world={lab.world_size} backend={lab.ctx.backend} steps={a.steps} "
            f"loss={summary['loss']:.4f} tokens/s={summary['tokens_per_s']:.0f} "
            f"max_mem/rank={_mb(summary['max_mem_per_rank'])}"
            + (f" {extra}" if extra else "") + (f" trace={a.trace}" if not a.no_trace else ""))


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
