"""A small GPT-2 style language model: the reference model every lesson shards.

This is the one-process model that tensor parallelism, pipeline parallelism,
ZeRO/FSDP, ring attention and DDP all split up, and the model their tests
check against. It is written to be read top to bottom, and it uses plain
module names so a strategy can find every layer by its path
(``blocks.0.attn.q``, ``blocks.1.mlp.fc``, ``lm_head``, ...).

Notation used in the shape comments:

    B  batch size             S  sequence length       H  n_embd (hidden size)
    V  vocab size             nh number of heads       hd head_dim = H // n_head
    F  MLP hidden size = mlp_ratio * H

How it is put together (a pre-norm decoder-only transformer [1, 2]):

    idx (B, S) --embed--> x (B, S, H) --Block x n_layer--> x --head--> logits (B, S, V)
    Block:  x = x + attn(ln_1(x));   x = x + mlp(ln_2(x))

Notes for the strategies that shard this model:

* ``CausalSelfAttention`` has separate ``q``, ``k``, ``v`` projections (not one
  fused ``c_attn`` as in GPT-2 / nanoGPT [3]), so splitting heads across
  tensor-parallel ranks is a plain split of each weight's output rows. The
  number of heads is read from the activations at run time
  (``q.shape[-1] // head_dim``), so a shard holding ``n_head / tp`` heads
  needs no other change.
* The attention math itself lives in ``CausalSelfAttention.core_attention``;
  ring attention and flash-style kernels replace just that.
* ``GPT.embed``, ``GPT.blocks``, ``GPT.head`` and ``GPT.loss`` are the pieces of
  ``GPT.forward``, so a pipeline stage can run any sub-range of the model.
* Initialisation does not touch the global RNG. Each parameter's initial value
  depends only on (seed, its name, its shape): not on dtype, device, or the other
  parameters. Two models with the same config and seed are bit-identical, and
  ``GPT(config, seed, dtype=torch.float64)`` is exactly the float32 model cast.
* To copy a model, use ``clone_model`` (``copy.deepcopy``, which keeps the
  tied ``lm_head.weight is wte.weight``).
* ``GPTConfig(experts=E, top_k=k, ...)`` makes the MLP of every ``moe_every``-th layer a mixture of E
  experts (``parlab.models.moe``): the one-process reference of expert parallelism.
* Meta-device construction (``GPT(config, seed, device="meta")``, then
  ``parlab.parallel.meta_init.materialize``): see `parlab.parallel.meta_init`.

References
    [1] A. Radford, J. Wu, R. Child, D. Luan, D. Amodei, I. Sutskever,
        "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019.
    [2] A. Vaswani et al., "Attention Is All You Need", NeurIPS 2017.
    [3] A. Karpathy, nanoGPT, https://github.com/karpathy/nanoGPT (model.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
import zlib
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from parlab.models.moe import MoE

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "moe_mlp", "causal_attention", "clone_model",
           "count_targets", "weighted_mean_loss"]


# ----------------------------------------------------------------------------- config


@dataclass
class GPTConfig:
    """Hyper-parameters of the model. The defaults give a ~0.1M-parameter toy GPT."""

    vocab_size: int = 64
    seq_len: int = 32  # longest sequence the model accepts (size of the position table)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = True  # lm_head.weight is wte.weight, as in GPT-2
    bias: bool = True  # biases in Linear layers and LayerNorms
    mlp_ratio: int = 4
    # mixture of experts (parlab.models.moe): experts 0 keeps every MLP dense
    experts: int = 0  # E >= 2: the MLP of every `moe_every`-th layer (0, n, 2n, ...) is a mixture of E experts
    top_k: int = 1  # experts per token
    moe_every: int = 1  # Megatron's moe_layer_freq: 1 every layer, 2 every other one
    capacity_factor: float | None = None  # None: no token dropped; else capacity ceil(T k cf / E)
    aux_loss_coeff: float = 1e-2  # alpha of the load-balancing loss (Switch: 1e-2)
    z_loss_coeff: float = 0.0  # beta of the router z-loss (ST-MoE: 1e-3)
    norm_topk: bool = False  # renormalise the k routing weights to sum to 1 (Mixtral)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            suggestion = self.n_head * max(1, self.n_embd // self.n_head)
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"every head gets n_embd // n_head channels, so pick e.g. n_embd={suggestion}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.experts and (not isinstance(self.experts, int) or self.experts < 2):
            raise ValueError(f"GPTConfig.experts is 0 (dense MLPs) or the number of experts, at least 2, got "
                             f"{self.experts!r}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"GPTConfig.top_k={self.top_k} must be between 1 and experts={self.experts}")
        if not isinstance(self.moe_every, int) or self.moe_every < 1:
            raise ValueError(f"GPTConfig.moe_every must be a positive integer, got {self.moe_every!r}")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts: layers 0, moe_every, 2 moe_every, ... when experts > 0."""
        return bool(self.experts) and i % self.moe_every == 0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def param_count(self) -> int:
        """Number of distinct parameters of ``GPT(self)``, in closed form.

        A tied ``lm_head`` shares ``wte.weight`` and so adds nothing. Equal to the cost model's count of the same
        model, ``parlab.cluster.costs.from_gpt_config(self).param_count()`` (tested).
        """
        V, S, H, L, F_ = self.vocab_size, self.seq_len, self.n_embd, self.n_layer, self.mlp_ratio * self.n_embd
        b = 1 if self.bias else 0
        layer_norm = H + b * H  # weight (+ bias)
        attn = 4 * (H * H + b * H)  # q, k, v, proj
        mlp = (H * F_ + b * F_) + (F_ * H + b * H)  # fc, proj
        block = 2 * layer_norm + attn + mlp
        moe = self.experts * mlp + H * self.experts - mlp  # E expert MLPs and the router, instead of one MLP
        embeddings = V * H + S * H  # wte, wpe
        lm_head = 0 if self.tie_embeddings else V * H
        return embeddings + L * block + sum(moe for i in range(L) if self.is_moe_layer(i)) + layer_norm + lm_head


# ----------------------------------------------------------------------------- attention


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Softmax attention written out: softmax(q k^T / sqrt(hd) + mask) v.

    q: (B, nh, Sq, hd), k and v: (B, nh, Sk, hd)  ->  (B, nh, Sq, hd).
    With ``causal`` the Sq queries are the *last* Sq of the Sk positions, so
    query i may look at keys 0 .. i + (Sk - Sq); for Sq == Sk that is the usual
    lower-triangular mask. Runs in any float dtype, float64 included.
    """
    Sq, Sk, hd = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(hd)  # (B, nh, Sq, Sk)
    if causal:
        allowed = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(diagonal=Sk - Sq)  # (Sq, Sk)
        scores = scores.masked_fill(~allowed, float("-inf"))  # (B, nh, Sq, Sk)
    weights = torch.softmax(scores, dim=-1)  # (B, nh, Sq, Sk), each row sums to 1
    return weights @ v  # (B, nh, Sq, hd)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate q, k, v projections."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        H = config.n_embd
        self.n_head = config.n_head  # heads of the full layer; a shard may hold fewer
        self.head_dim = config.head_dim
        self.q = nn.Linear(H, H, bias=config.bias)
        self.k = nn.Linear(H, H, bias=config.bias)
        self.v = nn.Linear(H, H, bias=config.bias)
        self.proj = nn.Linear(H, H, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, nh, S, hd) x3 -> (B, nh, S, hd). Replace this to change the kernel:
        subclass, or assign ``attn.core_attention = fn`` on one instance."""
        return causal_attention(q, k, v, causal=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape  # (B, S, H)
        q = self.q(x)  # (B, S, nh*hd); under tensor parallelism only the local heads
        nh = q.shape[-1] // self.head_dim  # heads present in this (possibly sharded) layer
        q = q.view(B, S, nh, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)
        k = self.k(x).view(B, S, nh, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)
        v = self.v(x).view(B, S, nh, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)
        y = self.core_attention(q, k, v)  # (B, nh, S, hd)
        y = y.transpose(1, 2).reshape(B, S, nh * self.head_dim)  # (B, S, nh*hd), heads side by side
        return self.drop(self.proj(y))  # (B, S, H)


# ----------------------------------------------------------------------------- MLP and block


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear(H, F) -> GELU -> Linear(F, H)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        H, F_ = config.n_embd, config.mlp_ratio * config.n_embd
        self.fc = nn.Linear(H, F_, bias=config.bias)
        self.act = nn.GELU()  # exact (erf) GELU, not the tanh approximation
        self.proj = nn.Linear(F_, H, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))  # (B, S, F); under tensor parallelism F / tp
        return self.drop(self.proj(h))  # (B, S, H)


def moe_mlp(config: GPTConfig) -> MoE:
    """The mixture-of-experts MLP of `config` (its experts the size of the dense MLP)."""
    return MoE(config.n_embd, config.mlp_ratio * config.n_embd, config.experts, config.top_k, bias=config.bias,
               capacity_factor=config.capacity_factor, norm_topk=config.norm_topk,
               aux_loss_coeff=config.aux_loss_coeff, z_loss_coeff=config.z_loss_coeff, dropout=config.dropout)


class Block(nn.Module):
    """One transformer layer, pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x)); `mlp` a mixture of experts
    (`parlab.models.moe.MoE`) in the layers `GPTConfig.is_moe_layer` names."""

    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = moe_mlp(config) if config.is_moe_layer(layer) else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, S, H)
        x = x + self.mlp(self.ln_2(x))  # (B, S, H)
        return x


# ----------------------------------------------------------------------------- the model


def _param_seed(seed: int, name: str) -> int:
    """A generator seed for one parameter, from the model seed and the parameter's name.

    A 32-bit hash, because the CPU generator (mt19937) keeps only the low 32 bits of a seed.
    """
    return zlib.crc32(f"{seed}/{name}".encode())


def _initial_value(name: str, shape, layer_norm: bool, n_layer: int, seed: int) -> torch.Tensor:
    """GPT-2's initial value of the parameter `name` (its name in the dense model), float32 on the CPU."""
    module_name, _, kind = name.rpartition(".")
    if kind == "bias":
        return torch.zeros(shape, device="cpu")
    if layer_norm:
        return torch.ones(shape, device="cpu")
    residual = ("attn.proj", "mlp.proj", "experts.proj")      # the projections onto the residual stream
    std = 0.02 / math.sqrt(2 * n_layer) if module_name.endswith(residual) else 0.02
    g = torch.Generator().manual_seed(_param_seed(seed, name))
    # the CPU generator: the same values on any device; scaled in place (no second tensor of this size)
    return torch.randn(shape, generator=g, device="cpu").mul_(std)


class GPT(nn.Module):
    """GPT-2 style decoder: embed -> blocks -> head (-> loss)."""

    def __init__(
        self,
        config: GPTConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise ValueError(f"GPT parameters need a floating-point dtype, got {dtype}")
        self.config = config
        self.init_seed = seed  # what `materialize` draws from, for a model built on the meta device
        meta = device is not None and torch.device(device).type == "meta"
        # nn.Linear and friends fill themselves with a default init drawn from the
        # global RNG; fork_rng puts that RNG back afterwards, and init_weights below
        # overwrites every value from `seed`. On the meta device nothing is allocated
        # or drawn: `materialize` gives the parameters their values later.
        with torch.random.fork_rng(devices=[]), (torch.device("meta") if meta else contextlib.nullcontext()):
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embeddings (V, H)
            self.wpe = nn.Embedding(config.seq_len, config.n_embd)  # position embeddings (S, H)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)  # (V, H)
        self.to(device=device, dtype=dtype)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one parameter, used twice
        if not meta:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """GPT-2 init [1]: weights ~ N(0, 0.02), the two residual projections per block
        (``attn.proj``, ``mlp.proj``) ~ N(0, 0.02 / sqrt(2 * n_layer)), biases 0,
        LayerNorm weights 1.

        Each parameter is drawn from its own ``torch.Generator`` seeded by
        (seed, name), in float32 on the CPU, then cast and copied. So the values do
        not depend on dtype or device (a float64 model is the float32 model cast
        exactly), nor on which other parameters exist.
        """
        layer_norms = {name for name, m in self.named_modules() if isinstance(m, nn.LayerNorm)}
        for name, p in self.named_parameters():  # a tied lm_head.weight appears once, as wte.weight
            p.copy_(_initial_value(name, p.shape, name.rpartition(".")[0] in layer_norms, self.config.n_layer, seed))

    def embed(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, S) -> hidden states (B, S, H): token + position embeddings.

        `pos` (S,) gives the positions of the S tokens when they are not 0..S-1 (a context-parallel
        rank holds a shard of a longer sequence).
        """
        B, S = idx.shape
        if S > self.config.seq_len:
            raise ValueError(f"sequence of length {S} is longer than GPTConfig.seq_len={self.config.seq_len}")
        if pos is None:
            pos = torch.arange(S, device=idx.device)  # (S,)
        x = self.wte(idx) + self.wpe(pos)  # (B, S, H) + (S, H) -> (B, S, H)
        return self.drop(x)  # (B, S, H)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (B, S, H) -> logits (B, S, V)."""
        return self.lm_head(self.ln_f(x))  # (B, S, V)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all B * S positions. logits (B, S, V), targets (B, S)."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))  # ()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, S) long -> (logits (B, S, V), mean loss or None)."""
        x = self.embed(idx)  # (B, S, H)
        for block in self.blocks:
            x = block(x)  # (B, S, H)
        logits = self.head(x)  # (B, S, V)
        loss = self.loss(logits, targets) if targets is not None else None
        return logits, loss


M = TypeVar("M", bound=nn.Module)


def clone_model(model: M) -> M:
    """An independent copy with equal values (``copy.deepcopy``; tied weights stay tied)."""
    return copy.deepcopy(model)


# ----------------------------------------------------------------------------- the mean over many ranks' tokens
# (every technique that spreads one batch's tokens over ranks divides by their global count: data, pipeline,
# context and tensor parallel alike)
def count_targets(targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Number of targets that are not `ignore_index`: the denominator of the "mean" reduction. () int64."""
    return (targets != ignore_index).sum()


def weighted_mean_loss(loss_fn, logits: torch.Tensor, targets: torch.Tensor, n: int, weight: float) -> torch.Tensor:
    """``loss_fn(logits, targets) * weight`` for a mean loss over the `n` non-ignored targets (GPT.loss, or
    the vocab-parallel mean). With weight = n * D / N_global on each of D ranks whose gradients are averaged
    afterwards, every rank's share is D * (its sum) / N_global, so the average is the global mean over the
    N_global tokens of all ranks, whatever their padding. n == 0: a zero that still reaches the logits, so
    backward gives zero gradients instead of the nan of an empty mean."""
    if n == 0:
        return logits.sum() * 0.0                                      # ()
    return loss_fn(logits, targets) * weight                           # ()
