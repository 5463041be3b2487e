"""The options every lab shares, and argument types that refuse nonsense at once.

A bad option should stop a lab before it starts ranks, in one line that says what to pass: ``--batch 0`` ->
"argument --batch: must be a positive integer, got 0" (exit status 2, argparse's). Without these checks a zero
batch or a negative learning rate surfaced minutes later, as a traceback from inside torch on rank 0.
"""
from __future__ import annotations

import argparse
import math

import torch

from parlab.i18n.args import ArgumentParser
from parlab.i18n import _

__all__ = ["parser", "positive_int", "positive_float", "DTYPES", "MIXED"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MIXED = {"bfloat16"}    # --dtype values that mean fp32 master weights + autocast compute in that dtype


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            _("must be a positive integer, got {value}").format(value=repr(text))) from None
    if value < 1:
        raise argparse.ArgumentTypeError(_("must be a positive integer, got {value}").format(value=value))
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            _("must be a positive number, got {value}").format(value=repr(text))) from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(_("must be a positive number, got {value}").format(value=text))
    return value


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """The options every lab shares; a lab adds its own with ``add_args(parser)``."""
    p = ArgumentParser(prog=f"torchrun --nproc_per_node=N -m parlab.labs.{name}", description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group(_("model (the tiny GPT of parlab.models; the vocabulary is the shipped alphabet)"))
    m.add_argument("--layers", type=positive_int, default=4, help=_("transformer blocks"))
    m.add_argument("--hidden", type=positive_int, default=64, help="n_embd")
    m.add_argument("--heads", type=positive_int, default=4, help=_("attention heads"))
    m.add_argument("--seq-len", type=positive_int, default=32, help=_("tokens per sequence"))
    m.add_argument("--vocab", type=positive_int, default=64,
                   help=_("vocabulary size (>= 43 characters; padded ids unused)"))
    t = p.add_argument_group(_("training"))
    t.add_argument("--batch", type=positive_int, default=16,
                   help=_("global batch (sequences per step, all ranks together)"))
    t.add_argument("--steps", type=positive_int, default=20)
    t.add_argument("--lr", type=positive_float, default=1e-3, help=_("AdamW learning rate"))
    t.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help=_("float32/float64: parameters, gradients, optimizer state and compute in that dtype; "
                          "bfloat16: mixed precision, fp32 parameters, gradients and AdamW state (master "
                          "weights) with the forward under torch.autocast(bfloat16)"))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    t.add_argument("--timeout", type=positive_float, default=300.0,
                   help=_("seconds a collective waits for the other ranks; then the lab stops and names the "
                          "rank that stopped answering"))
    o = p.add_argument_group(_("output"))
    o.add_argument("--trace", default=f"trace_{name}.json", help=_("merged Chrome trace file written by rank 0"))
    o.add_argument("--no-trace", action="store_true", help=_("record and write no trace"))
    o.add_argument("--quiet", action="store_true", help=_("no progress bar"))
    return p
