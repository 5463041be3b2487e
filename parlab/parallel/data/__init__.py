"""parlab.parallel.data: data parallelism. Every rank holds the whole model and a slice of the batch.

Read in this order:

* ``naive.py``    `NaiveDataParallel`: PyTorch's DataParallel pattern through a main rank (scatter the inputs,
                   broadcast the weights, gather the outputs, reduce the gradients): the main rank's traffic and
                   memory grow with the number of ranks.
* ``ddp.py``      `DistributedDataParallel`: every rank computes its own loss; gradients are averaged by one
                   ring all-reduce per bucket, launched from backward hooks while backward still runs
                   (Li et al., "PyTorch Distributed", VLDB 2020).
* ``buckets.py``  its communication: flat buffers, the parameter broadcast, the greedy gradient buckets.
* ``loss.py``     the exact global mean loss when targets are padded (sum over ranks / count over ranks).
* ``meters.py``   what a rank holds, measured from the tensors (storage counted once) and the activations
                   saved for backward.

Lesson 02 and exercise 02.
"""
from parlab.parallel.data.buckets import GradBucket, assign_buckets, broadcast_tensors, flatten, reduce_tensors, unflatten_into
from parlab.parallel.data.ddp import DistributedDataParallel
from parlab.parallel.data.naive import NAIVE_PHASES, NaiveDataParallel, traffic_by_phase
from parlab.parallel.data.loss import global_mean_loss, global_target_count
from parlab.parallel.data.meters import ActivationMeter, memory_report, tensor_bytes

__all__ = ["NaiveDataParallel", "DistributedDataParallel", "NAIVE_PHASES", "traffic_by_phase", "GradBucket",
           "assign_buckets", "broadcast_tensors", "reduce_tensors", "flatten", "unflatten_into", "global_mean_loss",
           "global_target_count", "ActivationMeter", "memory_report", "tensor_bytes"]
