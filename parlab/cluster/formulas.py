"""Back-of-the-envelope formulas for lesson 00 ("why parallel") and the collectives lesson.

Pure arithmetic (no torch): each function is one formula from the course, so a
lesson can show both the formula and the number it gives, and a test can pin
the figures the course quotes. Memory per parameter (2 + 2 + 12 = 16 bytes under
mixed-precision Adam, ZeRO's sharded variants) lives in `parlab.parallel.zero.memory`.

References
1. Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
   Parameter Models", arXiv:1910.02054, section 3.1: mixed-precision Adam keeps
   2 + 2 + K bytes per parameter with K = 12.
2. Kaplan et al., "Scaling Laws for Neural Language Models", arXiv:2001.08361,
   section 2.1: training costs about 6 FLOPs per parameter per token.
3. Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
   workstations", JPDC 2009: ring all-reduce sends 2(N-1)/N of the data per rank.
4. Seeds 001/002 of this course: BERT 58 h/epoch on one GPU vs 9.5 h on 8; an
   80 GB GPU holds 5.0B parameters; GPT-3 would take 355 years on one GPU;
   total speed ~ single-device speed x devices x multi-device efficiency.
"""
from __future__ import annotations

from parlab.cluster.transformer import training_flops_6nd
from parlab.trace.wire import wire_bytes

__all__ = ["GB", "weights_memory",
           "speedup", "efficiency", "total_speed", "training_flops", "device_seconds", "wall_clock_days",
           "SECONDS_PER_YEAR", "ring_all_reduce_bytes", "naive_all_reduce_bytes"]

GB = 1e9                      # memory sizes in the course are decimal gigabytes, as GPU vendors quote them
SECONDS_PER_YEAR = 365.25 * 24 * 3600    # a Julian year


def weights_memory(n_params: float, bytes_per_value: float = 2) -> float:
    """Bytes of the weights alone: GPT-3's 175e9 parameters in 16-bit are 350 GB."""
    return n_params * bytes_per_value


def speedup(time_one: float, time_many: float) -> float:
    """How many times faster: BERT 58 h / 9.5 h = 6.1x."""
    return time_one / time_many


def efficiency(speedup_: float, devices: int) -> float:
    """Multi-device efficiency: the speed-up as a fraction of the ideal `devices`x (6.1 / 8 = 0.76)."""
    return speedup_ / devices


def total_speed(single_device_speed: float, devices: int, efficiency_: float) -> float:
    """Total training speed ~ single-device speed x number of devices x multi-device efficiency."""
    return single_device_speed * devices * efficiency_


def training_flops(n_params: float, n_tokens: float) -> float:
    """About 6 FLOPs per parameter per token (2 forward + 4 backward), ref. 2: Kaplan's estimate, the rule of
    thumb lesson 00 needs (`parlab.cluster.transformer.training_flops_6nd`). The count with the attention scores
    and the logits, which the planner and the replay use, is `transformer.model_flops` (Megatron's)."""
    return training_flops_6nd(n_params, n_tokens)


def device_seconds(flops: float, flops_per_second: float) -> float:
    """Seconds one device needs at a sustained `flops_per_second`."""
    return flops / flops_per_second


def wall_clock_days(gpu_hours: float, gpus: int, efficiency_: float = 1.0) -> float:
    """Days a job of `gpu_hours` takes on `gpus` devices at the given multi-device efficiency."""
    return gpu_hours / (gpus * efficiency_) / 24


def ring_all_reduce_bytes(size_bytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce: N-1 reduce-scatter + N-1 all-gather steps of size/N,
    2(N-1)/N x size (`parlab.trace.wire`)."""
    return wire_bytes("all_reduce", size_bytes, n)


def naive_all_reduce_bytes(size_bytes: float, n: int) -> dict[str, float]:
    """Bytes sent when everyone sends to a root that sums and sends the result back:
    every other rank sends `size` once, the root sends (N-1) x size."""
    return {"root": (n - 1) * size_bytes, "other": float(size_bytes)}
