"""Lab: 4D hybrid parallelism, 5D with experts. The N = tp x cp x dp x pp ranks form a grid
(`parlab.parallel.topology`, order tp-cp-dp-pp: tp neighbours share a node, pp crosses nodes);
`parlab.parallel.hybrid.build_hybrid` shards the layers over tp, cuts stages over pp, splits sequences over cp and
averages gradients (or ZeRO) over dp-cp. With --experts E --ep k the MLPs become mixtures of E experts spread
over k ranks of the same grid (expert grid etp-ep-edp-pp: the experts whole, --etp 1, or each split over the tp
ranks, --etp equal to --tp; with --tp, --sp is required, as in Megatron-Core). The report shows the bytes each
dimension moved: TP > DP > PP in volume.

    torchrun --nproc_per_node=8 -m parlab.labs.hybrid --tp 2 --pp 2 --layers 4 --batch 32
    torchrun --nproc_per_node=8 -m parlab.labs.hybrid --pp 2 --ep 2 --experts 4 --zero 1
    torchrun --nproc_per_node=8 -m parlab.labs.hybrid --tp 2 --sp --pp 2 --ep 2 --experts 4 --etp 2
    torchrun --nnodes=2 --nproc_per_node=8 ... -m parlab.labs.hybrid --tp 2 --pp 4 --gpus-per-node 8
"""
from __future__ import annotations

import dataclasses

from parlab.i18n import _
from parlab.parallel.groups import build_groups
from parlab.parallel.hybrid import build_hybrid, check_layout, make_schedule, traffic_by_dim
from parlab.labs import positive_int, start
from parlab.launch import local_world_size
from parlab.parallel.pipeline import SCHEDULES
from parlab.parallel.topology import ParallelGrid


def add_args(p):
    g = p.add_argument_group(_("layout (dp = world / (tp * pp * cp))"))
    g.add_argument("--tp", type=positive_int, default=1)
    g.add_argument("--pp", type=positive_int, default=1)
    g.add_argument("--cp", type=positive_int, default=1)
    g.add_argument("--zero", type=int, choices=(0, 1, 2), default=0, help=_("ZeRO stage over the dp-cp group"))
    g.add_argument("--sp", action="store_true", help=_("Megatron sequence parallelism (seq-len divisible by cp x tp)"))
    g.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    g.add_argument("--microbatches", type=positive_int, default=None, help=_("per step (default: 2 x pp)"))
    g.add_argument("--chunks", type=positive_int, default=1, help=_("model chunks per rank (interleaved schedule)"))
    g.add_argument("--cp-attention", choices=("ring", "ulysses"), default="ring")
    g.add_argument("--cp-layout", choices=("zigzag", "contiguous"), default="zigzag")
    g.add_argument("--ep", type=positive_int, default=1, help=_("expert parallel ranks (needs --experts)"))
    g.add_argument("--experts", type=int, default=0, help=_("experts per MoE layer, a multiple of --ep (default: 0, "
                                                            "a dense model)"))
    g.add_argument("--top-k", type=positive_int, default=2, help=_("experts each token is sent to"))
    g.add_argument("--etp", type=positive_int, default=1,
                   help=_("expert tensor parallelism: 1 (default: each expert whole on its rank) or --tp (each "
                          "expert's MLP split over the tp ranks)"))
    g.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help=_("for the layout printout (default: torchrun's LOCAL_WORLD_SIZE or srun's tasks per node)"))


def check_experts(a) -> str | None:
    """What is wrong with --experts and --ep together, if anything."""
    if a.experts < 0:
        return _("--experts must be 0 (a dense model) or a positive number of experts, got {experts}").format(
            experts=a.experts)
    if a.ep > 1 and a.experts == 0:
        return _("--ep {ep} spreads the experts of MoE layers over {ep} ranks: give --experts E, a "
                 "multiple of {ep}").format(ep=a.ep)
    if a.etp > 1 and a.experts == 0:
        return _("--etp {etp} splits each expert's MLP over the tp ranks: it needs MoE layers, give --experts E "
                 "and --ep").format(etp=a.etp)
    if a.etp > 1 and a.ep == 1:
        return _("--etp {etp} splits the experts over the tp ranks beside expert parallelism, which parlab "
                 "composes with --ep 2 or more; with --ep 1 every rank holds each expert whole: leave --etp at "
                 "1").format(etp=a.etp)
    if a.etp not in (1, a.tp):
        return _("--etp {etp} must be 1 (experts whole) or equal to --tp {tp} (experts split over the tp "
                 "ranks)").format(etp=a.etp, tp=a.tp)
    if a.experts and a.experts % a.ep:
        return _("--experts {experts} must be a multiple of --ep {ep} (each expert-parallel rank holds "
                 "experts / ep of them)").format(experts=a.experts, ep=a.ep)
    return None


def main(argv=None):
    lab = start("hybrid", __doc__, add_args, argv, check=check_experts)
    a = lab.args
    m = a.microbatches or 2 * a.pp
    try:
        if a.experts:
            lab.config = dataclasses.replace(lab.config, experts=a.experts, top_k=a.top_k)
        gpn = a.gpus_per_node or local_world_size(default=lab.world_size)      # torchrun's, or srun's
        grid = ParallelGrid(lab.world_size, tp=a.tp, pp=a.pp, cp=a.cp, ep=a.ep, etp=a.etp if a.experts else None,
                            gpus_per_node=gpn)                          # experts whole on their ep ranks
        schedule = make_schedule(a.schedule, a.pp, m, a.chunks)
        check_layout(lab.config, grid, schedule, batch_size=a.batch, seq_len=a.seq_len, sequence_parallel=a.sp,
                     cp_attention=a.cp_attention, cp_layout=a.cp_layout, zero_stage=a.zero)
    except ValueError as e:
        raise SystemExit(_("error: {error}").format(error=e)) from None
    lab.log(grid.describe())
    if a.ep > 1:
        lab.log(grid.expert.describe())
    groups = build_groups(grid)
    # built on the meta device and handed over: only this rank's stage, TP-sharded, is materialised, on the
    # device, with the dense model's values; the rest never exists in this process
    model = build_hybrid(lab.model(meta=True), groups, schedule=schedule, sequence_parallel=a.sp,
                         cp_attention=a.cp_attention, cp_layout=a.cp_layout, zero_stage=a.zero, lr=a.lr,
                         copy=False, device=lab.device)

    def step(i):
        with lab.autocast():                      # --dtype bfloat16: bf16 compute, fp32 master weights
            return model.train_step(*lab.batch(i))  # global batch in, global mean loss out (every rank)

    def traffic(trace):
        lab.log(_("bytes sent per dimension (all ranks, all steps):"))
        for dim, row in sorted(traffic_by_dim(trace, grid).items(), key=lambda kv: -kv[1]["bytes"]):
            lab.log("  " + _("{dim:>6}: {messages:>7} messages {mb:10.2f} MB").format(
                dim=dim, messages=row["messages"], mb=row["bytes"] / 1e6))

    lab.train(step, model.parameters, model.optimizer, trace_report=traffic,
              extra=f"dp={grid.dp} tp={grid.tp} pp={grid.pp} cp={grid.cp} ep={grid.ep} zero={a.zero}")


if __name__ == "__main__":
    main()
