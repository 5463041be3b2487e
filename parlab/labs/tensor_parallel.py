"""Lab: tensor parallelism (Megatron-LM, arXiv:1909.08053). Every rank holds 1/N of each weight matrix
(`parlab.parallel.tensor.layers.parallelize_gpt`) and sees the whole batch; per layer 2 all-reduces forward and
2 backward. --sp adds Megatron sequence parallelism (arXiv:2205.05198): all-gather / reduce-scatter along
the sequence instead, layer norms on S/N tokens. Keep N within one node (NVLink).

    torchrun --nproc_per_node=8 -m parlab.labs.tensor_parallel --heads 8 --hidden 512 --sp
"""
from __future__ import annotations

import torch

from parlab.i18n import _
from parlab.labs import start
from parlab.parallel.meta_init import materialize
from parlab.parallel.tensor import parallelize_gpt, sync_sequence_parallel_grads


def add_args(p):
    p.add_argument("--sp", action="store_true", help=_("sequence parallelism"))


def main(argv=None):
    lab = start("tensor_parallel", __doc__, add_args, argv)
    try:
        # sharded on the meta device, then only this rank's 1/N of each weight is materialised on the device
        # (each dense weight drawn on the CPU one at a time for its slice: the dense model never exists)
        model = materialize(parallelize_gpt(lab.model(meta=True), sequence_parallel=lab.args.sp), lab.device)
    except ValueError as e:
        raise SystemExit(_("error: {error}").format(error=e)) from None
    opt = torch.optim.AdamW(model.parameters(), lr=lab.args.lr)

    def step(i):
        opt.zero_grad(set_to_none=True)            # at the start: the last step's grads stay for the report
        x, y = lab.batch(i)                        # (B, S), the same on every rank
        with lab.autocast():                       # --dtype bfloat16: bf16 compute
            loss = model(x, y)[1]                  # vocab-parallel loss, equal on every rank
        loss.backward()
        if lab.args.sp:
            sync_sequence_parallel_grads(model)    # params used on S/N tokens: sum their partial grads
        opt.step()
        return loss.detach()

    lab.train(step, model.parameters, opt, extra=f"sp={lab.args.sp}")


if __name__ == "__main__":
    main()
