"""parlab.cluster.transformer against the papers: Megatron eq. 2-3, Korthikanti et al. table 2 and eqs. 7-8, and
the MFU / HFU of Korthikanti's table 5 from its published step times. The paper's formulas are written here
literally, as printed, so a generalisation in parlab (any MLP width, context parallelism) that stopped reducing
to them would fail."""
import pytest

from parlab.cluster import transformer as T
from parlab.cluster.costs import ModelSpec, from_gpt_config, model_preset
from parlab.cluster.published import KORTHIKANTI, KORTHIKANTI_MODELS, SELENE_PEAK_FLOPS
from parlab.models import GPTConfig

MODELS = list(KORTHIKANTI_MODELS)
REL = 1e-12          # float rounding only: both sides are the same arithmetic in another order


def _table2(model, t, b=1):
    """Korthikanti et al. table 2, as printed (bytes per layer, 16-bit), with their s, b, h, a, t."""
    s, h, a = model.seq, model.hidden, model.heads
    sbh = s * b * h
    return {("none", False, 1): sbh * (34 + 5 * a * s / h),
            ("none", False, t): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
            ("none", True, t): sbh * (34 / t + 5 * a * s / (h * t)),
            ("selective", False, t): sbh * (10 + 24 / t),
            ("selective", True, t): sbh * (34 / t),
            ("full", False, t): sbh * 2}


@pytest.mark.parametrize("name", MODELS)
def test_every_row_of_table_2_is_the_papers_formula(name):
    model, t, *_ = KORTHIKANTI_MODELS[name]
    for (recompute, sp, tp), expected in _table2(model, t).items():
        got = T.activation_bytes_per_layer(model, 1, tp=tp, sequence_parallel=sp, recompute=recompute,
                                           attention="materialised")          # the 2022 runs wrote the scores out
        assert got == pytest.approx(expected, rel=REL), (name, recompute, sp, tp)


def test_the_attention_kernel_is_fused_by_default_and_table_2_is_the_materialised_one():
    """FlashAttention (2022) is what training runs use since: every default is "fused" (no 5 a s / h of scores
    kept, the log-sum-exp's 4 a / h instead); table 2 is reproduced with attention="materialised" only."""
    import inspect

    from parlab.cluster import planner
    from parlab.cluster.step_costs import Layout
    from parlab.cluster.validation import MeasuredRun
    assert Layout().attention == "fused" and MeasuredRun.attention == "fused"
    for fn in (planner.estimate, planner.enumerate_layouts, T.activation_bytes_per_layer,
               T.first_stage_activation_bytes):
        assert inspect.signature(fn).parameters["attention"].default == "fused", fn.__name__
    model, t, *_ = KORTHIKANTI_MODELS["175B"]
    s, h, a = model.seq, model.hidden, model.heads
    table2 = _table2(model, t)
    for (rc, sp, tp), expected in table2.items():
        fused = T.activation_bytes_per_layer(model, 1, tp, sp, rc)
        mat = T.activation_bytes_per_layer(model, 1, tp, sp, rc, attention="materialised")
        assert mat == pytest.approx(expected, rel=REL)
        if rc == "none":            # the scores' 5 a s / h (/ t) gone, the log-sum-exp's 4 a / h (/ t) kept
            assert mat - fused == pytest.approx(s * h * (5 * a * s / h - 4 * a / h) / tp, rel=REL)
    from parlab.cluster.costs import Cluster
    assert planner.Estimate.attention == "fused"
    assert planner.estimate(model, Cluster(nodes=8), 64, tp=8, pp=8).attention == "fused"


@pytest.mark.parametrize("name", MODELS)
def test_parameters_and_flops_are_megatrons_equations(name):
    model, _, _, _, batch = KORTHIKANTI_MODELS[name]
    l, h, V, s, B = model.layers, model.hidden, model.vocab, model.seq, batch
    assert T.params(model) == pytest.approx(12 * l * h ** 2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h)), rel=REL)
    # eq. 2 leaves out the final LayerNorm, which the model has
    assert T.params(model, final_norm=True) == model.param_count()
    assert T.params(model, position_table=False) == T.params(model) - s * h
    assert T.model_flops(model, B) == pytest.approx(72 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (12 * l * h)),
                                                    rel=REL)                                        # [2] eq. 7
    assert T.hardware_flops(model, B, "selective") == pytest.approx(
        72 * B * s * l * h ** 2 * (1 + s / (3 * h) + V / (12 * l * h)), rel=REL)                   # [2] eq. 8
    assert T.hardware_flops(model, B, "full") == pytest.approx(
        96 * B * s * l * h ** 2 * (1 + s / (6 * h) + V / (16 * l * h)), rel=REL)                   # [1] eq. 3
    assert T.hardware_flops(model, B) == T.model_flops(model, B)


@pytest.mark.parametrize("run", KORTHIKANTI, ids=[f"{r.model_name}-{r.recompute}" for r in KORTHIKANTI])
def test_mfu_and_hfu_of_table_5_from_its_step_times(run):
    """Within 1% (relative) of the printed values: the step times are printed to 3-4 digits (1.10 s for 22B)."""
    lay = run.layout
    mfu = T.mfu(run.model, lay["global_batch"], run.step_s, lay["gpus"], SELENE_PEAK_FLOPS)
    hfu = T.hfu(run.model, lay["global_batch"], run.step_s, lay["gpus"], SELENE_PEAK_FLOPS, run.recompute)
    assert mfu == pytest.approx(run.mfu, rel=0.01) and hfu == pytest.approx(run.hfu, rel=0.01), (mfu, hfu)


def test_6nd_leaves_out_the_attention_scores():
    """The rule of thumb vs the count: at s = 8192, h = 4096 the scores add s / 6h = 33% to the layer FLOPs."""
    m = ModelSpec("long", layers=32, hidden=4096, heads=32, vocab=32000, seq=8192, learned_pos=False)
    tokens = m.seq
    ratio = T.model_flops(m, 1) / T.training_flops_6nd(T.params(m), tokens)
    layers_only = (1 + m.seq / (6 * m.hidden))       # what the scores add to 72 B s l h^2
    assert ratio == pytest.approx(layers_only, rel=0.03)     # the rest: logits in one, embedding in the other


@pytest.mark.parametrize("config", [GPTConfig(), GPTConfig(n_layer=3, n_embd=48, n_head=3, bias=False),
                                    GPTConfig(tie_embeddings=False, vocab_size=96, seq_len=40)])
def test_one_parameter_count(config):
    """The three counts agree where they describe the same model: the tiny GPT's own (exact), the cost model's,
    and Megatron's eq. 2 (`transformer.params`, the one closed form; ZeRO's lesson uses it too)."""
    assert from_gpt_config(config).param_count() == config.param_count()
    gpt3 = model_preset("gpt3-175b")
    no_positions = ModelSpec("g", gpt3.layers, gpt3.hidden, gpt3.heads, gpt3.vocab, gpt3.seq, learned_pos=False)
    assert T.params(no_positions, final_norm=True) == no_positions.param_count()
    assert T.params(gpt3, final_norm=True) == gpt3.param_count()


@pytest.mark.parametrize("pp,virtual,factor", [(8, 1, 1.0), (8, 2, 1 + 7 / 16), (64, 4, 1 + 63 / 256)])
def test_first_stage_holds_l_layers_and_more_when_interleaved(pp, virtual, factor):
    model = KORTHIKANTI_MODELS["175B"][0]
    mat = dict(attention="materialised")                     # [2]'s runs wrote the scores out
    per = T.activation_bytes_per_layer(model, 1, 8, True, "selective", **mat)
    got = T.first_stage_activation_bytes(model, 1, tp=8, pp=pp, virtual=virtual, micro_batches=64,
                                         sequence_parallel=True, recompute="selective", **mat)
    assert got == pytest.approx(model.layers * per * factor, rel=REL)
    few = T.first_stage_activation_bytes(model, 1, tp=8, pp=8, micro_batches=2, sequence_parallel=True, **mat)
    assert few == pytest.approx(model.layers * 2 / 8 * T.activation_bytes_per_layer(model, 1, 8, True, **mat),
                                rel=REL)


@pytest.mark.parametrize("call,says", [
    (lambda m: T.hardware_flops(m, 4, "partial"), "recompute must be one of none, selective, full, got 'partial'"),
    (lambda m: T.first_stage_activation_bytes(m, 1, pp=0), "pp (0) and virtual (1) must be at least 1"),
])
def test_bad_input_says_what_is_allowed(call, says):
    with pytest.raises(ValueError, match=f"^{says.replace('(', '[(]').replace(')', '[)]')}"):
        call(KORTHIKANTI_MODELS["22B"][0])


# ---------------------------------------------------------------------- the attention kernel
def test_a_fused_attention_kernel_stores_no_scores_moves_no_score_bytes_and_recomputes_them_in_its_backward():
    from parlab.cluster.costs import model_preset
    from parlab.cluster.hardware import hardware_preset
    from parlab.cluster.step_costs import Layout, StepCosts, attention_core_bytes
    model, a100 = model_preset("gpt3-175b"), hardware_preset("dgx-a100")
    s, h, a = model.seq, model.hidden, model.heads
    # memory: the 5 a s / h of the scores go; the log-sum-exp (fp32 per head and token) stays, whatever recomputes
    mat = T.activation_bytes_per_layer(model, 1, 8, True, "none", attention="materialised")
    fused = T.activation_bytes_per_layer(model, 1, 8, True, "none")                         # the default
    assert mat - fused == pytest.approx(s * h * (5 * a * s / h - 4 * a / h) / 8, rel=REL)
    assert fused == pytest.approx(T.activation_bytes_per_layer(model, 1, 8, True, "selective", attention="fused"))
    # bytes: Q, K, V read and O written (16-bit) instead of softmax 4A and its dropout 5A
    assert attention_core_bytes(model, 1, 8, fused=True) == 4 * 2 * s * h / 8
    assert attention_core_bytes(model, 1, 8) == 9 * a * s * s / 8
    # time: the backward gains the scores product once more (5 products against the forward's 2) and selective
    # recomputation has nothing left to redo
    lay = dict(tp=8, pp=8, dp=1, sequence_parallel=True)
    cm, cf = (StepCosts(model, a100, Layout(**lay, attention=k), 8) for k in ("materialised", "fused"))
    scores = [g for g in T.layer_gemms(model, 1, 8) if g[0] == "scores"][0]
    assert cf.t_dgrad - cm.t_dgrad == pytest.approx(a100.gemm_time(*scores[1:]), rel=REL)
    sel = StepCosts(model, a100, Layout(**lay, recompute="selective", attention="fused"), 8)
    assert sel.action("backward", 3) == pytest.approx(cf.action("backward", 3), rel=REL)
    assert cf.action("forward", 3) < cm.action("forward", 3)       # 9 A bytes of scores are gone
    with pytest.raises(ValueError, match="attention is the attention kernel"):
        Layout(attention="flash")


def test_the_planner_takes_the_attention_kernel_in_memory_and_time():
    from parlab.cluster.costs import model_preset
    from parlab.cluster.hardware import hardware_preset
    from parlab.cluster.planner import cluster_for, estimate
    from parlab.cluster.step_costs import Layout, StepCosts
    model, h100 = model_preset("gpt3-175b"), hardware_preset("dgx-h100")
    cluster = cluster_for(h100, 64)
    kw = dict(tp=8, pp=8, recompute="selective", hardware=h100)
    mat, fused = (estimate(model, cluster, 64, **kw, attention=k) for k in ("materialised", "fused"))
    assert mat.layout.endswith(" materialised") and not fused.layout.endswith(" materialised")   # not the default
    plain = [estimate(model, cluster, 64, tp=8, pp=8, attention=k).activation_bytes for k in ("materialised", "fused")]
    assert plain[1] < plain[0] / 2          # without recomputation the scores were most of the activations
    terms = StepCosts(model, h100, Layout(tp=8, pp=8, recompute="selective", sequence_parallel=True,
                                          attention="fused"), 8).step_terms(64)
    assert fused.compute_s == pytest.approx(terms["compute"] + terms["optimizer"], rel=REL)
    with pytest.raises(ValueError, match="attention is the attention kernel"):
        estimate(model, cluster, 64, tp=8, pp=8, attention="flash")
    # a fused kernel leaves selective recomputation nothing to redo: the planner lists no copy of each layout
    from parlab.cluster.planner import enumerate_layouts
    small = cluster_for(h100, 8)
    tried = enumerate_layouts(model_preset("llama-7b"), small, 16, hardware=h100, attention="fused",
                              recompute=("none", "selective", "full"), micro_batches=(1,), zero_stages=(1,))
    assert {e.recomputation for e in tried} == {"none", "full"}
    assert len({e.layout for e in tried}) == len(tried)


def test_grouped_query_attention_narrows_the_keys_and_values_in_parameters_flops_and_memory():
    # Llama 3 405B (Dubey et al. 2024, table 3): 126 layers, h 16384, 128 heads, 8 key/value heads, FFN 53248
    llama = ModelSpec("llama3-405b", 126, 16384, 128, 128256, 8192, ffn=53248, swiglu=True, bias=False, tied=False,
                      learned_pos=False, dropout=False, kv_heads=8)
    mha = ModelSpec(**{**llama.__dict__, "kv_heads": None})
    h, kv = 16384, 8 * 128                                    # keys and values: 8 heads of 128 channels
    assert llama.kv_width == kv and mha.kv_width == h
    assert mha.layer_params() - llama.layer_params() == 2 * h * (h - kv)
    assert round(llama.param_count() / 1e9) == 406            # the paper's "405B"
    qkv = [g for g in T.layer_gemms(llama, 1, 8) if g[0] == "qkv"][0]
    assert qkv[2] == (h + 2 * kv) // 8
    s = llama.seq
    assert T.model_flops(mha, 1) - T.model_flops(llama, 1) == pytest.approx(3 * 126 * 4 * s * h * (h - kv), rel=REL)
    per = lambda m: T.activation_bytes_per_layer(m, 1, 8, True, "selective")        # noqa: E731
    assert per(mha) - per(llama) == pytest.approx(s * h * 4 * (h - kv) / h / 8, rel=REL)
    with pytest.raises(ValueError, match="kv_heads must be a positive integer dividing the 128 heads"):
        ModelSpec(**{**llama.__dict__, "kv_heads": 3})


def test_a_mixture_of_experts_counts_every_expert_in_its_parameters_and_top_k_in_its_flops():
    # Mixtral 8x7B (Jiang et al. 2024, arXiv:2401.04088, table 1 and section 2): 32 layers, h 4096, 32 heads, 8
    # key/value heads, FFN 14336, vocabulary 32000, 8 experts in every layer, top-2; 46.7B parameters, 12.9B active
    mixtral = ModelSpec("mixtral-8x7b", 32, 4096, 32, 32000, 4096, ffn=14336, swiglu=True, bias=False, tied=False,
                        learned_pos=False, dropout=False, kv_heads=8, experts=8, top_k=2)
    assert round(mixtral.param_count() / 1e9, 1) == 46.7 and round(mixtral.active_params() / 1e9, 1) == 12.9
    dense = ModelSpec(**{**mixtral.__dict__, "experts": 0, "top_k": 1})
    expert = 3 * 4096 * 14336
    assert mixtral.param_count() - dense.param_count() == 32 * (7 * expert + 4096 * 8)     # 7 more MLPs, a router
    # per token: one MLP more than dense (top-2: 2 FLOPs per weight) and the router, forward and backward (3 x)
    tokens = mixtral.seq
    assert T.model_flops(mixtral, 1) - T.model_flops(dense, 1) == pytest.approx(
        3 * 32 * tokens * (2 * expert + 2 * 4096 * 8), rel=REL)
    switch = ModelSpec(**{**mixtral.__dict__, "moe_every": 2})                  # experts in every other layer
    assert switch.moe_layers == 16 and switch.param_count() == dense.param_count() + 16 * (7 * expert + 4096 * 8)
    for bad, words in ((dict(experts=1), "at least 2 experts"), (dict(top_k=9), "top_k <= experts"),
                       (dict(moe_every=0), "moe_every must be a positive integer")):
        with pytest.raises(ValueError, match=words):
            ModelSpec(**{**mixtral.__dict__, **bad})


def test_a_mixture_of_experts_keeps_its_routed_copies_activations_k_times():
    """Mixtral 8x7B routes each token to 2 experts: its MLP activations (SwiGLU: 8 f / h per token) and the experts'
    inputs (2) are kept for both copies; with experts in every other layer, half as many extra on average."""
    import dataclasses
    from parlab.cluster.costs import model_preset
    mixtral = model_preset("mixtral-8x7b")
    dense = dataclasses.replace(mixtral, experts=0, top_k=1)
    s, b, h, f = mixtral.seq, 1, mixtral.hidden, mixtral.ffn
    for tp, sp in ((1, False), (8, True)):
        extra = T.activation_bytes_per_layer(mixtral, b, tp, sp) - T.activation_bytes_per_layer(dense, b, tp, sp)
        assert extra == pytest.approx(s * b * h * (2 + 8 * f / h) / tp, rel=REL)     # one more copy of each
    half = dataclasses.replace(mixtral, moe_every=2)
    extra = T.activation_bytes_per_layer(half, b) - T.activation_bytes_per_layer(dense, b)
    assert extra == pytest.approx(s * b * h * (2 + 8 * f / h) / 2, rel=REL)
    assert T.activation_bytes_per_layer(mixtral, b, recompute="full") == T.activation_bytes_per_layer(dense, b,
                                                                                                     recompute="full")
