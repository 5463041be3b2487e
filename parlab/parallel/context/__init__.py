"""parlab.parallel.context: sequence (context) parallelism. Each rank holds S/P positions of every sequence.

Read in this order:

* ``ring_plan.py``  the plan, without communication: the sequence's layout over the ranks (contiguous or
                     zigzag), which K/V block each rank computes at each ring step, what a ring costs (bytes,
                     memory, the block length above which transfers hide behind compute). Pure.
* ``ring.py``       ring attention: K/V blocks passed around the ring, partial results merged with their
                     log-sum-exp (online softmax), causal and load-balanced (Liu et al., arXiv:2310.01889).
* ``ulysses.py``    Ulysses: all-to-all from sequence-sharded to head-sharded and back around attention
                     (Jacobs et al., arXiv:2309.14509); `ContextParallelGPT`, the tiny GPT run sequence-sharded
                     with either attention.

Lesson 06 and exercises 06 and 08.
"""
from parlab.parallel.context.ring import (RingAttention, RingStats, attention_block, merge_partials, ring_attention)
from parlab.parallel.context.ring_plan import (LAYOUTS, BlockPlan, attention_memory_per_rank, block_plan,
                                               check_seq_len, chunk_ids, overlap_threshold, ring_bytes_per_rank,
                                               ring_steps, shard_positions, shard_sequence, unshard_sequence,
                                               work_matrix)
from parlab.parallel.context.ulysses import (ContextParallelGPT, head_to_seq, seq_to_head, ulysses_attention,
                                             ulysses_bytes_per_layer)

__all__ = ["ring_attention", "RingAttention", "RingStats", "merge_partials", "attention_block", "LAYOUTS",
           "chunk_ids", "check_seq_len", "shard_positions", "shard_sequence", "unshard_sequence", "BlockPlan",
           "block_plan", "work_matrix", "ring_steps", "ring_bytes_per_rank", "attention_memory_per_rank",
           "overlap_threshold", "seq_to_head", "head_to_seq", "ulysses_attention", "ulysses_bytes_per_layer",
           "ContextParallelGPT"]
