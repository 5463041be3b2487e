"""parlab.models: the one-process reference models every technique shards and is checked against.

* ``gpt.py``  the tiny GPT-2 style decoder (``GPT``, ``GPTConfig``): embeddings, pre-norm blocks of causal
              self-attention and an MLP, the head and its mean cross-entropy.
* ``moe.py``  the mixture-of-experts MLP (``MoE``): the top-k router with its load-balancing and z-losses and
              capacity, the tokens sorted by expert, the stacked expert MLPs; ``GPTConfig(experts=E)`` puts it
              in the GPT (the one-process reference of ``parlab.parallel.expert``).
"""
from parlab.models.gpt import (GPT, MLP, Block, CausalSelfAttention, GPTConfig, _initial_value, _param_seed,
                               causal_attention, clone_model, count_targets, moe_mlp, weighted_mean_loss)
from parlab.models.moe import (MoE, ExpertMLPs, Routing, aux_losses, capacity, load_balancing_loss, moe_layers,
                               route, sort_by_expert, unsort, z_loss)

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "moe_mlp", "causal_attention", "clone_model",
           "count_targets", "weighted_mean_loss", "MoE", "ExpertMLPs", "Routing", "route", "capacity",
           "load_balancing_loss", "z_loss", "sort_by_expert", "unsort", "moe_layers", "aux_losses"]
