"""Lab: ZeRO. Data parallelism whose training state is sharded over the ranks [Rajbhandari et al.,
arXiv:1910.02054]: stage 1 the optimizer state, stage 2 also the gradients
(`parlab.parallel.zero.optimizer.ShardedOptimizer`: reduce-scatter, step the owned shard, all-gather), stage 3 also the
parameters (`parlab.parallel.zero.fsdp.FullyShardedDataParallel`: all-gather each block's weights when it runs).
Compare the per-rank memory of --stage 1, 2 and 3 at the same world size.

    torchrun --nproc_per_node=8 -m parlab.labs.zero --stage 2 --layers 8 --hidden 512
"""
from __future__ import annotations

import torch

from parlab import comm
from parlab.i18n import _
from parlab.parallel.data import global_mean_loss
from parlab.parallel.zero import FullyShardedDataParallel
from parlab.labs import start
from parlab.parallel.zero import ShardedOptimizer


def add_args(p):
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=1, help=_("ZeRO stage"))


def main(argv=None):
    lab = start("zero", __doc__, add_args, argv)
    if lab.args.batch % lab.world_size:
        raise SystemExit(_("--batch {batch} must be a multiple of the {ranks} ranks").format(
            batch=lab.args.batch, ranks=lab.world_size))
    stage = lab.args.stage
    if stage == 3:
        # built on the meta device: only this rank's flat shards are drawn, on the device (dense values)
        model = FullyShardedDataParallel(lab.model(meta=True), device=lab.device)
        opt = torch.optim.AdamW(model.parameters(), lr=lab.args.lr)   # steps only this rank's shards
    else:
        model = lab.model()
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=lab.args.lr)

    def step(i):
        opt.zero_grad(set_to_none=True)            # at the start: the last step's grads stay for the report
        x, y = lab.sampler.shard(i, lab.rank, lab.world_size)        # (B/N, S)
        with lab.autocast():                                           # --dtype bfloat16: bf16 compute
            logits = model(x.to(lab.device))[0]                        # (B/N, S, V)
        loss = global_mean_loss(logits, y.to(lab.device))          # exact global mean even with padding
        loss.backward()                                                # stage 3: reduce-scatter per block
        opt.step()                                                     # stages 1/2: reduce-scatter, all-gather
        loss = loss.detach()
        comm.all_reduce(loss, op=comm.ReduceOp.AVG, label="loss (logging)")
        return loss

    lab.train(step, model.parameters, opt, extra=f"stage={stage}")


if __name__ == "__main__":
    main()
