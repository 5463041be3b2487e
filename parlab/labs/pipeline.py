"""Lab: pipeline parallelism. The layers are cut into N stages (`parlab.parallel.pipeline.executor`), the batch
into micro-batches, and a schedule from `parlab.parallel.pipeline` orders each rank's forwards and backwards
(GPipe arXiv:1811.06965, 1F1B arXiv:2006.09503, interleaved arXiv:2104.04473, ZB-H1 arXiv:2401.10241).
Stages only exchange activations and their gradients point to point: PP is the dimension to stretch
across nodes. Open the trace to see the bubble.

    torchrun --nproc_per_node=4 -m parlab.labs.pipeline --layers 8 --schedule interleaved --chunks 2 --microbatches 8
"""
from __future__ import annotations

import torch

from parlab import comm
from parlab.i18n import _
from parlab.parallel.hybrid import make_schedule
from parlab.labs import positive_int, start
from parlab.parallel.pipeline import PipelineParallel
from parlab.parallel.pipeline import SCHEDULES


def add_args(p):
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    p.add_argument("--microbatches", type=positive_int, default=None, help=_("per step (default: 2 x ranks)"))
    p.add_argument("--chunks", type=positive_int, default=1, help=_("model chunks per rank (interleaved schedule)"))


def main(argv=None):
    lab = start("pipeline", __doc__, add_args, argv)
    a, n = lab.args, lab.world_size
    m = a.microbatches or 2 * n
    try:
        schedule = make_schedule(a.schedule, n, m, a.chunks)
        # built on the meta device and handed over (no copy): only this rank's stages are materialised, on
        # the device, with the dense model's values (parlab.parallel.meta_init.materialize); the rest never exists
        pipe = PipelineParallel(lab.model(meta=True), schedule, copy=False, device=lab.device)
    except ValueError as e:
        raise SystemExit(_("error: {error}").format(error=e)) from None
    if a.batch % m:
        raise SystemExit(_("--batch {batch} must be a multiple of --microbatches {microbatches}").format(
            batch=a.batch, microbatches=m))
    opt = torch.optim.AdamW(pipe.parameters(), lr=a.lr)
    last = schedule.placement[-1]
    lab.log(_("schedule {schedule}: {stages} stages, {microbatches} micro-batches; rank 0 holds layers "
              "{layers}").format(schedule=schedule.name, stages=schedule.stages, microbatches=m,
                                 layers=[list(pipe.layers[s]) for s in pipe.my_stages]))

    def step(i):
        opt.zero_grad(set_to_none=True)            # at the start: the last step's grads stay for the report
        with lab.autocast():                       # --dtype bfloat16: bf16 compute, fp32 messages and grads
            loss = pipe.step(*lab.batch(i))        # the mean loss on the rank of the last stage, else None
        opt.step()
        out = loss if loss is not None else torch.zeros((), dtype=lab.dtype, device=lab.device)
        if n > 1:
            comm.broadcast(out, src=last, label="loss (logging)")
        return out

    lab.train(step, pipe.parameters, opt, extra=f"schedule={schedule.name} microbatches={m}")


if __name__ == "__main__":
    main()
