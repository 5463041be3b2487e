"""What a `parlab.cluster.hardware.Hardware` description must satisfy, each rule with a message that says what is
wrong and how to fix it (a description is often a JSON file written by hand or by `parlab calibrate`).
Pure Python; it reads the description's fields and imports nothing of parlab.
"""
from __future__ import annotations

import math

__all__ = ["check"]


def check(hw) -> None:
    """Raise ValueError naming the first field of `hw` that is out of range."""
    if not isinstance(hw.name, str) or not hw.name:
        raise ValueError(f"hardware name must be a non-empty string, got {hw.name!r}")
    if isinstance(hw.gpus_per_node, bool) or not isinstance(hw.gpus_per_node, int) or hw.gpus_per_node < 1:
        raise ValueError(f"hardware {hw.name!r}: gpus_per_node must be a positive integer, "
                         f"got {hw.gpus_per_node!r}")
    nics = hw.nics_per_node
    if nics is not None and (isinstance(nics, bool) or not isinstance(nics, int) or nics < 1):
        raise ValueError(f"hardware {hw.name!r}: nics_per_node must be a positive integer (network cards per "
                         f"node) or None for one per GPU, got {nics!r}")
    for k in ("peak_flops", "mem_bw", "intra_bw", "inter_bw"):
        v = getattr(hw, k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or math.isnan(v):
            raise ValueError(f"hardware {hw.name!r}: {k} must be a positive rate (per second), got {v!r}")
    if hw.sms is not None and (isinstance(hw.sms, bool) or not isinstance(hw.sms, int) or hw.sms < 1):
        raise ValueError(f"hardware {hw.name!r}: sms must be a positive integer (streaming multiprocessors) "
                         f"or None, got {hw.sms!r}")
    for k in ("efficiency", "mem_efficiency", "intra_efficiency"):
        v = getattr(hw, k)
        if not (isinstance(v, (int, float)) and 0 < v <= 1):
            raise ValueError(f"hardware {hw.name!r}: {k} is a fraction in (0, 1], got {v!r}")
    if hw.mfu is not None and not (isinstance(hw.mfu, (int, float)) and not isinstance(hw.mfu, bool)
                                     and 0 < hw.mfu <= 1):
        raise ValueError(f"hardware {hw.name!r}: mfu is a fraction in (0, 1] or None, got {hw.mfu!r}")
    if hw.cache_bw is not None and (isinstance(hw.cache_bw, bool) or not isinstance(hw.cache_bw, (int, float))
                                      or not hw.cache_bw > 0):
        raise ValueError(f"hardware {hw.name!r}: cache_bw must be a positive rate (bytes/s) or None, "
                         f"got {hw.cache_bw!r}")
    cb = hw.cache_bytes
    if isinstance(cb, bool) or not isinstance(cb, (int, float)) or not cb >= 0:
        raise ValueError(f"hardware {hw.name!r}: cache_bytes must be a size >= 0 in bytes, got {cb!r}")
    if hw.bmm_flops is not None and (isinstance(hw.bmm_flops, bool)
                                       or not isinstance(hw.bmm_flops, (int, float)) or not hw.bmm_flops > 0):
        raise ValueError(f"hardware {hw.name!r}: bmm_flops must be a positive rate (FLOP/s) or None, "
                         f"got {hw.bmm_flops!r}")
    if hw.special_rate is not None and (isinstance(hw.special_rate, bool) or not isinstance(
            hw.special_rate, (int, float)) or not hw.special_rate > 0):
        raise ValueError(f"hardware {hw.name!r}: special_rate must be a positive rate (results per second) or "
                         f"None, got {hw.special_rate!r}")
    if not isinstance(hw.comm_overlap, bool):
        raise ValueError(f"hardware {hw.name!r}: comm_overlap must be true or false, got {hw.comm_overlap!r}")
    if hw.p2p_bw is not None and not (isinstance(hw.p2p_bw, (int, float)) and hw.p2p_bw > 0):
        raise ValueError(f"hardware {hw.name!r}: p2p_bw must be a positive rate or None, got {hw.p2p_bw!r}")
    if (isinstance(hw.comm_streams, bool) or not isinstance(hw.comm_streams, int)
            or hw.comm_streams < 1):
        raise ValueError(f"hardware {hw.name!r}: comm_streams must be a positive integer (collectives of one "
                         f"group in flight at once), got {hw.comm_streams!r}")
    for k in ("kernel_overhead", "base_latency", "intra_latency", "inter_latency", "comm_delay", "comm_cpu"):
        v = getattr(hw, k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"hardware {hw.name!r}: {k} must be a time >= 0 in seconds, got {v!r}")
    if hw.precision_flops is not None:
        if not isinstance(hw.precision_flops, dict) or not all(
                isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0
                for k, v in hw.precision_flops.items()):
            raise ValueError(f"hardware {hw.name!r}: precision_flops maps a number format to a positive "
                             f"FLOP/s, e.g. {{'bf16': 312e12}}, got {hw.precision_flops!r}")
    if hw.precision_efficiency is not None:
        if not isinstance(hw.precision_efficiency, dict) or not all(
                isinstance(k, str) and not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v <= 1
                for k, v in hw.precision_efficiency.items()):
            raise ValueError(f"hardware {hw.name!r}: precision_efficiency maps a number format to a fraction in "
                             f"(0, 1], e.g. {{'fp8': 0.71}}, got {hw.precision_efficiency!r}")
    for k, like in (("plain_kernel_overhead", "kernel_overhead"), ("p2p_delay", "comm_delay"),
                    ("p2p_cpu", "comm_cpu")):
        v = getattr(hw, k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
            raise ValueError(f"hardware {hw.name!r}: {k} must be a time >= 0 in seconds or None (the same as "
                             f"{like}), got {v!r}")

