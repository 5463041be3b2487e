"""Lab: data parallelism. Every rank holds the whole model and trains on its rows of the global batch;
`parlab.parallel.data.ddp.DistributedDataParallel` averages the gradients with bucketed all-reduces launched
during backward (Li et al., "PyTorch Distributed", VLDB 2020).

    torchrun --nproc_per_node=8 -m parlab.labs.data_parallel --batch 64 --bucket-mb 1
"""
from __future__ import annotations

import torch

from parlab import comm
from parlab.i18n import _
from parlab.parallel.data import DistributedDataParallel
from parlab.parallel.data import global_mean_loss
from parlab.labs import positive_float, start


def add_args(p):
    p.add_argument("--bucket-mb", type=positive_float, default=25.0, help=_("gradient bucket size in MiB"))


def main(argv=None):
    lab = start("data_parallel", __doc__, add_args, argv)
    if lab.args.batch % lab.world_size:
        raise SystemExit(_("--batch {batch} must be a multiple of the {ranks} ranks").format(
            batch=lab.args.batch, ranks=lab.world_size))
    model = DistributedDataParallel(lab.model(), bucket_cap_mb=lab.args.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=lab.args.lr)
    lab.log(_("{buckets} gradient bucket(s); {rows} rows per rank").format(
        buckets=len(model.buckets), rows=lab.args.batch // lab.world_size))

    def step(i):
        opt.zero_grad(set_to_none=True)            # at the start: the last step's grads stay for the report
        x, y = lab.sampler.shard(i, lab.rank, lab.world_size)        # (B/N, S): this rank's rows
        with lab.autocast():                                           # --dtype bfloat16: bf16 compute
            logits = model(x.to(lab.device))[0]                        # (B/N, S, V)
        loss = global_mean_loss(logits, y.to(lab.device))          # exact global mean even with padding
        loss.backward()                                                # buckets all-reduced during backward
        opt.step()
        loss = loss.detach()
        comm.all_reduce(loss, op=comm.ReduceOp.AVG, label="loss (logging)")  # the global batch's mean loss
        return loss

    lab.train(step, model.parameters, opt)


if __name__ == "__main__":
    main()
