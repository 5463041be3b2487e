"""Tensor parallelism (Megatron-LM) and Megatron sequence parallelism.

Tensor parallelism splits each weight matrix of a layer across the tp ranks of
a group, so each rank stores and multiplies 1/tp of it [1, section 3].

Y = X A, with nn.Linear's weight W = A^T of shape (out, in):

    column-parallel  A = [A_1 | A_2]          Y_r = X A_r             (rank r holds out/tp rows of W)
    row-parallel     A = [A_1 ; A_2], X = [X_1 | X_2]
                     Y = X_1 A_1 + X_2 A_2    (rank r holds in/tp columns of W; the sum is an all-reduce)

A column-parallel layer followed by a row-parallel one needs no communication
in between: the MLP is  Y = g( GELU( f(X) A_r ) B_r ),  and attention splits
its heads, q/k/v column-parallel and the output projection row-parallel. So a
transformer layer costs 2 all-reduces forward (g) and 2 backward (f) [1, sec. 3];
f and g live in `parlab.parallel.tensor.mappings`.

Sequence parallelism [2, section 4.2.2] splits the rest of the layer (layer
norms, dropout, residual adds) along the sequence: each rank keeps S/tp tokens
there, f becomes an all-gather of the sequence and g a reduce-scatter, moving
the same bytes as the all-reduce they replace. Parameters used on S/tp tokens
(layer norms, the row-parallel bias, the position table) then hold partial
gradients: `sync_sequence_parallel_grads` sums them (one all-reduce per step;
in `parlab.parallel.tensor.grads`, with `dense_state_dict` / `dense_grads`, re-exported here).

The embedding and the output layer split the vocabulary: each rank embeds
only the ids it holds, and the loss is computed from the local (B, S, V/tp)
logits with three all-reduces of one number per token (max, sum of
exponentials, target logit); full logits are never formed [1, section 3].
That loss lives in `parlab.parallel.tensor.loss` (re-exported here).

Applying it: `parallelize(model, plan)` replaces modules by path from a
declarative plan (path pattern -> style), like torch's ``parallelize_module``;
`parallelize_gpt` does it for `parlab.models.GPT` with `gpt_plan()`;
`dense_state_dict` / `dense_grads` gather the shards back into the dense layout
so every result can be compared with the one-process model.

Not handled here: dropout random streams. With dropout > 0 the replicated
regions need the same RNG state on every rank (``parlab.run`` seeds all ranks
alike) and the sharded regions different ones (Megatron's RNG tracker); the
tests use dropout 0, where TP is exactly the dense model.

References
    [1] M. Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
        Parallelism", arXiv:1909.08053, 2019.
    [2] V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
        arXiv:2205.05198, 2022.
"""
from __future__ import annotations

import fnmatch
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parlab import comm
from parlab.parallel.tensor.grads import mark_sequence_parallel
from parlab.parallel.tensor.loss import vocab_parallel_mean_loss
from parlab.parallel.tensor.mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                                             reduce_scatter_to_sp, scatter_to_tp, split_dim)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "Colwise", "Rowwise",
           "VocabEmbedding", "EnterRegion", "SequenceShard", "STYLES", "gpt_plan", "parallelize", "parallelize_gpt",
           "plan_matches", "check_divisible"]


def check_divisible(what: str, value: int, tp: int) -> None:
    """ValueError naming the sizes and the tp that would work, e.g. 'n_head 6 is not divisible by tp 4; ...'."""
    if value % tp:
        ok = sorted(d for d in range(1, value + 1) if value % d == 0)
        raise ValueError(f"{what} {value} is not divisible by tp {tp}; choose tp in {{{', '.join(map(str, ok))}}}")


def _check_sizes(owner: str, **sizes) -> None:
    """ValueError for a size that is not a positive integer, before any tensor is made."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner} {name} must be a positive integer, got {value!r}")


def _shard(full: torch.Tensor, dim: int | None, group) -> nn.Parameter:
    """This rank's slice of a dense parameter along `dim` (all of it when dim is None), as a new Parameter
    tagged with ``tp_dim`` so `dense_state_dict` knows how to put it back together."""
    part = full.detach() if dim is None else full.detach().chunk(comm.get_world_size(group), dim)[comm.get_rank(group)]
    p = nn.Parameter(part.clone(), requires_grad=full.requires_grad)
    p.tp_dim = dim
    if full.is_meta:  # not materialised yet: say which chunk of the dense parameter (parlab.parallel.meta_init.materialize)
        p.dense_chunk = (dim, comm.get_world_size(group), comm.get_rank(group))
    return p


def _local_param(shape, bound: float, tp_dim, dtype, device) -> nn.Parameter:
    """A freshly initialised local shard, U(-bound, bound) like nn.Linear's default."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    if p.device.type != "meta":
        nn.init.uniform_(p, -bound, bound)
    p.tp_dim = tp_dim
    return p


# ----------------------------------------------------------------------------- layers
class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r: the weight (out, in) is split along `out`; rank r holds rows [r*out/tp, (r+1)*out/tp).

    Input: the full X, replicated (B, S, in), or (B, S/tp, in) with ``sequence_parallel``. It first
    enters the TP region through f (identity / all-reduce) or, with sequence parallelism, the sequence
    all-gather (all-gather / reduce-scatter); ``input_in_region=True`` skips that when the caller already
    did it for several layers sharing one input (q, k and v). Output: (B, S, out/tp), or all of it
    gathered along the last dim with ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 gather_output: bool = False, input_in_region: bool = False, sequence_parallel: bool = False,
                 label: str = "", dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.group, self.label = in_features, out_features, group, label
        self.gather_output, self.input_in_region = gather_output, input_in_region
        self.sequence_parallel = sequence_parallel
        tp = comm.get_world_size(group)
        _check_sizes("ColumnParallelLinear", in_features=in_features, out_features=out_features)
        check_divisible("ColumnParallelLinear out_features", out_features, tp)
        bound = 1 / math.sqrt(in_features)  # nn.Linear's default init, drawn for this rank's rows only
        self.weight = _local_param((out_features // tp, in_features), bound, 0, dtype, device)
        self.bias = _local_param((out_features // tp,), bound, 0, dtype, device) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, gather_output: bool = False, input_in_region: bool = False,
                   sequence_parallel: bool = False, label: str = "", memo: dict | None = None):
        """Shard a dense nn.Linear: this rank keeps its rows of the weight and of the bias."""
        layer = cls(linear.in_features, linear.out_features, False, group, gather_output, input_in_region,
                    sequence_parallel, label, dtype=linear.weight.dtype, device="meta")
        layer.weight = _memoised(linear.weight, 0, group, memo)
        layer.bias = None if linear.bias is None else _memoised(linear.bias, 0, group, memo)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_in_region:
            x = (gather_from_sp(x, self.group, self.label) if self.sequence_parallel  # (B, S/tp, in) -> (B, S, in)
                 else copy_to_tp(x, self.group, self.label))                          # (B, S, in), f
        y = F.linear(x, self.weight, self.bias)  # (B, S, out/tp)
        return gather_from_tp(y, self.group, self.label) if self.gather_output else y  # (B, S, out) if gathered

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r: the weight (out, in) is split along `in`; rank r holds columns [r*in/tp, ...).

    Input: (B, S, in/tp), already split (the output of a column-parallel layer), or the full input with
    ``input_is_parallel=False`` (then scattered). The partial products are summed by g (all-reduce) or,
    with sequence parallelism, reduce-scattered along the sequence to (B, S/tp, out). The bias is added
    once, after the sum (adding it on every rank would count it tp times).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, label: str = "",
                 dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.group, self.label = in_features, out_features, group, label
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        tp = comm.get_world_size(group)
        _check_sizes("RowParallelLinear", in_features=in_features, out_features=out_features)
        check_divisible("RowParallelLinear in_features", in_features, tp)
        bound = 1 / math.sqrt(in_features)  # the fan-in of the whole layer, not of the slice
        self.weight = _local_param((out_features, in_features // tp), bound, 1, dtype, device)
        self.bias = _local_param((out_features,), bound, None, dtype, device) if bias else None
        self._mark_bias()

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, input_is_parallel: bool = True,
                   sequence_parallel: bool = False, label: str = "", memo: dict | None = None):
        """Shard a dense nn.Linear: this rank keeps its columns of the weight and the whole bias."""
        layer = cls(linear.in_features, linear.out_features, False, group, input_is_parallel, sequence_parallel,
                    label, dtype=linear.weight.dtype, device="meta")
        layer.weight = _memoised(linear.weight, 1, group, memo)
        layer.bias = None if linear.bias is None else _memoised(linear.bias, None, group, memo)
        layer._mark_bias()
        return layer

    def _mark_bias(self) -> None:
        if self.bias is not None:  # with SP the bias is added to S/tp tokens: its gradient is partial
            if self.sequence_parallel:
                mark_sequence_parallel(self.bias)
            else:
                self.bias.sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, self.label)  # (B, S, in) -> (B, S, in/tp)
        y = F.linear(x, self.weight)  # (B, S, out), this rank's partial sum
        y = (reduce_scatter_to_sp(y, self.group, self.label) if self.sequence_parallel  # (B, S/tp, out)
             else reduce_from_tp(y, self.group, self.label))                            # (B, S, out), g
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table (V, H) split along the vocabulary: rank r holds ids [r*V/tp, (r+1)*V/tp).

    Each rank looks up the ids it holds, writes zeros for the others, and the ranks sum their
    (B, S, H) results: all-reduce, or reduce-scatter along the sequence with sequence parallelism."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, sequence_parallel: bool = False,
                 label: str = "", dtype=None, device=None):
        super().__init__()
        self.tp = comm.get_world_size(group)
        _check_sizes("VocabParallelEmbedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        check_divisible("vocab_size", num_embeddings, self.tp)
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.sequence_parallel, self.label = sequence_parallel, label
        self.start = comm.get_rank(group) * (num_embeddings // self.tp)  # first id this rank holds
        self.weight = nn.Parameter(torch.empty(num_embeddings // self.tp, embedding_dim, dtype=dtype, device=device))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight)  # nn.Embedding's default init
        self.weight.tp_dim = 0

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group=None, sequence_parallel: bool = False, label: str = "",
                   memo: dict | None = None) -> "VocabParallelEmbedding":
        """Shard a dense nn.Embedding: this rank keeps its rows (its slice of the vocabulary)."""
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, sequence_parallel, label,
                    dtype=embedding.weight.dtype, device="meta")
        layer.weight = _memoised(embedding.weight, 0, group, memo)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        vl = self.num_embeddings // self.tp
        outside = (idx < self.start) | (idx >= self.start + vl)      # (B, S) ids held by another rank
        local = (idx - self.start).masked_fill(outside, 0)            # (B, S) row in this rank's slice
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, S, H) partial
        return (reduce_scatter_to_sp(out, self.group, self.label) if self.sequence_parallel  # (B, S/tp, H)
                else reduce_from_tp(out, self.group, self.label))                            # (B, S, H)


def _memoised(full: nn.Parameter, dim, group, memo: dict | None) -> nn.Parameter:
    """Shard `full` once: a tied parameter (wte / lm_head) becomes one shared shard, so the tie survives."""
    if memo is None:
        return _shard(full, dim, group)
    key = id(full)
    if key not in memo:
        memo[key] = _shard(full, dim, group)
    elif memo[key].tp_dim != dim:
        raise ValueError("a tied parameter is sharded two different ways; shard it along the same dim in both uses")
    return memo[key]


# ----------------------------------------------------------------------------- plans
@dataclass
class Colwise:
    """nn.Linear -> ColumnParallelLinear (output stays split unless gather_output)."""
    gather_output: bool = False
    input_in_region: bool = False

    def apply(self, module, name, group, sp, memo):
        return ColumnParallelLinear.from_dense(module, group, self.gather_output, self.input_in_region, sp, name, memo)


@dataclass
class Rowwise:
    """nn.Linear -> RowParallelLinear (input already split; output summed, or reduce-scattered with SP)."""

    def apply(self, module, name, group, sp, memo):
        return RowParallelLinear.from_dense(module, group, True, sp, name, memo)


@dataclass
class VocabEmbedding:
    """nn.Embedding -> VocabParallelEmbedding."""

    def apply(self, module, name, group, sp, memo):
        return VocabParallelEmbedding.from_dense(module, group, sp, name, memo)


@dataclass
class EnterRegion:
    """Bring the module's first input into the TP region once (f, or the SP all-gather), for children
    that share it: attention's q, k and v (styled ``Colwise(input_in_region=True)``)."""

    def apply(self, module, name, group, sp, memo):
        enter = functools.partial(gather_from_sp if sp else copy_to_tp, group=group, label=name)
        module.register_forward_pre_hook(lambda _m, args: (enter(args[0]),) + tuple(args[1:]))
        return module


@dataclass
class SequenceShard:
    """With SP the module runs on this rank's S/tp tokens, so its parameters get partial gradients
    (summed by `sync_sequence_parallel_grads`). ``split_input``: also keep this rank's chunk of the
    module's input along dim 0 (the positions fed to the position table). Without SP: unchanged."""
    split_input: bool = False

    def apply(self, module, name, group, sp, memo):
        if sp:
            for p in module.parameters():
                mark_sequence_parallel(p)
            if self.split_input:
                module.register_forward_pre_hook(lambda _m, args: (split_dim(args[0], 0, group),) + tuple(args[1:]))
        return module


def gpt_plan() -> dict:
    """Megatron's layout for `parlab.models.GPT`, as (module path pattern -> style)."""
    return {
        "wte": VocabEmbedding(),
        "wpe": SequenceShard(split_input=True),
        "blocks.*.ln_1": SequenceShard(),
        "blocks.*.attn": EnterRegion(),                        # one f for q, k, v
        "blocks.*.attn.[qkv]": Colwise(input_in_region=True),  # heads split across ranks
        "blocks.*.attn.proj": Rowwise(),                       # g
        "blocks.*.ln_2": SequenceShard(),
        "blocks.*.mlp.fc": Colwise(),                          # f
        "blocks.*.mlp.proj": Rowwise(),                        # g
        "ln_f": SequenceShard(),
        "lm_head": Colwise(),                                  # vocab-split logits for the parallel loss
    }


def plan_matches(pattern: str, name: str) -> bool:
    """Component-wise glob: '*' stands for one path component ('blocks.*.mlp.fc')."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, n))


STYLES = {"colwise": Colwise, "rowwise": Rowwise, "vocab_embedding": VocabEmbedding, "enter_region": EnterRegion,
          "sequence": SequenceShard}  # plan values may name a style with its default options


def parallelize(model: nn.Module, plan: dict, group=None, sequence_parallel: bool = False) -> nn.Module:
    """Apply `plan` (path pattern -> style or style name) to `model` in place and return it. Each module takes
    the first pattern it matches; a pattern that matches nothing is an error (a typo would leave a layer dense)."""
    styles = {p: STYLES[s]() if isinstance(s, str) else s for p, s in plan.items()}
    todo = [(name, next((p for p in styles if plan_matches(p, name)), None)) for name, _ in model.named_modules()]
    unused = [p for p in styles if p not in {p for _, p in todo}]
    if unused:
        raise ValueError(f"plan entries {unused} match no module of {type(model).__name__}; paths look like "
                         f"{[n for n, _ in model.named_modules() if n][:4]}")
    memo: dict = {}  # dense parameter id -> its shard, so tied parameters stay tied
    for name, pattern in todo:
        if pattern is None:
            continue
        module = model.get_submodule(name)
        new = styles[pattern].apply(module, name, group, sequence_parallel, memo)
        if new is not module:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, new)
    return model


def parallelize_gpt(model: nn.Module, group=None, sequence_parallel: bool = False, plan: dict | None = None):
    """Tensor-parallel (and optionally sequence-parallel) `parlab.models.GPT`, in place.

    Afterwards ``model(idx, targets)`` takes the full (B, S) ids on every rank and returns this rank's
    logits (B, S, V/tp) and the mean loss (vocab-parallel cross-entropy, equal on every rank). With SP,
    call `sync_sequence_parallel_grads(model, group)` after backward."""
    cfg, tp = model.config, comm.get_world_size(group)
    check_divisible("n_head", cfg.n_head, tp)
    check_divisible("vocab_size", cfg.vocab_size, tp)
    check_divisible("MLP hidden size", cfg.mlp_ratio * cfg.n_embd, tp)
    parallelize(model, gpt_plan() if plan is None else plan, group, sequence_parallel)
    model.loss = functools.partial(vocab_parallel_mean_loss, group=group)  # shadows GPT.loss
    return model
