"""The report `parlab calibrate` prints: what it measured, what it fitted, and how well the fits match.

nccl-tests-like rows for the all-reduce (time, algorithm bandwidth X / t, bus bandwidth 2 (N-1)/N X / t; nccl-tests
PERFORMANCE.md), the point-to-point and in-step communication fits, and each compute sample and training step
beside what the fitted model says of it. Pure formatting: `parlab.cluster.calibrate.describe` does the fitting.
"""
from __future__ import annotations

from parlab.cluster.hardware import Hardware
from parlab.trace.wire import ring_factor, ring_steps
from parlab.trace.histogram import size_class

__all__ = ["report"]


def report(n: int, hw: Hardware, single: Hardware, *, rows, alpha, bw, p2p_rows, p2p_lat, p2p_bw, over,
           overlap_fit, programs: bool, step_comm, pooled, steps, step_fit) -> str:
    """The text of the calibration of `hw` on `n` ranks (`single`: the description before the training-step
    fits, whose rates the single-op rows are compared with)."""
    hop, busbw = alpha / ring_steps("all_reduce", n), ring_factor("all_reduce", n)
    lines = [f"{'size':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} {'fit us':>9}"]
    for size, t in rows:
        lines.append(f"{size:>10} {t * 1e6:>10.1f} {size / t / 1e9:>11.4f} {busbw * size / t / 1e9:>11.4f} "
                     f"{(alpha + busbw * size / bw) * 1e6:>9.1f}")
    lines.append(f"all-reduce fit: alpha {alpha * 1e6:.1f} us ({hop * 1e6:.2f} us per ring step), bandwidth "
                 f"{bw / 1e9:.3f} GB/s")
    lines.append("point to point (every rank sends to the next at once): " + ", ".join(
        f"{size} B {t * 1e6:.0f} us" for size, t in p2p_rows))
    lines.append(f"p2p fit: latency {p2p_lat * 1e6:.1f} us, bandwidth {p2p_bw / 1e9:.3f} GB/s")
    if over:
        lines.append("a ring step's send + receive in flight during compute: " + ", ".join(
            f"{size} B: compute {a * 1e3:.2f} -> {b * 1e3:.2f} ms ({e:.2f} x the message time)"
            for (size, a, b), e in zip(over, overlap_fit["exposed"]))
            + f"; comm_overlap {hw.comm_overlap} (overlap when the median is below 0.5)")
        if overlap_fit["in_step"]:
            lat, in_bw = overlap_fit["in_step"]
            lines.append(f"p2p inside a step (what the messages slowed the compute by): latency "
                         f"{lat * 1e6:.1f} us, bandwidth {in_bw / 1e9:.3f} GB/s ("
                         + ("not used: the training-step programs below measure it)" if programs
                            else "replaces the fit above)"))
    if step_comm:
        what = "collective" if step_comm.get("p2p_cpu") is not None else "call"
        share = (f", each asynchronous {what} takes {step_comm['cpu'] * 1e3:.2f} ms of its rank's core"
                 if not hw.comm_overlap else "")
        msgs = (f", each message (pipeline, ring attention) {step_comm['p2p_delay'] * 1e3:.2f} ms later"
                + (f" and {step_comm['p2p_cpu'] * 1e3:.2f} ms of its rank's core"
                   if step_comm.get("p2p_cpu") is not None else "")
                if step_comm.get("p2p_delay") is not None else "")
        lines.append(f"communication inside training steps: each collective ends "
                     f"{step_comm['delay'] * 1e3:.2f} ms later than the fits above say{msgs}{share} ({hw.comm_streams} "
                     f"collective(s) of a group in flight at once); replayed / measured step per program before -> "
                     f"after "
                     + ", ".join(f"{label}: {a:.2f} -> {b:.2f}" for label, a, b in
                                 zip(step_comm["labels"], step_comm["before"], step_comm["after"])))
    cache = (f"{single.cache_bw / 1e9:.2f} GB/s for ops of working set <= {single.cache_bytes / 2 ** 20:g} MiB, "
             if single.cache_bw else "one memory level: ")
    bmm = f"batched products {single.bmm_flops / 1e9:.2f} GFLOP/s, " if single.bmm_flops else ""
    sp = (f"special functions (exp, GeLU, logsumexp) {single.special_rate / 1e9:.3f} G results/s, "
          if single.special_rate else "")
    lines.append(f"compute fit (single ops): {single.peak_flops / 1e9:.2f} GFLOP/s, {bmm}{cache}"
                 f"{single.mem_bw / 1e9:.2f} GB/s, {sp}{single.kernel_overhead * 1e6:.2f} us per kernel (median time "
                 f"of {n} ranks per sample)")
    n_mm = sum(1 for s in pooled if s[0])                       # products first, then an add and a copy per size
    for i, (f, b, k, t, ws, fb) in enumerate(pooled):
        model = single.compute_time(f, b, k, ((size_class(ws), b),) if b else (), fb)
        what = ("bmm" if fb else "matmul") if f else ("add" if (i - n_mm) % 2 == 0 else "copy")
        lines.append(f"  {what:>6} {f:>12.3g} FLOP {b:>10} B  {t * 1e6:>9.1f} us "
                     f"measured, {model * 1e6:>9.1f} us fitted")
    if steps:
        c, gamma, beta = step_fit["c"], step_fit["gamma"], step_fit["beta"]
        cp = step_fit.get("c_plain", c)
        lines.append(f"training steps (AdamW): {c * 1e6:.2f} us per op under autograd, {cp * 1e6:.2f} us per op "
                     f"outside it (optimizer), products' time x {gamma:.2f}, memory time x {beta:.2f}: "
                     f"{hw.peak_flops / 1e9:.2f} GFLOP/s, {hw.mem_bw / 1e9:.2f} GB/s (single-op fit above); per "
                     f"part of a step: ops (outside autograd), measured, single-op model, step model")
        lines.append("  leave-one-out RMS relative error per model (weight in the average kept): " + ", ".join(
            f"{' + '.join(m)} {e:.1%} ({step_fit['weights'][m]:.2f})" for m, e in step_fit["cv_all"].items()))
        for f, b, k, t, hist, fb, *rest in steps:
            sp_n, kp, part = (list(rest) + [0, 0, "step"][len(rest):])[:3]   # older samples: fewer fields
            lines.append(f"  {part:>18} {k:>6} ops ({kp:>4}) {f:>10.3g} FLOP {b:>11} B  {t * 1e3:>7.2f} ms "
                         f"measured, {single.compute_time(f, b, k, hist, fb, sp_n, kp) * 1e3:>7.2f} ms single-op fit, "
                         f"{hw.compute_time(f, b, k, hist, fb, sp_n, kp) * 1e3:>7.2f} ms step fit")
    return "\n".join(lines)
