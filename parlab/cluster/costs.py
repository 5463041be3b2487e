"""Cost model of one training step: a model, a cluster, and the per-GPU memory and time formulas.

The planner (`parlab.cluster.planner`) enumerates layouts; this module holds the arithmetic it uses, one
formula per function, so a lesson can print the formula beside the number. Pure Python (no torch).

Model. A dense decoder-only transformer with L layers, hidden size h, a heads, vocabulary V,
sequence length s and MLP width f (4h for GPT's GELU MLP; LLaMA's SwiGLU MLP has three f x h
matrices with f ~ 8h/3, e.g. 11008 for LLaMA-7B). Parameters, split into what tensor parallelism
shards (/tp) and what every TP rank keeps whole (LayerNorms, row-parallel biases, positions):

    attention   4 h^2 (+ 4 h biases)                     Megatron: q, k, v column-, proj row-parallel
    MLP (GELU)  2 h f (+ f + h biases)       SwiGLU: 3 h f (no biases)
    norms       2 x (2 h LayerNorm | h RMSNorm)
    GPT-3: 12 h^2 + 13 h per layer, + V h (tied) + s h (positions): 174.6B for GPT-3 "175B" [1, 2].

Activations per layer and micro-batch, FLOPs per iteration, MFU and HFU: `parlab.cluster.transformer` (Korthikanti
et al. [3] table 2, Megatron's eqs.), which takes a ModelSpec.

Model states: ZeRO [4], via `parlab.parallel.zero.memory.model_state_bytes` (2 + 2 + K bytes per parameter, K = 12).

Time. Compute: `transformer.hardware_flops` (6 psi FLOPs per token [5] is the rule of thumb it refines).
Collectives use ring costs [6]: an all-reduce of X bytes sends 2 (N-1)/N X per
rank, a reduce-scatter or all-gather (N-1)/N X.

References
    [1] T. Brown et al., "Language Models are Few-Shot Learners" (GPT-3), arXiv:2005.14165, table 2.1.
    [2] H. Touvron et al., "LLaMA: Open and Efficient Foundation Language Models", arXiv:2302.13971,
        table 2 (sizes), section 2.2 (SwiGLU, RMSNorm, RoPE).
    [3] V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
        arXiv:2205.05198, sections 4.1-4.3 (activation memory, sequence parallelism, recomputation).
    [4] S. Rajbhandari et al., "ZeRO", arXiv:1910.02054, sections 3, 5 and 7.
    [5] J. Kaplan et al., "Scaling Laws for Neural Language Models", arXiv:2001.08361, section 2.1.
    [6] P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms", JPDC 2009.
    [7] D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
        Megatron-LM", SC 2021, arXiv:2104.04473, sections 2-3 (placement, bubble, p2p scatter/gather).
    [8] A. Jiang et al., "Mixtral of Experts", arXiv:2401.04088, section 2 and table 1 (Mixtral 8x7B); Mistral AI,
        "Cheaper, Better, Faster, Stronger" (2024-04-17: Mixtral 8x22B, 141B parameters, 39B active).
"""
from __future__ import annotations

from dataclasses import dataclass

from parlab.parallel.pipeline import split_layers

__all__ = ["ModelSpec", "Cluster", "PRESETS", "CLUSTERS", "model_preset", "preset", "from_gpt_config",
           "BYTES_16BIT"]

BYTES_16BIT = 2  # bf16 / fp16 weights, gradients and activations


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, described by what the cost formulas need: dense, or with a mixture of experts
    (`experts` MLPs in every `moe_every`-th layer, each token routed to `top_k` of them, and a router h x E)."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int | None = None          # MLP width f; default 4 h
    swiglu: bool = False            # LLaMA: 3 matrices h x f, no biases
    bias: bool = True               # biases in linear layers; LayerNorm (2h) if True else RMSNorm (h)
    tied: bool = True               # output head shares the embedding matrix
    learned_pos: bool = True        # a learned s x h position table (GPT); False for RoPE (LLaMA)
    dropout: bool = True            # trains with dropout (GPT-3, Megatron's GPTs); LLaMA does not
    kv_heads: int | None = None     # key/value heads (grouped-query attention, Ainslie et al. 2023); None: = heads
    experts: int = 0                # MLPs of an MoE layer (0: dense everywhere)
    top_k: int = 1                  # experts each token goes to
    moe_every: int = 1              # every n-th layer has the experts (1: all, as Mixtral; 2: Switch, GShard)

    def __post_init__(self) -> None:
        for k in ("layers", "hidden", "heads", "vocab", "seq"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {self.name!r}: {k} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}; "
                             f"every head gets hidden // heads channels")
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        kv = self.kv_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or self.heads % kv:
            raise ValueError(f"model {self.name!r}: kv_heads must be a positive integer dividing the {self.heads} "
                             f"heads (each key/value head serves heads / kv_heads query heads), got {kv!r}")
        for k in ("experts", "top_k", "moe_every"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "experts" else 1):
                raise ValueError(f"model {self.name!r}: {k} must be a {'non-negative' if k == 'experts' else 'positive'} "
                                 f"integer, got {v!r}")
        if self.experts and not (2 <= self.experts and self.top_k <= self.experts):
            raise ValueError(f"model {self.name!r}: a mixture of experts needs at least 2 experts and top_k <= "
                             f"experts, got experts={self.experts}, top_k={self.top_k}")

    @property
    def kv_width(self) -> int:
        """Channels of the keys (and of the values): kv_heads x h / a; h without grouped-query attention."""
        return self.kv_heads * (self.hidden // self.heads)

    @property
    def moe_layers(self) -> int:
        """Layers with experts: every `moe_every`-th (0 for a dense model)."""
        return self.layers // self.moe_every if self.experts else 0

    # ------------------------------------------------------------ parameters
    def mlp_params(self, tp: int = 1) -> float:
        """One MLP (one expert of an MoE layer): (2 or 3) h f weights / tp, the fc biases / tp and the output
        bias (row-parallel, kept whole)."""
        h, f = self.hidden, self.ffn
        sharded = (3 if self.swiglu else 2) * h * f + (f if self.bias and not self.swiglu else 0)
        return sharded / tp + (h if self.bias and not self.swiglu else 0)

    def layer_params(self, tp: int = 1) -> float:
        """Parameters of one transformer layer held by one of tp ranks (sharded / tp + replicated); for a mixture of
        experts the mean over the layers (an MoE layer holds `experts` MLPs and a router h x E, kept whole), so
        that layers x layer_params is the model's."""
        h, kv = self.hidden, self.kv_width
        sharded = 2 * h * h + 2 * h * kv                              # q, o; k, v
        replicated = 2 * (2 * h if self.bias else h)                  # two norms
        if self.bias:
            sharded += h + 2 * kv                                     # q, k, v biases (column-parallel)
            replicated += h                                           # proj bias (row-parallel: kept whole)
        moe = self.moe_layers / self.layers
        mlps = 1 + moe * (self.experts - 1)                           # MLPs per layer, on average
        return sharded / tp + replicated + mlps * self.mlp_params(tp) + moe * h * self.experts

    def active_params(self) -> int:
        """Parameters a token computes with: the whole model less the experts it is not routed to (Mixtral 8x7B:
        12.9B of 46.7B)."""
        return round(self.param_count() - self.moe_layers * (self.experts - self.top_k) * self.mlp_params())

    def embedding_params(self, tp: int = 1) -> float:
        """Token embedding (vocab-parallel, / tp) plus the position table (kept whole)."""
        return self.vocab * self.hidden / tp + (self.seq * self.hidden if self.learned_pos else 0)

    def head_params(self, tp: int = 1) -> float:
        """Final norm plus, when untied, the output matrix (vocab-parallel)."""
        norm = 2 * self.hidden if self.bias else self.hidden
        return norm + (0 if self.tied else self.vocab * self.hidden / tp)

    def param_count(self) -> int:
        """psi: all parameters (GPT-3 175B: 174.6e9 with V = 50257; LLaMA-7B: 6.74e9)."""
        return round(self.layers * self.layer_params() + self.embedding_params() + self.head_params())

    def stage_params(self, tp: int, pp: int) -> float:
        """Parameters on the fullest rank: its stage's layers plus the embedding (first stage) or the head
        (last stage; with a tied head and pp > 1 the last stage keeps its own copy of the embedding [7]).
        Layers per stage as parlab's pipeline splits them (`schedules.split_layers`): L/pp each when pp
        divides L, else one more on some stages."""
        if pp == 1:
            return self.layers * self.layer_params(tp) + self.embedding_params(tp) + self.head_params(tp)
        sizes = [len(r) for r in split_layers(self.layers, pp)]
        first = sizes[0] * self.layer_params(tp) + self.embedding_params(tp)
        last = sizes[-1] * self.layer_params(tp) + self.head_params(tp) + (self.vocab * self.hidden / tp
                                                                           if self.tied else 0)
        middle = max(sizes[1:-1], default=0) * self.layer_params(tp)
        return max(first, last, middle)


# ---------------------------------------------------------------------- presets
def _gpt3() -> ModelSpec:
    return ModelSpec("gpt3-175b", layers=96, hidden=12288, heads=96, vocab=50257, seq=2048)


def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, vocab=32000, seq=2048, ffn=ffn, swiglu=True, bias=False,
                     tied=False, learned_pos=False, dropout=False)


def _mixtral(name: str, layers: int, hidden: int, heads: int, ffn: int, vocab: int) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, vocab, seq=4096, ffn=ffn, swiglu=True, bias=False, tied=False,
                     learned_pos=False, dropout=False, kv_heads=8, experts=8, top_k=2)


#: Named models ([1] table 2.1; [2] table 2 and the released configs' MLP widths; Mixtral [8] section 2 and its
#: released configs: 8 experts, top-2, 8 key/value heads, trained here at s = 4096 as Megatron-LM's examples do).
PRESETS: dict[str, ModelSpec] = {
    "gpt3-175b": _gpt3(),
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 11008),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 13824),
    "llama-65b": _llama("llama-65b", 80, 8192, 64, 22016),
    "mixtral-8x7b": _mixtral("mixtral-8x7b", 32, 4096, 32, 14336, 32000),        # 46.7B, 12.9B active
    "mixtral-8x22b": _mixtral("mixtral-8x22b", 56, 6144, 48, 16384, 32768),      # 141B, 39B active
}


def model_preset(name: str) -> ModelSpec:
    """A named model: 'gpt3-175b', 'llama-7b' ... (the keys of `PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)} (or build a ModelSpec)")
    return PRESETS[name]


#: the old name of `model_preset`, kept for saved notebooks (``parlab.cluster.hardware.preset`` is another function)
preset = model_preset


def from_gpt_config(config, name: str = "parlab-gpt") -> ModelSpec:
    """The tiny parlab GPT (`parlab.models.GPTConfig`) as a ModelSpec: same parameter count."""
    return ModelSpec(name, config.n_layer, config.n_embd, config.n_head, config.vocab_size, config.seq_len,
                     ffn=config.mlp_ratio * config.n_embd, bias=config.bias, tied=config.tie_embeddings)


@dataclass(frozen=True)
class Cluster:
    """nodes x gpus_per_node GPUs. Bandwidths in GB/s per GPU and direction; peak in FLOP/s.

    Defaults: DGX A100 80 GB nodes: 312 TFLOP/s dense bf16, NVLink3 300 GB/s per direction, one
    200 Gb/s HDR InfiniBand adapter per GPU = 25 GB/s. `mfu` is the fraction of peak the matrix
    multiplications sustain (Megatron reports 44-52% on 175B-1T models [7] table 1); `usable` the
    fraction of GPU memory left after the CUDA context, allocator fragmentation and buffers."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    intra_gbps: float = 300.0
    inter_gbps: float = 25.0
    peak_tflops: float = 312.0
    mfu: float = 0.5
    usable: float = 0.9

    def __post_init__(self) -> None:
        for k in ("nodes", "gpus_per_node"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"cluster {k} must be a positive integer, got {v!r}")
        for k in ("gpu_mem_gb", "intra_gbps", "inter_gbps", "peak_tflops"):
            if not getattr(self, k) > 0:
                raise ValueError(f"cluster {k} must be positive, got {getattr(self, k)!r}")
        if not (0 < self.mfu <= 1 and 0 < self.usable <= 1):
            raise ValueError(f"mfu ({self.mfu}) and usable ({self.usable}) are fractions in (0, 1]")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def mem_bytes(self) -> float:
        return self.usable * self.gpu_mem_gb * 1e9

    def bandwidth(self, crosses_nodes: bool) -> float:
        """Bytes per second of a group's slowest link."""
        return (self.inter_gbps if crosses_nodes else self.intra_gbps) * 1e9


#: A few clusters for the lessons (per-GPU inter-node bandwidth: one NIC per GPU).
CLUSTERS: dict[str, Cluster] = {
    "a100-80gb": Cluster(),
    "a100-40gb": Cluster(gpu_mem_gb=40.0),
    "h100-80gb": Cluster(intra_gbps=450.0, inter_gbps=50.0, peak_tflops=989.0),
}
