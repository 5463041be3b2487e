"""The layout planner: closed-form memory numbers, monotonicity, placement, clear errors, and its choice for
Megatron's published GPT-3 175B run (Narayanan et al., arXiv:2104.04473, table 1: t = 8, p = 8 on 1024 A100
80 GB GPUs with a global batch of 1536 sequences). Pure arithmetic: the whole file runs in about a second."""
import re

import pytest
import torch

from parlab.cluster import transformer as T
from parlab.cluster.costs import Cluster, ModelSpec, from_gpt_config, model_preset
from parlab.parallel.zero import measure
from parlab.models import GPT, GPTConfig
from parlab.cluster.plan_cli import main
from parlab.cluster.planner import enumerate_layouts, estimate, explain, format_table, format_volume_table, plan, \
    tiny_state_bytes, volume_table
from parlab.i18n import use_language
from parlab.i18n.columns import width
from parlab.parallel.topology import ParallelGrid

GB = 1e9
GPT3 = model_preset("gpt3-175b")
MEGATRON = Cluster(nodes=128)           # 128 DGX A100 80 GB nodes = 1024 GPUs, defaults: 312 TFLOP/s, NVLink, IB
MAT = dict(attention="materialised")   # Megatron's kernels of 2021-2022 wrote the scores out (the default is fused)


def test_parameter_counts_match_the_closed_forms_and_the_papers():
    # GPT-3: 12 h^2 + 13 h per layer + V h + s h (Megatron's eq. 2) + the final LayerNorm's 2 h
    assert GPT3.param_count() == 12 * 96 * 12288**2 + 13 * 96 * 12288 + 50257 * 12288 + 2048 * 12288 + 2 * 12288
    assert GPT3.param_count() == T.params(GPT3, final_norm=True)
    assert GPT3.param_count() / 1e9 == pytest.approx(174.6, abs=0.05)
    # LLaMA (SwiGLU, untied head, RMSNorm): 6.74B, 13.0B, 65.3B as released
    for name, billions in (("llama-7b", 6.74), ("llama-13b", 13.02), ("llama-65b", 65.29)):
        assert model_preset(name).param_count() / 1e9 == pytest.approx(billions, abs=0.01)
    bare = GPTConfig(n_layer=3, n_embd=48, n_head=4, vocab_size=50, bias=False, tie_embeddings=False)
    for cfg in (GPTConfig(), bare):
        assert from_gpt_config(cfg).param_count() == cfg.param_count()


def test_memory_closed_forms():
    one = Cluster(nodes=1, gpus_per_node=1, gpu_mem_gb=10_000)
    e = estimate(GPT3, one, 1, **MAT)
    psi = GPT3.param_count()
    assert e.params_bytes == pytest.approx(2 * psi)                       # 16-bit weights: ~350 GB
    assert e.params_bytes / GB == pytest.approx(349.2, abs=0.1)
    assert e.params_bytes + e.grads_bytes + e.optimizer_bytes == pytest.approx(16 * psi)   # 2 + 2 + 12
    s, h, a = 2048, 12288, 96                           # Korthikanti table 2, per layer, sequence parallel on
    assert e.activation_bytes == pytest.approx(96 * s * h * (34 + 5 * a * s / h))
    sp = estimate(GPT3, Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=10_000), 8, tp=8, **MAT)
    assert sp.activation_bytes == pytest.approx(96 * s * h * (34 + 5 * a * s / h) / 8)
    no_sp = estimate(GPT3, Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=10_000), 8, tp=8, sequence_parallel=False,
                     **MAT)
    assert no_sp.activation_bytes == pytest.approx(96 * s * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))


def test_step_time_terms_follow_their_formulas():
    e = estimate(GPT3, MEGATRON, 1536, tp=8, pp=8, zero=1)
    psi = GPT3.param_count()
    assert (e.dp, e.micro_batches) == (16, 96)
    s, h, l, V = 2048, 12288, 96, GPT3.vocab            # Megatron's model FLOPs (Korthikanti eq. 7), not 6 psi
    assert e.compute_s == pytest.approx(72 * 1536 * s * l * h ** 2 * (1 + s / (6 * h) + V / (12 * l * h))
                                        / (1024 * 312e12 * 0.5))
    assert e.compute_s / (6 * psi * 1536 * s / (1024 * 312e12 * 0.5)) == pytest.approx(1.03, abs=0.01)
    assert e.achieved_tflops == pytest.approx(T.model_flops(GPT3, 1536) / e.step_s / 1024 / 1e12)
    assert e.bubble_s == pytest.approx((8 - 1) / 96 * e.compute_s)       # 1F1B, relative to the ideal step
    assert e.volume["dp"] == pytest.approx(2 * 15 / 16 * 2 * GPT3.stage_params(8, 8))   # ring all-reduce
    assert e.volume["tp"] == pytest.approx(4 * 12 * 96 * 2 * 7 / 8 * 2 * 2048 * 12288)
    assert not e.crosses["tp"] and e.crosses["pp"] and e.crosses["dp"]
    assert e.tp_s == pytest.approx(e.volume["tp"] / 300e9)                # NVLink
    assert e.pp_s == pytest.approx(e.volume["pp"] / 25e9)                 # InfiniBand
    # TP beyond a node pays the inter-node bandwidth
    wide = estimate(GPT3, MEGATRON, 1536, tp=16, pp=4, zero=1)
    assert wide.crosses["tp"] and wide.tp_s == pytest.approx(wide.volume["tp"] / 25e9)
    assert wide.step_s > e.step_s


def test_monotonic_in_zero_stage_and_recomputation():
    totals = [estimate(GPT3, MEGATRON, 1536, tp=8, pp=8, zero=z).total_bytes for z in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    plain = estimate(GPT3, MEGATRON, 1536, tp=4, pp=8, zero=1, **MAT)   # selective recomputes materialised scores
    rc = estimate(GPT3, MEGATRON, 1536, tp=4, pp=8, zero=1, recompute=True, **MAT)
    assert rc.activation_bytes < plain.activation_bytes / 10
    assert rc.compute_s == pytest.approx(plain.compute_s * T.hardware_flops(GPT3, 1536, "full")
                                         / T.model_flops(GPT3, 1536)) and rc.step_s > plain.step_s
    sel = estimate(GPT3, MEGATRON, 1536, tp=4, pp=8, zero=1, recompute="selective", **MAT)
    assert rc.activation_bytes < sel.activation_bytes < plain.activation_bytes
    assert plain.compute_s < sel.compute_s < rc.compute_s
    assert (sel.recomputation, rc.recomputation, plain.recomputation) == ("selective", "full", "none")


def test_megatron_gpt3_layout_is_chosen():
    every = enumerate_layouts(GPT3, MEGATRON, 1536, **MAT)        # as Megatron ran it in 2021
    ranked = plan(GPT3, MEGATRON, 1536, **MAT)
    print("\n" + format_table(ranked, 5) + "\n" + explain(ranked, every))
    assert all(e.tp == 8 and e.pp > 1 for e in ranked[:5])     # TP fills a node, never leaves it; PP across
    # the published t = 8, p = 8 (dp = 16) is among the first three (it is first today; the next ones are
    # within 0.5%, below what this model can separate, so the test does not pin the exact rank)
    assert (8, 8, 16) in [(e.tp, e.pp, e.dp) for e in ranked[:3]]
    assert "tp=8" in explain(ranked, every)


def test_data_parallel_alone_does_not_fit_gpt3():
    cluster = Cluster(nodes=192)                               # 1536 GPUs: dp = 1536, one sequence each
    for zero in (0, 1, 2):
        for rc in (False, True):
            e = estimate(GPT3, cluster, 1536, zero=zero, recompute=rc)
            assert not e.fits and "GB" in e.reason
    assert estimate(GPT3, cluster, 1536).total_bytes > 16 * GPT3.param_count() > 80 * GB
    # ZeRO-3 shards all 16 psi over the 1536 ranks, so it fits: that is what FSDP is for
    assert estimate(GPT3, cluster, 1536, zero=3, recompute=True).fits


def test_volume_table_tp_over_dp_over_pp_on_seed_000_grid():
    grid = ParallelGrid(16, tp=2, pp=4, gpus_per_node=8)
    rows = volume_table(model_preset("llama-7b"), grid, global_batch=16)
    assert [r["dim"] for r in rows][:3] == ["tp", "dp", "pp"]
    link = {r["dim"]: r["crosses_nodes"] for r in rows}
    assert link == {"tp": False, "dp": False, "pp": True, "cp": False}


def test_clear_errors():
    with pytest.raises(ValueError, match="not divisible by heads"):
        ModelSpec("bad", layers=2, hidden=30, heads=4, vocab=10, seq=8)
    with pytest.raises(ValueError, match="nodes"):
        Cluster(nodes=0)
    with pytest.raises(ValueError, match="unknown model preset"):
        model_preset("gpt5")
    with pytest.raises(ValueError, match="no layout of llama-65b .* fits"):
        plan(model_preset("llama-65b"), Cluster(nodes=1, gpu_mem_gb=40), 16)
    odd = ModelSpec("odd", layers=3, hidden=64, heads=2, vocab=10, seq=8)
    with pytest.raises(ValueError, match="no valid layout"):
        enumerate_layouts(odd, Cluster(nodes=1), 3)
    with pytest.raises(ValueError, match="global batch"):
        enumerate_layouts(odd, Cluster(nodes=1), 0)


def test_main_prints_a_table(capsys):
    assert main(["--model", "llama-7b", "--nodes", "1", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "Best:" in out and "step s" in out and out.count("\n") > 8
    assert main(["--model", "llama-65b", "--gpu-mem-gb", "40"]) == 2
    assert "no layout" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "custom", "--layers", "2"])


def test_plan_command_uses_the_fused_attention_kernel_unless_told_otherwise(capsys):
    """FlashAttention (Dao et al. 2022) is the default since 2022: `parlab plan` says which kernel it assumed, and
    --attention materialised (the 2021-2022 Megatron runs) marks every layout that writes the scores out."""
    argv = ["--model", "llama-7b", "--nodes", "1", "--top", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "attention kernel: fused (FlashAttention)" in out
    best = next(line for line in out.splitlines() if line.startswith("Best:"))
    assert "materialised" not in best
    assert main(argv + ["--attention", "materialised"]) == 0
    out = capsys.readouterr().out
    assert "attention kernel: materialised" in out
    assert "materialised:" in next(line for line in out.splitlines() if line.startswith("Best:"))
    assert "runs as none" not in out                                  # selective is tried, materialised
    assert main(argv + ["--recompute", "selective"]) == 0             # asked for by name, fused: said why it is n
    assert "selective recomputation redoes the attention scores" in capsys.readouterr().out


def test_tiny_gpt_state_bytes_match_measured_bytes():
    # one process (dp = tp = pp = 1), fp32 AdamW: 4 + 4 + 8 bytes per parameter; measured / planned = 1
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.zeros(2, 8, dtype=torch.long)
    model(x, x)[1].backward()
    opt.step()
    got, want = measure(model.parameters(), opt), tiny_state_bytes(cfg)
    ratio = {k: got[k] / want[k] for k in want}
    # params and grads exactly; torch's AdamW also keeps a 4-byte `step` scalar per parameter tensor,
    # which the planner's K = 8 bytes per parameter leaves out (ratio 1.0006 here, -> 1 for large models)
    assert ratio["params"] == ratio["grads"] == 1.0
    n_tensors = len(list(model.parameters()))
    assert got["optimizer"] == want["optimizer"] + 4 * n_tensors
    assert ratio["total"] == pytest.approx(1.0, abs=1e-3)
    # sharded layouts: each stage / TP rank holds fewer bytes, ZeRO shards over dp
    assert tiny_state_bytes(cfg, tp=2)["params"] < want["params"]
    assert tiny_state_bytes(cfg, dp=2, zero=1)["optimizer"] == pytest.approx(want["optimizer"] / 2)


def test_planner_figures_show_every_layout_fit_or_not_and_the_best():
    from parlab.viz.planner import TERMS, breakdown_figure, planner_figure
    cluster = Cluster(nodes=4)
    every = enumerate_layouts(model_preset("llama-65b"), cluster, 128)
    ranked = plan(model_preset("llama-65b"), cluster, 128)
    fig = planner_figure(every, cluster, marks={"tp8 pp4": dict(tp=8, pp=4)})
    layouts = [t for t in fig.data if t.name.startswith("tp=")]
    assert sum(len(t.x) for t in layouts) == len(every)                   # one marker per candidate
    assert sum(len(t.x) for t in layouts if "does not fit" in t.name) == len(every) - len(ranked)
    star = next(t for t in fig.data if t.name.startswith("best:"))
    assert star.y[0] == ranked[0].step_s and ranked[0].layout in star.name
    assert any(t.name.startswith("tp8 pp4:") for t in fig.data)
    assert fig.layout.xaxis.type == "log" and fig.layout.shapes[0].x0 == pytest.approx(72.0)   # usable memory
    # its label: an annotation on a log axis takes log10(72), not 72 (which stretched the axis to 10^72)
    assert [a.x for a in fig.layout.annotations] == [pytest.approx(__import__("math").log10(72.0))]
    bars = breakdown_figure(ranked, top=5)
    assert [t.name for t in bars.data] == [label for _, label, _ in TERMS]
    totals = [sum(t.x[i] for t in bars.data) for i in range(5)]
    assert totals == pytest.approx([e.step_s for e in ranked[:5]])       # the terms add up to the step time
    with pytest.raises(ValueError, match="no estimate"):
        planner_figure(every, marks={"x": dict(tp=3)})


def test_interleaving_divides_the_bubble_by_v_and_keeps_more_activations():
    """Narayanan et al. section 2.2.2: bubble (p-1)/(v m) of the ideal step, v times the p2p messages; Korthikanti
    et al. eq. 6: the first stage holds (1 + (p-1)/(p v)) times 1F1B's activations."""
    plain = estimate(GPT3, MEGATRON, 1536, tp=8, pp=8, zero=1)
    for v in (2, 4):
        e = estimate(GPT3, MEGATRON, 1536, tp=8, pp=8, zero=1, virtual=v)
        assert e.bubble_s == pytest.approx((8 - 1) / (v * 96) * e.compute_s)
        assert e.activation_bytes == pytest.approx(plain.activation_bytes * (1 + 7 / (8 * v)))
        assert e.volume["pp"] == pytest.approx(v * plain.volume["pp"]) and f" v{v} " in e.layout
    with pytest.raises(ValueError, match="layers divisible by pp [*] virtual: pp 8, 96 micro-batches, 96 layers, "
                                         "virtual 5"):
        estimate(GPT3, MEGATRON, 1536, tp=8, pp=8, zero=1, virtual=5)
    with pytest.raises(ValueError, match="virtual must be a positive integer"):
        estimate(GPT3, MEGATRON, 1536, tp=8, pp=8, virtual=0)


def test_plan_command_tries_the_recomputation_settings_asked_for(capsys):
    """`parlab plan --recompute selective --no-sp`: every row selective (rc column "s"); without --no-sp the activations
    shrink by sequence parallelism; a setting that does not exist is refused by argparse in one line."""
    from parlab.cluster.plan_cli import main
    argv = ["--model", "gpt3-175b", "--nodes", "16", "--top", "3"]

    def rc_column():
        rows = [line for line in capsys.readouterr().out.splitlines() if "|" in line and line.split()[0].isdigit()]
        return [line.split("|")[0].split()[-1] for line in rows]
    # selective recomputation redoes the scores a materialising kernel wrote; the fused default keeps none
    assert main(argv + ["--recompute", "selective", "--no-sp", "--attention", "materialised"]) == 0
    assert rc_column() == ["s"] * 3
    assert main(argv + ["--recompute", "selective", "--no-sp"]) == 0
    assert rc_column() == ["n"] * 3
    assert main(argv + ["--recompute", "none"]) == 0
    assert rc_column() == ["n"] * 3
    with pytest.raises(SystemExit) as stop:
        main(argv + ["--recompute", "partial"])
    assert stop.value.code == 2 and "invalid choice: 'partial'" in capsys.readouterr().err


def test_plan_on_a_hardware_times_with_the_replays_cost_model(capsys):
    from parlab.cluster.hardware import hardware_preset
    assert main(["--model", "llama-7b", "--nodes", "2", "--hardware", "dgx-h100", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "timed on DGX H100 by the replay's cost model" in out and "Best:" in out
    # the same layout through estimate: the table's step time is the closed form's
    model, h100 = model_preset("llama-7b"), hardware_preset("dgx-h100")
    cluster = Cluster(nodes=2, gpus_per_node=8, intra_gbps=450.0, inter_gbps=50.0, peak_tflops=989.0)
    with_hw = estimate(model, cluster, 32, tp=2, pp=2, zero=1, hardware=h100)
    without = estimate(model, cluster, 32, tp=2, pp=2, zero=1)
    assert with_hw.step_s != without.step_s and with_hw.step_s > 0
    assert main(["--model", "llama-7b", "--hardware", "no-such-gpu"]) == 2
    assert "no hardware preset or file named 'no-such-gpu'" in capsys.readouterr().out


def test_enumerate_layouts_simulates_the_fastest_fitting_pipelines(monkeypatch):
    # every layout by the closed form, the SIMULATED fastest fitting ones with a pipeline again by running their
    # schedule (what estimate gives one layout by default); the rest keep the closed form's bubble
    import parlab.cluster.planner as P
    from parlab.cluster.hardware import hardware_preset
    monkeypatch.setattr(P, "SIMULATED", 3)
    model, hw = model_preset("llama-7b"), hardware_preset("dgx-a100")
    cluster = P.cluster_for(hw, 16)
    every = enumerate_layouts(model, cluster, 32, hardware=hw, micro_batches=(1,), zero_stages=(1,),
                              recompute=("selective",))
    piped = [e for e in every if e.pp > 1 and e.fits]
    timed = {s: [estimate(model, cluster, 32, tp=e.tp, pp=e.pp, cp=e.cp, zero=1, recompute="selective",
                          hardware=hw, simulate=s).step_s for e in piped] for s in (False, True)}
    assert len(piped) > 3 and all(a != b for a, b in zip(timed[False], timed[True]))
    best = sorted(range(len(piped)), key=lambda i: timed[False][i])[:3]
    assert [e.step_s for e in piped] == [timed[i in best][i] for i in range(len(piped))]


def test_plan_times_fp8_products_and_refuses_a_format_it_cannot_time(capsys):
    """`--precision fp8`: every layout faster than in bf16 (the header gives the fp8 peak); without --hardware
    (the MFU path knows no number format), or on an A100 (no FP8 tensor cores), it says what to do instead."""
    argv = ["--model", "llama-7b", "--nodes", "2", "--hardware", "dgx-h100", "--top", "1"]
    assert main(argv) == 0
    bf16 = capsys.readouterr().out
    assert main(argv + ["--precision", "fp8"]) == 0
    fp8 = capsys.readouterr().out
    assert "1979 TFLOP/s, timed on DGX H100, fp8" in fp8
    best = lambda out: float(out.split("Best:")[1].split(":")[1].split("s/step")[0])     # noqa: E731
    assert best(fp8) < 0.9 * best(bf16)
    with pytest.raises(SystemExit) as stop:
        main(["--model", "llama-7b", "--precision", "fp8"])
    assert stop.value.code == 2 and "give --hardware too" in capsys.readouterr().err
    assert main(["--model", "llama-7b", "--hardware", "dgx-a100", "--precision", "fp8"]) == 2
    assert "DGX A100 has no 'fp8' rate; its number formats: fp64, tf32, bf16, fp16" in capsys.readouterr().out


def test_plan_tries_interleaving_chunks_where_the_schedule_allows_them(capsys):
    model, cluster = model_preset("gpt3-175b"), Cluster(nodes=8)
    every = enumerate_layouts(model, cluster, 128, virtual=(1, 2, 3), micro_batches=(1,), zero_stages=(0,),
                              recompute=("selective",))
    chunked = [e for e in every if e.virtual > 1]
    assert chunked and all(e.pp > 1 and e.micro_batches % e.pp == 0 and 96 % (e.pp * e.virtual) == 0 for e in chunked)
    one = {(e.tp, e.pp, e.dp): e for e in every if e.virtual == 1}
    for e in chunked:                       # fewer chunk-times of fill and drain: a smaller bubble, same compute
        assert e.bubble_s < one[e.tp, e.pp, e.dp].bubble_s
    assert main(["--model", "llama-7b", "--nodes", "2", "--virtual", "1", "2", "--top", "3"]) == 0
    assert " v " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--virtual", "0"])


def test_plan_refuses_a_broken_hardware_description(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["--model", "llama-7b", "--hardware", str(bad)]) == 2
    assert "is not valid JSON" in capsys.readouterr().out
    zero_sms = tmp_path / "sms.json"
    zero_sms.write_text('{"name": "x", "peak_flops": 1e12, "mem_bw": 1e11, "intra_bw": 1e10, "inter_bw": 1e9, '
                        '"sms": 0}')
    assert main(["--model", "llama-7b", "--hardware", str(zero_sms)]) == 2
    assert "sms must be a positive integer" in capsys.readouterr().out


def test_every_plan_option_says_what_it_is(capsys):
    """`parlab plan --help`: each option is followed by its description (on its line or the next)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.split("options:")[1].splitlines()
    bare = [line.strip() for k, line in enumerate(lines)
            if line.startswith("  -") and "  " not in line.strip()                      # the option alone ...
            and not (k + 1 < len(lines) and lines[k + 1].startswith(" " * 10))]        # ... with nothing below
    assert bare == [], f"options without help: {bare}"


def _english_words(text: str, layouts) -> list[str]:
    """ASCII words of 3+ letters in `text` that are neither a layout's (or model's) name nor a term the Chinese keeps
    (units, hardware, collective names, the layout names' "sel"); no Python True/False in prose."""
    for layout in sorted(layouts, key=len, reverse=True):
        text = text.replace(layout, " ")
    text = re.sub(r"all-reduce|all-gather|reduce-scatter|TFLOP/s|TF/GPU|GB/GPU", " ", text)
    return [w for w in re.findall(r"[A-Za-z]{3,}", text) if w not in ("GPU", "GPUs", "ZeRO", "sel")]   # sel: the layout names' abbreviation


def test_the_plan_report_speaks_chinese_and_its_tables_line_up():
    """Lesson 07 prints the planner's table, its explanation and the volume table: in Chinese no English word is
    left, and every header column starts where its numbers do (a Chinese character takes two columns)."""
    small = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=40)
    with use_language("zh_CN"):
        every = enumerate_layouts(GPT3, MEGATRON, 1536)
        ranked = plan(GPT3, MEGATRON, 1536)
        crowded = enumerate_layouts(model_preset("llama-7b"), small, 64)
        tight = plan(model_preset("llama-7b"), Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=16), 64)
        table = format_table(ranked, 5) + "\n" + format_table([e for e in crowded if not e.fits][:2], None)
        text = "\n".join([table, explain(ranked, every), explain(tight, tight),
                          format_volume_table(volume_table(model_preset("llama-7b"), ParallelGrid(16, tp=2, pp=4, gpus_per_node=8),
                                                              64))])
        with pytest.raises(ValueError) as nothing_fits:
            plan(model_preset("llama-65b"), small, 64)
        text += "\n" + str(nothing_fits.value)
    layouts = {e.layout for e in every + crowded + tight} | {"llama-65b"}
    assert _english_words(text, layouts) == [], text
    assert "最优" in text and "放不下" in text
    for lang in ("en", "zh_CN"):
        with use_language(lang):
            head, _, *rows = format_table(ranked, 5).splitlines()[:-1]
        bars = {tuple(i for i in range(len(line)) if line[i] == "|") for line in rows}
        assert len(bars) == 1
        assert tuple(width(head[:i]) for i, c in enumerate(head) if c == "|") == bars.pop(), head
