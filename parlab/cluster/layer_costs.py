"""One transformer layer's work on one of tp x cp GPUs: its matrix-product FLOPs and the bytes its memory-bound
ops move (`parlab.cluster.step_costs.StepCosts` times them; the mixture-of-experts layer's own part is in
`parlab.cluster.expert_costs`).

Memory-bound ops (`layer_forward_bytes`): the layer's layer norms, residual adds, dropouts, softmax and GeLU
move their inputs and outputs through HBM (16-bit elements, 1-byte dropout masks). Per layer and forward, with
E = b s h / cp elements of one hidden state (/ tp as well with sequence parallelism, which splits these ops
along the sequence: Korthikanti et al. 2022, section 4.2.2), A = a b s^2 / (tp cp) of one attention-score
tensor and F = b s f / (tp cp) of the MLP's hidden layer:

    2 layer norms      2 x (2E read + 2E written)            =  8E
    2 residual adds    2 x (4E read + 2E written)            = 12E
    2 dropouts         2 x (2E read + 2E written + E mask)   = 10E   (dropout=True, Megatron's GPT runs)
    softmax            2A read + 2A written                  =  4A
    attention dropout  2A read + 2A written + A mask         =  5A   (dropout=True)
    GeLU               2F read + 2F written                  =  4F   (SwiGLU: SiLU 4F + the product 6F = 10F)

the op list of a Megatron layer as Calculon builds it (calculon/llm/llm.py `_build_attn_block` /
`_build_mlp_block`, commit caa4b11) with the tensor sizes of Korthikanti et al. 2022, section 4.1. The backward
moves the same bytes again (Calculon's layers.py: the activation-gradient traffic of LayerNorm, SoftMax, DropOut,
GeLU equals their forward's) and, with recomputation, the recomputed part's forward bytes once more (selective:
softmax and attention dropout only, 4A + 5A). The last stage adds its final norm (4E) and the logits' softmax
(2 bytes x b s V / tp read and written).

Number format "fp8" (Transformer Engine): the weight GEMMs' operands are cast to 8 bits (`fp8_cast_bytes`).

    V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023,
    arXiv:2205.05198, sections 4.1-4.2 (the tensors' sizes); T. Dao et al., "FlashAttention", NeurIPS 2022,
    arXiv:2205.14135, sections 3.1-3.2 (a fused kernel keeps no scores).
Pure Python: no torch.
"""
from __future__ import annotations

from parlab.cluster import transformer as T
from parlab.cluster.costs import BYTES_16BIT, ModelSpec

__all__ = ["WEIGHTS", "layer_forward_flops", "attention_core_bytes", "layer_forward_bytes", "fp8_cast_bytes"]

_MASK_BYTES = 1                      # a dropout mask element (Korthikanti et al. 2022, section 4.1)
WEIGHTS = ("qkv", "proj", "mlp_in", "mlp_out")   # the layer's products with a weight matrix (`transformer.layer_gemms`)


def layer_forward_flops(m: ModelSpec, b: int, tp: int = 1, cp: int = 1) -> float:
    """Forward FLOPs of one layer on one of tp x cp GPUs for b sequences: 2 b s (4 h^2 + k h f) + 4 b s^2 h,
    all / (tp cp) (k = 2 for a GELU MLP, 3 for SwiGLU; the s^2 term is q k^T and the weighted sum of v)."""
    return sum(2.0 * mm * n * k * batch for _, mm, n, k, batch in T.layer_gemms(m, b, tp, cp))


def attention_core_bytes(m: ModelSpec, b: int, tp: int = 1, cp: int = 1, dropout: bool = True,
                         fused: bool = False) -> float:
    """Forward bytes of one layer's attention-score ops (softmax 4A, its dropout 5A; module docstring) on one of
    tp x cp GPUs for b sequences: A = a b s^2 / (tp cp) elements. A `fused` kernel (FlashAttention) keeps the
    scores in on-chip memory: it reads Q, K, V and writes O, 4 x 2 b s h / (tp cp) bytes, and draws its dropout
    mask from the seed (Dao et al. 2022, sections 3.1-3.2)."""
    if fused:
        width = 2 * m.hidden + 2 * m.kv_width                         # Q and O (b, s/cp, h/tp), K and V narrower
        return BYTES_16BIT * b * m.seq * width / (tp * cp)            # with grouped-query attention
    A = m.heads * b * m.seq * m.seq / (tp * cp)
    return 2 * BYTES_16BIT * A + ((2 * BYTES_16BIT + _MASK_BYTES) * A if dropout else 0.0)


def layer_forward_bytes(m: ModelSpec, b: int, tp: int = 1, cp: int = 1, sequence_parallel: bool = False,
                        dropout: bool = True, fused: bool = False) -> float:
    """Forward bytes of one layer's memory-bound ops (norms, residual adds, dropouts, softmax, GeLU / SwiGLU;
    module docstring) on one of tp x cp GPUs for b sequences."""
    E = b * m.seq * m.hidden / (cp * (tp if sequence_parallel else 1))     # one hidden state (b, s/cp, h)
    F = b * m.seq * m.ffn / (tp * cp)                                      # the MLP's hidden layer (b, s/cp, f/tp)
    norms = 2 * (2 * BYTES_16BIT * E)
    residual = 2 * (3 * BYTES_16BIT * E)
    drops = 2 * ((2 * BYTES_16BIT + _MASK_BYTES) * E) if dropout else 0.0
    act = (5 if m.swiglu else 2) * BYTES_16BIT * F
    return norms + residual + drops + act + attention_core_bytes(m, b, tp, cp, dropout, fused)


def fp8_cast_bytes(gemms) -> tuple[float, float]:
    """(forward, backward) bytes one layer's fp8 casts move (Transformer Engine's delayed scaling: every weight
    GEMM's operands are cast to 8 bits with a per-tensor scale; "Using FP8 with Transformer Engine", TE user
    guide): the forward casts each weight GEMM's input (m x k) and its weight (k x n), the backward the output
    gradient (m x n) its input- and weight-gradient products take. A cast reads 2 bytes and writes 1 per element;
    the amax reductions (one value per tensor) are left out. `gemms`: `transformer.layer_gemms`."""
    cast = BYTES_16BIT + 1
    linear = [(m, n, k, batch) for name, m, n, k, batch in gemms if name in WEIGHTS]
    return (cast * sum((m * k + k * n) * batch for m, n, k, batch in linear),
            cast * sum(m * n * batch for m, n, k, batch in linear))
