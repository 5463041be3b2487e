"""The arithmetic of a dense GPT: parameters, FLOPs per iteration, activation memory, MFU and HFU.

One home for the closed forms that parlab's estimates use (the planner, the scale-up replay, the lessons and the
exercises): each function is one formula of the papers below, named as they name it, so that a lesson can print
the formula beside its number and a test can hold it to the paper. Pure Python (no torch). The model is a
`parlab.cluster.costs.ModelSpec` (layers l, hidden h, heads a, vocabulary V, sequence s, MLP width f).

Parameters (Megatron [1] eq. 2, GELU MLP with f = 4h, biases, LayerNorms, tied output head):

    P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h))          = 12 l h^2 + 13 l h + V h + s h

  eq. 2 counts the learned position table (s h) and leaves out the final LayerNorm (2 h). `params` says which
  parts it counts; `ModelSpec.param_count` (every parameter the model has, any MLP) is the sum of all of them.

FLOPs of one iteration of B sequences ([1] section 5.1, Korthikanti et al. [2] section 6, eqs. 7-8). Per layer
and sequence the forward pass multiplies 24 s h^2 (QKV 6, projection 2, MLP 16) and computes the attention
scores and their weighted sum, 4 s^2 h; the logits add 2 s h V. The backward pass costs twice the forward:

    model FLOPs       72 B s l h^2 (1 + s / (6 h) + V / (12 l h))     ([2] eq. 7: what the model needs)
    + selective       72 B s l h^2 (1 + s / (3 h) + V / (12 l h))     ([2] eq. 8: attention recomputed)
    + full recompute  96 B s l h^2 (1 + s / (6 h) + V / (16 l h))     ([1] eq. 3: one more forward pass)

  MFU divides the model FLOPs by step time x GPUs x peak, HFU the FLOPs the hardware did (with recomputation)
  ([2] section 6.3; PaLM [4] appendix B defined MFU). `training_flops_6nd` is Kaplan's estimate 6 N D [3]
  of the training compute: it leaves out the attention scores (s / 6h of the layer FLOPs: 33% at s = 8192,
  h = 4096) and is kept for what it is, a rule of thumb.

Activation memory of one layer and micro-batch of b sequences, 16-bit, in bytes ([2] section 4, table 2):

    no parallelism              s b h (34 + 5 a s / h)
    tensor parallel             s b h (10 + 24 / t + 5 a s / (h t))
    tensor + sequence parallel  s b h (34 / t + 5 a s / (h t))
    tensor + selective          s b h (10 + 24 / t)
    tensor + sequence + sel.    s b h (34 / t)
    full recomputation          2 s b h  (the layer's input; / t with sequence parallelism)

  The 34 is 10 that tensor parallelism leaves whole (the two LayerNorms' inputs 4, the inputs of attention
  and MLP 2 + 2, their dropout masks 1 + 1) and 24 that it shards (Q, K, V 6, the projection's input 2, the
  MLP's f-wide input and output of GELU 8 + 8; `activation_bytes_per_layer` for any MLP). Sequence parallelism
  shards the 10 too; selective recomputation drops the 5 a s / h (the softmax, its dropout mask and output).
  A fused attention kernel [5] never stores them either: it keeps the softmax's log-sum-exp, one fp32 value per
  head and token, 4 a / h (/ tp), and regenerates its dropout mask from the random seed.
  The first pipeline stage holds l activations of a layer under 1F1B (p micro-batches in flight, l / p layers
  each), x (1 + (p - 1) / (p v)) with v interleaved chunks ([2] eq. 6 and section 4.2.3).

References
    [1] D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
        SC 2021, arXiv:2104.04473, section 5.1 (eqs. 2-4) and appendix.
    [2] V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023,
        arXiv:2205.05198, sections 4 (table 2, eqs. 5-6), 6 (eqs. 7-8), tables 3 and 5.
    [3] J. Kaplan et al., "Scaling Laws for Neural Language Models", arXiv:2001.08361, section 2.1.
    [4] A. Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", arXiv:2204.02311, appendix B.
    [5] T. Dao et al., "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness", NeurIPS 2022,
        arXiv:2205.14135, sections 3.1 (no s x s matrix stored; the backward recomputes it from Q, K and the
        softmax statistics) and 3.2; T. Dao, "FlashAttention-2", arXiv:2307.08691, section 4.1 (the backward's
        5 products against the forward's 2).
"""
from __future__ import annotations

__all__ = ["RECOMPUTE", "ATTENTION", "recompute_mode", "check_attention", "params", "model_flops", "hardware_flops", "training_flops_6nd", "mfu", "hfu",
           "activation_bytes_per_layer", "first_stage_activation_bytes", "layer_gemms", "head_gemms", "backward_gemms",
           "BYTES_16BIT"]

BYTES_16BIT = 2
RECOMPUTE = ("none", "selective", "full")
#: attention kernels: "materialised" writes the a s^2 scores (softmax, dropout) to memory, as Megatron did in 2022
#: ([2]); "fused" (FlashAttention [5], cuDNN's fused attention; the default of training runs from 2022 on, of
#: Megatron-Core and PyTorch's scaled_dot_product_attention, and so of every function here) never does
ATTENTION = ("materialised", "fused")


def check_attention(attention) -> str:
    """`attention` if it names a kernel of ATTENTION, else a ValueError saying which there are."""
    if attention not in ATTENTION:
        raise ValueError(f"attention is the attention kernel, 'materialised' (the scores written to memory, "
                         f"Megatron 2022) or 'fused' (FlashAttention), got {attention!r}")
    return attention


def recompute_mode(recompute) -> str:
    """"none", "selective" or "full" from a mode or the older flag (True: full recomputation, False: none)."""
    if recompute is True:                # the planner's older flag: True meant full recomputation
        return "full"
    if recompute in (False, None):
        return "none"
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    return recompute


def params(model, position_table: bool | None = None, final_norm: bool = False) -> float:
    """Megatron's eq. 2 for `model`: 12 l h^2 + 13 l h + V h (+ s h, the position table, when
    `position_table`, by default when the model learns one) (+ 2 h, the final LayerNorm, when `final_norm`).

    For a GPT with f = 4h, biases and a tied head this is `model.param_count()` less the final LayerNorm; for
    other models (SwiGLU, no biases) eq. 2 does not hold and `model.param_count()` is the count to use."""
    l, h, V, s = model.layers, model.hidden, model.vocab, model.seq
    keep_pos = model.learned_pos if position_table is None else position_table
    return 12 * l * h * h + 13 * l * h + V * h + (s * h if keep_pos else 0) + (2 * h if final_norm else 0)


def _layer_terms(model) -> tuple[float, float, float]:
    """Per-layer forward FLOPs per sequence, split: (dense products, attention scores, logits)."""
    l, h, s, f, kv = model.layers, model.hidden, model.seq, model.ffn, model.kv_width
    # a mixture of experts: a token runs top_k MLPs in an MoE layer and the router's h x E product (mean per layer)
    moe = model.moe_layers / l
    mlps = 1 + moe * (model.top_k - 1)
    # Q and the projection 2 s h h each, K and V 2 s h kv each (kv = h without grouped-query attention), the MLP
    dense = (4 * s * h * h + 4 * s * h * kv + mlps * (6 if model.swiglu else 4) * s * h * f   # 24 s h^2 at f = 4h
             + moe * 2 * s * h * model.experts)
    return dense, 4 * s * s * h, 2 * s * h * model.vocab / l


def layer_gemms(model, b: int, tp: int = 1, cp: int = 1) -> list[tuple[str, int, int, int, int]]:
    """The matrix products of one layer's forward on one of tp x cp GPUs for b sequences, as (name, m, n, k,
    batch): `batch` products (m x k) @ (k x n). T = b s / cp tokens; a / tp heads of d = h / a channels each
    (Megatron's column-parallel QKV and MLP-in, row-parallel projection and MLP-out):

        qkv     T x h     @ h x (h+2kv)/tp     scores  (b a/tp) x  s/cp x d  @ d x s
        proj    T x h/tp  @ h/tp x h           values  (b a/tp) x  s/cp x s  @ s x d
        mlp_in  T x h     @ h x kf/tp  (k = 1 GELU, 2 SwiGLU: gate and up; kv = h, or the keys' width with
                                        grouped-query attention, `ModelSpec.kv_width`)
        mlp_out T x f/tp  @ f/tp x h

    2 m n k batch summed over them is 2 T (4 h^2 + (k + 1) h f) / tp + 4 b s^2 h / (tp cp): the layer FLOPs of
    the module docstring on one GPU."""
    s, h, f, a = model.seq, model.hidden, model.ffn, model.heads
    T, d = b * s // cp, h // a
    heads = b * a // tp
    gate = 2 if model.swiglu else 1
    return [("qkv", T, (h + 2 * model.kv_width) // tp, h, 1), ("scores", s // cp, s, d, heads), ("values", s // cp, d, s, heads),
            ("proj", T, h, h // tp, 1), ("mlp_in", T, gate * f // tp, h, 1), ("mlp_out", T, h, f // tp, 1)]


def head_gemms(model, b: int, tp: int = 1, cp: int = 1) -> list[tuple[str, int, int, int, int]]:
    """The last stage's output layer: the logits T x h @ h x V/tp (a vocabulary-parallel head)."""
    return [("logits", b * model.seq // cp, model.vocab // tp, model.hidden, 1)]


def backward_gemms(gemms) -> list[tuple[str, int, int, int, int]]:
    """The backward's two products for each forward product Y = X W (m x k @ k x n): the input gradient
    dX = dY W^T (m x n @ n x k) and the weight gradient dW = X^T dY (k x m @ m x n); each as many FLOPs as the
    forward, so the backward is twice the forward. An attention product's two are both input gradients."""
    out = []
    for name, m, n, k, batch in gemms:
        out += [(f"{name} dgrad", m, k, n, batch), (f"{name} wgrad", k, n, m, batch)]
    return out


def model_flops(model, batch: int) -> float:
    """FLOPs one iteration of `batch` sequences needs ([2] eq. 7): 3 x forward, recomputation not counted.
    For a GELU MLP with f = 4h: 72 B s l h^2 (1 + s / (6h) + V / (12 l h))."""
    dense, scores, logits = _layer_terms(model)
    return 3 * batch * model.layers * (dense + scores + logits)


def hardware_flops(model, batch: int, recompute="none") -> float:
    """FLOPs the GPUs execute in one iteration: the model FLOPs plus what recomputation repeats.

    full: every layer's forward once more, not the logits ([1] eq. 3: 96 B s l h^2 (1 + s / (6h) + V / (16 l h))).
    selective: [2] eq. 8, 72 B s l h^2 (1 + s / (3h) + V / (12 l h)), that is 3 x 4 B s^2 l h more than the model
    FLOPs. One forward of the scores alone would be 1 x; the paper's count is the one kept here, since its
    HFU figures (table 5) are computed with it."""
    dense, scores, logits = _layer_terms(model)
    extra = {"none": 0.0, "selective": 3 * scores, "full": dense + scores}[recompute_mode(recompute)]
    return model_flops(model, batch) + batch * model.layers * extra


def training_flops_6nd(n_params: float, tokens: float) -> float:
    """Kaplan's estimate of the training compute [3]: 6 FLOPs per parameter and token (2 forward + 4 backward),
    without the attention scores. A rule of thumb; `model_flops` is the count."""
    return 6 * n_params * tokens


def mfu(model, batch: int, step_s: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: model FLOPs of an iteration / (step time x GPUs x peak FLOP/s per GPU)."""
    return model_flops(model, batch) / (step_s * gpus * peak_flops)


def hfu(model, batch: int, step_s: float, gpus: int, peak_flops: float, recompute="none") -> float:
    """Hardware FLOPs utilisation: the FLOPs executed, recomputation included, / (step x GPUs x peak)."""
    return hardware_flops(model, batch, recompute) / (step_s * gpus * peak_flops)


def activation_bytes_per_layer(model, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
                               recompute="none", cp: int = 1, attention: str = "fused") -> float:
    """Bytes one layer keeps for the backward pass of one micro-batch ([2] table 2, any MLP width).

    whole   = 4 (LayerNorm inputs) + 2 + 1 (attention input, dropout mask) + 2 + 1 (MLP input, dropout mask;
              SwiGLU, as in LLaMA, has no MLP dropout): 10 for GPT; / tp only with sequence parallelism
    sharded = 6 + 2 (Q, K, V; projection input) + 4 f / h (GELU: input and output of the f-wide MLP) or
              8 f / h (SwiGLU: gate, up, silu(gate), their product): 24 for GPT; / tp
    scores  = 5 a s / h (softmax output 2, its dropout mask 1 and output 2, per head): / tp; 0 with selective;
              4 a / h with a fused `attention` kernel (its log-sum-exp statistics, fp32), whatever the recompute:
              "fused" is the default (FlashAttention [5], the kernel of training runs since 2022); table 2's
              5 a s / h is attention="materialised"
    all in units of s b h, / cp (each context-parallel rank holds s / cp tokens). Full recomputation keeps the
    layer's input alone: 2 s b h (/ tp with sequence parallelism).

    A mixture of experts (a fraction mu = moe_layers / layers of the layers): each token's k = top_k routed copies
    run the experts, so an MoE layer keeps the f-wide MLP activations k times and the experts' inputs k times
    (2 (k - 1) more in `whole`: the permuted copies, / tp with sequence parallelism as each tp rank routes its own
    tokens); per rank the same under expert parallelism with balanced routing (each rank's experts process as many
    copies as its tokens made) and under expert tensor parallelism (etp x the tokens, f / etp wide). The router's
    logits (E / h) and dropped tokens are left out."""
    rc = recompute_mode(recompute)
    s, h, a, f, b = model.seq, model.hidden, model.heads, model.ffn, micro_batch
    if rc == "full":
        return BYTES_16BIT * s * b * h / ((tp if sequence_parallel else 1) * cp)
    routed = (model.top_k - 1) * model.moe_layers / model.layers         # extra routed copies, mean per layer
    whole = 10 - (1 if model.swiglu else 0) + 2 * routed
    mlp = (8 if model.swiglu else 4) * f / h * (1 + routed)               # the f-wide activations, k x in MoE
    sharded = 4 + 4 * model.kv_width / h + mlp                            # Q, O; K, V (GQA: narrower)
    if check_attention(attention) == "fused":
        scores = 4 * a / h                        # log-sum-exp: 4 bytes per head and token  # (b, a/tp, s) fp32
    else:
        scores = 0.0 if rc == "selective" else 5 * a * s / h
    per = (whole / tp if sequence_parallel else whole) + (sharded + scores) / tp
    return s * b * h * per / cp


def first_stage_activation_bytes(model, micro_batch: int, tp: int = 1, pp: int = 1, virtual: int = 1,
                                 micro_batches: int | None = None, sequence_parallel: bool = False,
                                 recompute="none", cp: int = 1, stage_layers: int | None = None,
                                 attention: str = "fused") -> float:
    """Activations the first pipeline stage holds at its peak ([2] section 4.2.3): 1F1B keeps min(p, m)
    micro-batches in flight on l / p layers, so about l layers' worth when m >= p; the interleaved schedule with
    v chunks per rank keeps (1 + (p - 1) / (p v)) times that ([2] eq. 6). Layers only: the embedding's
    dropout mask and the output layer's activations are left out (under 1% of this for the table 3 models).
    `stage_layers`: the first stage's layers when pp does not divide l (default l / p)."""
    if pp < 1 or virtual < 1:
        raise ValueError(f"pp ({pp}) and virtual ({virtual}) must be at least 1")
    m = pp if micro_batches is None else micro_batches
    per_layer = activation_bytes_per_layer(model, micro_batch, tp, sequence_parallel, recompute, cp, attention)
    stage = model.layers / pp if stage_layers is None else stage_layers
    factor = 1 + (pp - 1) / (pp * virtual) if virtual > 1 else 1.0    # [2] eq. 6 holds for interleaving only
    return stage * min(pp, m) * per_layer * factor
