"""parlab.parallel.zero: ZeRO and FSDP. Data parallelism that shards the training state instead of copying it.

Read in this order:

* ``memory.py``           the ZeRO formulas (2psi + 2psi + K psi bytes per rank, divided stage by stage; the
                           communication per step) and the same bytes measured from tensors (Rajbhandari et al.,
                           arXiv:1910.02054, section 3).
* ``optimizer.py``        `ShardedOptimizer`, ZeRO-1 and ZeRO-2: each rank keeps and updates the optimizer state
                           (and the gradients) of its shard; ``optimizer_state.py`` its state dicts and sharded
                           checkpoints.
* ``flat.py``             the owner-major flat buffers it shards (pure), and ``bucket_sync.py`` their
                           communication: gradients reduce-scattered bucket by bucket during backward, parameters
                           all-gathered after the step.
* ``fsdp.py``             `FullyShardedDataParallel`, ZeRO-3: each unit's parameters gathered just before use and
                           freed after, gradients reduce-scattered; ``fsdp_state.py`` its full parameters and
                           sharded checkpoints.
* ``checkpoint.py``       sharded checkpoints (atomic files, a manifest, checksums) for both.
* ``mixed_precision.py``  dynamic loss scaling for float16, agreed over a group.

Lesson 03 (and 08's resumed training); exercises 03 and 09.
"""
from parlab.parallel.zero.checkpoint import CheckpointError
from parlab.parallel.zero.fsdp import FullyShardedDataParallel
from parlab.parallel.zero.memory import (STAGES, comm_elements, gathered_timeline, max_params, measure, min_dp_size,
                                         model_state_bytes)
from parlab.parallel.zero.mixed_precision import LossScaler
from parlab.parallel.zero.optimizer import ShardedOptimizer, iter_owned, partition_parameters

__all__ = ["ShardedOptimizer", "FullyShardedDataParallel", "LossScaler", "CheckpointError", "partition_parameters",
           "iter_owned", "STAGES", "model_state_bytes", "comm_elements", "max_params",
           "measure", "gathered_timeline", "min_dp_size"]
