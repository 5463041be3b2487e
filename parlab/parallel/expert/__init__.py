"""parlab.parallel.expert: expert parallelism (EP), the fifth dimension. A mixture-of-experts layer's E experts
are spread over the ranks of an EP group, E/ep each; tokens travel to their experts and back by all-to-all.

Read in this order:

* ``parlab/models/moe.py``  (the one-process layer it shards) the top-k router, load-balancing and z-losses,
                            capacity and dropping, tokens sorted by expert, the stacked expert MLPs.
* ``comm.py``      the communication: per-expert counts exchanged first, then the tokens by an all-to-all with
                   uneven split sizes, re-sorted by local expert; combine sends them back (the reverse all-to-all).
* ``layers.py``    `ExpertParallelMoE` (the layer with E/ep experts, its experts' step replaced by dispatch, the
                   local experts and combine), `expert_parallel(model)` to swap a model's MoE layers.
* ``grads.py``     expert gradients averaged with the dense weights' net 1/dp (over the expert-data-parallel
                   replicas, / ep) and counted once in the global gradient norm.

Lesson 09 and exercise 10.
"""
from parlab.parallel.expert.comm import DispatchPlan, all_to_all_rows, combine, dispatch, exchange_counts
from parlab.parallel.expert.grads import (average_expert_gradients, average_gradients, clip_grad_norm, grad_norm,
                                         is_expert_param)
from parlab.parallel.expert.layers import ExpertParallelMoE, expert_parallel, local_experts, routed_as_ranks

__all__ = ["exchange_counts", "all_to_all_rows", "dispatch", "combine", "DispatchPlan", "ExpertParallelMoE",
           "expert_parallel", "local_experts", "routed_as_ranks", "average_gradients", "average_expert_gradients", "grad_norm",
           "clip_grad_norm", "is_expert_param"]
