"""``parlab plan``: the layout planner on the command line (`parlab.cluster.planner`), its answers as text
(`parlab.cluster.plan_report`). Bad flags are refused with what is wrong; a model that fits nowhere says by how much.
"""
from __future__ import annotations

from parlab.i18n.args import ArgumentParser
from parlab.cluster import transformer as T
from parlab.cluster.costs import PRESETS, Cluster, ModelSpec, model_preset
from parlab.cluster.plan_report import explain, format_table
from parlab.cluster.planner import cluster_for, enumerate_layouts, plan
from parlab.i18n import _

__all__ = ["main", "MAX_GPUS"]

MAX_GPUS = 16384   # `parlab plan` answers in seconds up to here (1024 nodes x 8: ~6 s at load 27 on 2 cores)


def main(argv=None) -> int:
    """``parlab plan``: print the ranked layouts of a model on a cluster."""
    p = ArgumentParser(prog="parlab plan", description=_("rank training layouts by estimated step time"))
    p.add_argument("--model", default="gpt3-175b", choices=[*PRESETS, "custom"],
                   help=_("a published model, or custom with --layers --hidden --heads --vocab --seq (default "
                          "gpt3-175b)"))
    for k in ("layers", "hidden", "heads", "vocab", "seq"):
        p.add_argument(f"--{k}", type=int, help=_("custom model {name} (overrides the preset)").format(name=k))
    c = Cluster()
    p.add_argument("--nodes", type=int, default=1, help=_("nodes of the cluster (default 1)"))
    p.add_argument("--gpus-per-node", type=int, default=c.gpus_per_node,
                   help=_("GPUs per node (default {default})").format(default=c.gpus_per_node))
    p.add_argument("--gpu-mem-gb", type=float, default=c.gpu_mem_gb,
                   help=_("GB of memory per GPU a layout may use (default {default:g})").format(default=c.gpu_mem_gb))
    p.add_argument("--intra-gbps", type=float, default=c.intra_gbps, help=_("GB/s per GPU inside a node"))
    p.add_argument("--inter-gbps", type=float, default=c.inter_gbps, help=_("GB/s per GPU between nodes"))
    p.add_argument("--tflops", type=float, default=c.peak_tflops, help=_("peak dense 16-bit TFLOP/s per GPU"))
    p.add_argument("--mfu", type=float, default=c.mfu, help=_("fraction of peak the matmuls reach"))
    p.add_argument("--hardware", default=None, metavar="PRESET_OR_JSON",
                   help=_("time the layouts with the replay's cost model on this hardware (dgx-a100, dgx-h100, or a "
                          "JSON from parlab calibrate): GEMMs by shape, exposed TP communication, the slowest "
                          "pipeline rank; its GPUs per node, bandwidths and peak replace the flags above"))
    p.add_argument("--precision", default="bf16", metavar="FORMAT",
                   help=_("number format of the products: bf16 (default), or fp8 where the hardware lists its rate "
                          "(dgx-h100); needs --hardware"))
    p.add_argument("--attention", choices=T.ATTENTION, default="fused",
                   help=_("attention kernel: fused (default: FlashAttention, Dao et al. 2022, arXiv:2205.14135, the "
                          "kernel of Megatron-Core and PyTorch's scaled_dot_product_attention since then: no scores "
                          "stored, the backward recomputes them) or materialised (the scores written to memory, as "
                          "the Megatron runs of 2021-2022 did)"))
    p.add_argument("--global-batch", type=int, default=None, help=_("sequences per step (default 2 x GPUs)"))
    p.add_argument("--recompute", nargs="+", choices=T.RECOMPUTE, default=None,
                   help=_("activation recomputation settings to try (rc column: n, s, y)"))
    p.add_argument("--no-sp", action="store_true", help=_("tensor parallelism without sequence parallelism"))
    p.add_argument("--virtual", nargs="+", type=int, default=[1], metavar="V",
                   help=_("interleaving chunks per pipeline rank to try, e.g. 1 2 4 (default 1: plain 1F1B)"))
    p.add_argument("--ep", nargs="+", type=int, default=[1], metavar="EP",
                   help=_("expert-parallel sizes to try for a mixture of experts (e.g. --model mixtral-8x7b --ep 1 2 "
                          "4 8; default 1): each must divide the experts, and layouts where it does not fold onto "
                          "tp x cp x dp are skipped"))
    p.add_argument("--top", type=int, default=10, help=_("layouts to list, fastest first (default 10)"))
    a = p.parse_args(argv)
    for k in ("layers", "hidden", "heads", "vocab", "seq", "global_batch", "top", "nodes", "gpus_per_node"):
        if getattr(a, k) is not None and getattr(a, k) < 1:
            p.error(_("--{option} must be a positive integer, got {value}").format(option=k.replace("_", "-"),
                                                                                    value=getattr(a, k)))
    if a.nodes * a.gpus_per_node > MAX_GPUS:   # every layout is enumerated: a huge cluster would take minutes
        p.error(_("at most {most} GPUs (--nodes x --gpus-per-node), got {gpus}").format(
            most=MAX_GPUS, gpus=a.nodes * a.gpus_per_node))
    if a.precision != "bf16" and a.hardware is None:
        p.error(_("--precision {precision} is timed by the replay's cost model: give --hardware too (e.g. "
                  "--hardware dgx-h100)").format(precision=a.precision))
    try:
        custom = {k: getattr(a, k) for k in ("layers", "hidden", "heads", "vocab", "seq") if getattr(a, k) is not None}
        if a.model == "custom":
            missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in custom]
            if missing:
                p.error(_("--model custom needs {options}").format(options="--" + " --".join(missing)))
            model = ModelSpec("custom", **custom)
        else:
            base = model_preset(a.model)
            model = ModelSpec(**{**base.__dict__, **custom}) if custom else base
        hw = None
        if a.hardware is not None:
            from parlab.cluster.hardware import load
            hw = load(a.hardware)
            # the header's peak is the rate of the products' number format (hw.at refuses one it lacks)
            cluster = cluster_for(hw.at(a.precision) if a.precision != "bf16" else hw, a.nodes * hw.gpus_per_node,
                                  a.gpu_mem_gb)
        else:
            cluster = Cluster(a.nodes, a.gpus_per_node, a.gpu_mem_gb, a.intra_gbps, a.inter_gbps, a.tflops, a.mfu)
        _check_ep(p, model, a.ep)
        batch = a.global_batch or 2 * cluster.world
        if any(v < 1 for v in a.virtual):
            p.error(_("--virtual takes positive chunk counts, got {virtual}").format(virtual=a.virtual))
        options = dict(recompute=tuple(dict.fromkeys(a.recompute or T.RECOMPUTE)), sequence_parallel=not a.no_sp,
                       hardware=hw,
                       virtual=tuple(dict.fromkeys(a.virtual)), precision=a.precision, attention=a.attention,
                       ep=tuple(dict.fromkeys(a.ep)))
        every = enumerate_layouts(model, cluster, batch, **options)
        ranked = plan(model, cluster, batch, every=every)
    except ValueError as err:
        print(_("error: {error}").format(error=err))
        return 2
    name = hw and (hw.name if a.precision == "bf16" else f"{hw.name}, {a.precision}")
    timing = (_("timed on {hardware} by the replay's cost model").format(hardware=name) if hw
              else f"MFU {cluster.mfu:g}")
    print(_("{model}: {params:.2f}B parameters, {layers} layers, h={hidden}, {heads} heads, seq {seq}; {nodes} x "
            "{gpus_per_node} GPUs ({gpu_mem:g} GB, {tflops:g} TFLOP/s, {timing}); global batch {batch}").format(
        model=model.name, params=model.param_count() / 1e9, layers=model.layers, hidden=model.hidden,
        heads=model.heads, seq=model.seq, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node,
        gpu_mem=cluster.gpu_mem_gb, tflops=cluster.peak_tflops, timing=timing, batch=batch))
    if model.experts:
        print(_("mixture of experts: {experts} experts per MoE layer, top-{top_k}, {active:.2f}B parameters active per "
                "token; expert parallelism tried: {ep}").format(experts=model.experts, top_k=model.top_k,
                                                                active=model.active_params() / 1e9,
                                                                ep=" ".join(map(str, dict.fromkeys(a.ep)))))
    print(_("attention kernel: {kernel}").format(kernel=_("fused (FlashAttention)") if a.attention == "fused" else
                                                       _("materialised (the scores written to memory)")))
    if a.attention == "fused" and "selective" in (a.recompute or ()):      # asked for it by name
        print(_("selective recomputation redoes the attention scores, which the fused kernel never keeps: it runs as "
                "none (rc n); --attention materialised to try it"))
    print(_("{valid} valid layouts, {fit} fit.").format(valid=len(every), fit=len(ranked)) + "\n")
    print(format_table(ranked, a.top))
    print()
    print(explain(ranked, every))
    return 0


def _check_ep(p, model, eps) -> None:
    """Refuse --ep values the model cannot take (argparse's one-line error): not positive, ep > 1 with a dense
    model, or not dividing the experts."""
    if any(e < 1 for e in eps):
        p.error(_("--ep takes positive expert-parallel sizes, got {ep}").format(ep=" ".join(map(str, eps))))
    if not model.experts and any(e > 1 for e in eps):
        p.error(_("--ep {ep}: {model} is dense (no experts); expert parallelism needs a mixture of experts, e.g. "
                  "--model mixtral-8x7b").format(ep=" ".join(map(str, eps)), model=model.name))
    bad = [e for e in eps if model.experts and model.experts % e]
    if bad:
        p.error(_("--ep {ep} must divide the {experts} experts of {model}; try {divisors}").format(
            ep=" ".join(map(str, bad)), experts=model.experts, model=model.name,
            divisors=" ".join(str(d) for d in range(1, model.experts + 1) if model.experts % d == 0)))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
