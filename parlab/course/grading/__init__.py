"""Checks for the exercises: run the student's code, compare with parlab's reference, explain what is wrong.

Every graded cell of an exercise notebook calls one ``check_*`` function. A
check passes silently (it prints one line saying what passed) or raises
``AssertionError`` with a diagnostic a student can act on: which rank, which
chunk or group, expected vs got, and a hint. nbval turns each graded cell into
one pytest item, so a lecturer gets one pass/fail line per check (see
exercises/README.md).

Code that communicates runs on simulated ranks through ``parlab.run`` on gloo,
under `watchdog` (a deadlock is recognised from the ranks' state within about
3 s; a correct solution on a busy machine is never stopped) and a CPU-time
limit (a runaway loop fails its check). Every check is wrapped by
`guard.graded`: parlab's own implementation of the piece under test is
unavailable to the student's code while it runs, rebinding grading or parlab
internals is reported as tampered, inputs are drawn fresh (`guard.fresh_seed`)
and a failure shows its message only. Inputs are integers stored as float64, so
sums are exact in any order and a wrong result can be explained exactly
("chunk 2 holds the sum of ranks [1, 2] only").

The chapter, one module per exercise, named after the technique it checks:

    collectives        exercise 00, ring reduce-scatter / all-gather / all-reduce from send/recv (Patarasuk & Yuan)
    groups             exercise 01, the process groups of a tp x dp x pp grid (Megatron-LM parallel_state)
    data_parallel      exercise 02, DDP's gradient hooks and buckets
    zero               exercise 03, the ZeRO-1 step and the ZeRO memory formulas
    tensor_parallel    exercise 04, column/row-parallel linear layers, the vocab-parallel cross-entropy
    pipeline           exercise 05, the 1F1B order and the pipeline bubble
    context_parallel   exercise 06, ring attention: the online-softmax merge, one ring step, zigzag
    hybrid             exercise 07, the 4D layout and a layout for a model
    ulysses            exercise 08, Ulysses all-to-all attention
    fsdp               exercise 09, one ZeRO-3 / FSDP unit
    expert             exercise 10, the router's balance and capacity, the expert-parallel dispatch

and what they share: `runner` (`run_student`, `call_student`, `TIMEOUT`: run the student's code, explain how it
failed), `guard` (the `graded` decorator: tamper detection, fresh seeds, CPU limit), `unavailable` and `codeid`
(parlab's answer refused to the student's code), `watchdog` (deadlocks), `reports` (what locked demonstration cells
print). Exercises 00 and 01 import this package as ``grading`` (``from parlab.course import grading``), so its
checks are here by name; later notebooks import their module as ``grading``, and every graded cell reads
``grading.check_...(...)``.

Importing this package also snapshots what a check relies on (`guard.protect`): every grading module, the parlab
modules below, and the torch functions a comparison goes through.
"""
from __future__ import annotations

from parlab.course.grading import guard
from parlab.course.grading.runner import TIMEOUT, call_student, run_student
from parlab.course.grading.collectives import (check_ring_all_gather, check_ring_all_reduce,
                                               check_ring_all_reduce_traffic, check_ring_reduce_scatter, rank_input)
from parlab.course.grading.groups import GROUP_LAYOUTS, check_dp_all_reduce, check_groups

__all__ = ["run_student", "call_student", "TIMEOUT", "check_ring_reduce_scatter", "check_ring_all_gather",
           "check_ring_all_reduce", "check_ring_all_reduce_traffic", "rank_input", "check_groups",
           "check_dp_all_reduce", "GROUP_LAYOUTS"]

guard.protect(__name__)
# the faces students call, and the modules behind them (whose private helpers the public names call)
for _mod in ("parlab.launch", "parlab.launch.ranks", "parlab.launch.blame", "parlab.launch.child", "parlab.comm",
             "parlab.comm.traced", "parlab.comm.direct", "parlab.trace", "parlab.trace.events", "parlab.trace.wire",
             "parlab.models",
             "parlab.parallel.pipeline", "parlab.parallel.pipeline.schedules", "parlab.parallel.pipeline.simulation",
             "parlab.parallel.context.ring", "parlab.parallel.context.ring_plan", "parlab.parallel.topology",
             "parlab.parallel.zero.memory", "parlab.cluster.planner", "parlab.parallel.data.buckets"):
    guard.protect(_mod)
# what the checks compare with: torch's functions and the Tensor methods a comparison goes through
guard.protect("torch", ["equal", "allclose", "isclose", "softmax", "logsumexp", "logaddexp", "exp", "cat", "stack",
                        "zeros", "randn", "randint", "count_nonzero", "sort", "as_tensor", "isfinite", "maximum",
                        "Tensor.__eq__", "Tensor.__ne__", "Tensor.__sub__", "Tensor.__gt__", "Tensor.__lt__",
                        "Tensor.__le__", "Tensor.__ge__", "Tensor.__bool__", "Tensor.__mul__", "Tensor.__matmul__",
                        "Tensor.abs", "Tensor.max", "Tensor.min", "Tensor.sum", "Tensor.item", "Tensor.tolist",
                        "Tensor.equal", "Tensor.allclose", "Tensor.all", "Tensor.any", "Tensor.clone",
                        "Tensor.detach", "Tensor.reshape", "Tensor.to", "Tensor.double", "Tensor.float",
                        "Tensor.backward", "Tensor.chunk", "Tensor.numel", "Tensor.argmax"])
guard.protect("torch.nn.functional", ["linear", "cross_entropy", "pad", "gelu", "scaled_dot_product_attention"])
guard.protect("math", ["isclose"])
guard.install_ipython_hooks()
