"""Lab: expert parallelism. The tiny GPT's MLPs become mixtures of --experts experts (top --top-k routing, the
load-balancing loss, an optional capacity factor: `parlab.models.moe`); the experts are spread over the N ranks,
E/N each, and every rank trains on its rows of the global batch. Tokens travel to their experts' ranks by an
all-to-all and back (`parlab.parallel.expert`; GShard, arXiv:2006.16668, section 3.2). The dense weights'
gradients are averaged over the ranks; the experts', summed over the ranks by the all-to-all's backward, are
divided by N (`parlab.parallel.expert.grads`).

    torchrun --nproc_per_node=4 -m parlab.labs.expert_parallel --experts 8 --top-k 2 --capacity-factor 1.25
"""
from __future__ import annotations

import dataclasses

import torch

from parlab import comm
from parlab.i18n import _
from parlab.labs import positive_float, positive_int, start
from parlab.models import GPT, moe_layers
from parlab.parallel.data import global_mean_loss
from parlab.parallel.expert import average_gradients, expert_parallel


def add_args(p):
    p.add_argument("--experts", type=positive_int, default=8, help=_("experts per MoE layer (a multiple of the ranks)"))
    p.add_argument("--top-k", type=positive_int, default=2, help=_("experts each token is sent to"))
    p.add_argument("--capacity-factor", type=positive_float, default=None,
                   help=_("each expert takes at most ceil(T k cf / E) tokens (default: none dropped)"))
    p.add_argument("--aux-loss", type=float, default=1e-2, help=_("coefficient of the load-balancing loss"))


def main(argv=None):
    lab = start("expert_parallel", __doc__, add_args, argv)
    a = lab.args
    if a.batch % lab.world_size:
        raise SystemExit(_("--batch {batch} must be a multiple of the {ranks} ranks").format(
            batch=a.batch, ranks=lab.world_size))
    if a.experts % lab.world_size:
        raise SystemExit(_("--experts {experts} must be a multiple of the {ranks} ranks (each holds experts / ranks "
                           "of them)").format(experts=a.experts, ranks=lab.world_size))
    try:
        config = dataclasses.replace(lab.config, experts=a.experts, top_k=a.top_k, capacity_factor=a.capacity_factor,
                                     aux_loss_coeff=a.aux_loss)
        model = expert_parallel(GPT(config, seed=a.seed, dtype=lab.dtype, device=lab.device))
    except ValueError as e:
        raise SystemExit(_("error: {error}").format(error=e)) from None
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    lab.log(_("{experts} experts per layer, {local} on each of the {ranks} ranks; top-{k}; {params:.2f}M parameters "
              "in all").format(experts=a.experts, local=a.experts // lab.world_size, ranks=lab.world_size, k=a.top_k,
                               params=config.param_count() / 1e6))
    dropped = []

    def step(i):
        opt.zero_grad(set_to_none=True)            # at the start: the last step's grads stay for the report
        x, y = lab.sampler.shard(i, lab.rank, lab.world_size)          # (B/N, S): this rank's rows
        with lab.autocast():                                             # --dtype bfloat16: bf16 compute
            logits = model(x.to(lab.device))[0]                          # (B/N, S, V)
        loss = global_mean_loss(logits, y.to(lab.device))            # exact global mean even with padding
        loss.backward()                                                  # the all-to-alls run backwards too
        average_gradients(model)                                         # dense: mean; experts: / N
        opt.step()
        kept = [m.routing.keep for m in moe_layers(model)]
        dropped.append(sum(int((~k).sum()) for k in kept) / max(1, sum(k.numel() for k in kept)))
        loss = loss.detach()
        comm.all_reduce(loss, op=comm.ReduceOp.AVG, label="loss (logging)")  # the global batch's mean loss
        return loss

    # the summary line ends with the share of rank 0's assignments dropped over capacity in the last step
    lab.train(step, model.parameters, opt,
              extra=lambda: f"experts={a.experts} top_k={a.top_k} dropped={dropped[-1] if dropped else 0.0:.3f}")


if __name__ == "__main__":
    main()
