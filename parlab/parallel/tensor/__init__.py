"""parlab.parallel.tensor: Megatron tensor parallelism and sequence parallelism.

Read in this order:

* ``mappings.py``  the communication, as conjugate autograd pairs named for their direction: `copy_to_tp` (f:
                    identity forward, all-reduce backward), `reduce_from_tp` (g: all-reduce forward, identity
                    backward), scatter/gather along the last dimension, and sequence parallelism's all-gather /
                    reduce-scatter along the sequence (Shoeybi et al., arXiv:1909.08053, section 3; Korthikanti
                    et al., arXiv:2205.05198, section 4.2.2).
* ``layers.py``    `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`; the MLP and attention
                    split with one f and one g each; `parallelize_gpt` turns the tiny GPT tensor-parallel.
* ``loss.py``      vocab-parallel cross-entropy: the loss from logits split along the vocabulary, never forming
                    the full logits (an all-reduce of the max, the sum of exponentials and the target logit).
* ``grads.py``     sequence parallelism's partial gradients summed over the group; shards gathered back into
                    the dense layout (to compare with one process).

Lesson 04 and exercise 04.
"""
from parlab.parallel.tensor.grads import dense_grads, dense_state_dict, mark_sequence_parallel, sync_sequence_parallel_grads
from parlab.parallel.tensor.layers import (STYLES, ColumnParallelLinear, Colwise, EnterRegion, RowParallelLinear,
                                           Rowwise, SequenceShard, VocabEmbedding, VocabParallelEmbedding,
                                           check_divisible, gpt_plan, parallelize, parallelize_gpt, plan_matches)
from parlab.parallel.tensor.loss import vocab_parallel_cross_entropy, vocab_parallel_mean_loss
from parlab.parallel.tensor.mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                                             reduce_scatter_to_sp, scatter_to_sp, scatter_to_tp, split_dim)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "Colwise", "Rowwise", "VocabEmbedding", "EnterRegion", "SequenceShard", "STYLES", "gpt_plan",
           "parallelize", "parallelize_gpt", "plan_matches", "check_divisible", "vocab_parallel_mean_loss", "dense_state_dict", "dense_grads",
           "sync_sequence_parallel_grads", "mark_sequence_parallel", "copy_to_tp", "reduce_from_tp", "scatter_to_tp",
           "gather_from_tp", "scatter_to_sp", "gather_from_sp", "reduce_scatter_to_sp", "split_dim"]
