"""``parlab plan``: the layout planner on the command line (`parlab.cluster.planner`), its answers as text
(`parlab.cluster.plan_report`). Bad flags are refused with what is wrong; a model that fits nowhere says by how much.
"""
from __future__ import annotations

import argparse

from parlab.cluster import transformer as T
from parlab.cluster.costs import PRESETS, Cluster, ModelSpec, preset
from parlab.cluster.plan_report import explain, format_table
from parlab.cluster.planner import cluster_for, enumerate_layouts, plan

__all__ = ["main", "MAX_GPUS"]

MAX_GPUS = 16384   # `parlab plan` answers in seconds up to here (1024 nodes x 8: ~6 s at load 27 on 2 cores)


def main(argv=None) -> int:
    """``parlab plan``: print the ranked layouts of a model on a cluster."""
    p = argparse.ArgumentParser(prog="parlab plan", description="rank training layouts by estimated step time")
    p.add_argument("--model", default="gpt3-175b", choices=[*PRESETS, "custom"])
    for k in ("layers", "hidden", "heads", "vocab", "seq"):
        p.add_argument(f"--{k}", type=int, help=f"custom model {k} (overrides the preset)")
    c = Cluster()
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=c.gpus_per_node)
    p.add_argument("--gpu-mem-gb", type=float, default=c.gpu_mem_gb)
    p.add_argument("--intra-gbps", type=float, default=c.intra_gbps, help="GB/s per GPU inside a node")
    p.add_argument("--inter-gbps", type=float, default=c.inter_gbps, help="GB/s per GPU between nodes")
    p.add_argument("--tflops", type=float, default=c.peak_tflops, help="peak dense 16-bit TFLOP/s per GPU")
    p.add_argument("--mfu", type=float, default=c.mfu, help="fraction of peak the matmuls reach")
    p.add_argument("--hardware", default=None, metavar="PRESET_OR_JSON",
                   help="time the layouts with the replay's cost model on this hardware (dgx-a100, dgx-h100, or a "
                        "JSON from parlab calibrate): GEMMs by shape, exposed TP communication, the slowest "
                        "pipeline rank; its GPUs per node, bandwidths and peak replace the flags above")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 2 x GPUs)")
    p.add_argument("--recompute", nargs="+", choices=T.RECOMPUTE, default=list(T.RECOMPUTE),
                   help="activation recomputation settings to try (rc column: n, s, y)")
    p.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    p.add_argument("--virtual", nargs="+", type=int, default=[1], metavar="V",
                   help="interleaving chunks per pipeline rank to try, e.g. 1 2 4 (default 1: plain 1F1B)")
    p.add_argument("--top", type=int, default=10)
    a = p.parse_args(argv)
    for k in ("layers", "hidden", "heads", "vocab", "seq", "global_batch", "top", "nodes", "gpus_per_node"):
        if getattr(a, k) is not None and getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be a positive integer, got {getattr(a, k)}")
    if a.nodes * a.gpus_per_node > MAX_GPUS:   # every layout is enumerated: a huge cluster would take minutes
        p.error(f"at most {MAX_GPUS} GPUs (--nodes x --gpus-per-node), got {a.nodes * a.gpus_per_node}")
    try:
        custom = {k: getattr(a, k) for k in ("layers", "hidden", "heads", "vocab", "seq") if getattr(a, k) is not None}
        if a.model == "custom":
            missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in custom]
            if missing:
                p.error(f"--model custom needs --{' --'.join(missing)}")
            model = ModelSpec("custom", **custom)
        else:
            base = preset(a.model)
            model = ModelSpec(**{**base.__dict__, **custom}) if custom else base
        hw = None
        if a.hardware is not None:
            from parlab.cluster.hardware import load
            hw = load(a.hardware)
            cluster = cluster_for(hw, a.nodes * hw.gpus_per_node, a.gpu_mem_gb)
        else:
            cluster = Cluster(a.nodes, a.gpus_per_node, a.gpu_mem_gb, a.intra_gbps, a.inter_gbps, a.tflops, a.mfu)
        batch = a.global_batch or 2 * cluster.world
        if any(v < 1 for v in a.virtual):
            p.error(f"--virtual takes positive chunk counts, got {a.virtual}")
        options = dict(recompute=tuple(dict.fromkeys(a.recompute)), sequence_parallel=not a.no_sp, hardware=hw,
                       virtual=tuple(dict.fromkeys(a.virtual)))
        every = enumerate_layouts(model, cluster, batch, **options)
        ranked = plan(model, cluster, batch, **options)
    except ValueError as err:
        print(f"error: {err}")
        return 2
    print(f"{model.name}: {model.param_count() / 1e9:.2f}B parameters, {model.layers} layers, h={model.hidden}, "
          f"{model.heads} heads, seq {model.seq}; {cluster.nodes} x {cluster.gpus_per_node} GPUs "
          f"({cluster.gpu_mem_gb:g} GB, {cluster.peak_tflops:g} TFLOP/s, "
          + (f"timed on {hw.name} by the replay's cost model" if hw else f"MFU {cluster.mfu:g}")
          + f"); global batch {batch}")
    print(f"{len(every)} valid layouts, {len(ranked)} fit.\n")
    print(format_table(ranked, a.top))
    print()
    print(explain(ranked, every))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
