"""Lab: context parallelism. Every sequence is split over the N ranks (zigzag chunks balance the causal
work); attention runs as ring attention (K/V blocks passed around the ring, Liu et al. arXiv:2310.01889)
or Ulysses (all-to-all to head-sharded and back, arXiv:2309.14509), `parlab.parallel.context.ulysses`.
Gradients are averaged over the ranks. Grow --seq-len with N: activations per rank stay constant.

    torchrun --nproc_per_node=8 -m parlab.labs.context_parallel --seq-len 4096 --attention ring
"""
from __future__ import annotations

import torch

from parlab.i18n import _
from parlab.labs import start
from parlab.parallel.context import ContextParallelGPT


def add_args(p):
    p.add_argument("--attention", choices=("ring", "ulysses"), default="ring")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")


def main(argv=None):
    lab = start("context_parallel", __doc__, add_args, argv)
    try:
        cp = ContextParallelGPT(lab.model(), attention=lab.args.attention, layout=lab.args.layout)
        cp.shard(torch.zeros(1, lab.args.seq_len))              # checks that the sequence splits evenly
    except ValueError as e:
        raise SystemExit(_("error: {error}").format(error=e)) from None
    opt = torch.optim.AdamW(cp.parameters(), lr=lab.args.lr)

    def step(i):
        opt.zero_grad(set_to_none=True)            # at the start: the last step's grads stay for the report
        x, y = lab.batch(i)                                       # (B, S)
        with lab.autocast():                                      # --dtype bfloat16: bf16 compute
            loss = cp(cp.shard(x), cp.shard(y))[1]                # this rank's S/N positions
        loss.backward()
        cp.average_gradients()
        opt.step()
        return cp.global_loss(loss)

    lab.train(step, cp.parameters, opt, extra=f"attention={lab.args.attention} layout={lab.args.layout}")


if __name__ == "__main__":
    main()
