"""Published training runs beyond Korthikanti's table 5, as data: the validation set the cost model is held to.

Korthikanti et al.'s eight runs (`parlab.cluster.published`) are the table the cost model was built against; the
runs here are the ones it was not: other papers, other frameworks and another GPU generation. Every run has the
layout its authors state and the throughput they measured, transcribed; `step_s` turns that throughput into the
step time it implies with the FLOP count the source uses. What a source does not state is assumed by one rule for
all its rows and written in `assumed`; nothing is fitted per row. `benchmarks/validation.py` replays them all.

    [1] D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
        SC 2021, arXiv:2104.04473: table 1 (GPT 1.7B-1T on up to 3072 A100s, Megatron PTD-P, achieved TFLOP/s per
        GPU counted with eq. 3, which includes full activation recomputation) and table 2 (GPT-3 175B and 530B with
        PTD-P at micro-batch 1, and with ZeRO-3 without model parallelism, DeepSpeed).
    [2] A. Grattafiori, A. Dubey et al., "The Llama 3 Herd of Models", arXiv:2407.21783, table 3 (the 405B model:
        126 layers, h 16384, FFN 53248, 128 heads, 8 key/value heads, vocabulary 128,000) and table 4 (its layouts
        on 8,192 and 16,384 H100s, TFLOP/s per GPU and BF16 MFU), section 3.3.
    [3] NVIDIA's Megatron-MoE-ModelZoo (github.com/yanring/Megatron-MoE-ModelZoo, by authors of "MoE Parallel
        Folding", arXiv:2504.14960): best_practice/Mixtral/run_mixtral_8x22B.sh at commit 0993e66 ("Dropless
        training, stable performance should be around 455TFLOPS for H100"), with the layout of its
        runtime_configs/benchmarking/runtime.conf (Mixtral-8x22B: TP 2, PP 8, EP 8, CP 1, VPP 7, MBS 1, GBS 256,
        56 layers, alltoall dispatcher, 16 nodes; commit 3a2d8b5) and model_configs/benchmarking/Mixtral-8x22B.yaml
        (expert TP 1, distributed optimizer, gradient-reduce and TP-communication overlap, sequence parallelism,
        flash attention, h 6144, FFN 16384, 48 heads, 8 query groups, 8 experts top-2, Llama-2 tokenizer, s 4096).
"""
from __future__ import annotations

from dataclasses import dataclass

from parlab.cluster import transformer as T
from parlab.cluster.costs import ModelSpec

__all__ = ["MeasuredRun", "VALIDATION", "NOT_EXPRESSED"]


@dataclass(frozen=True)
class MeasuredRun:
    """One published run: the model, the layout its source states, the throughput it measured (TFLOP/s per GPU,
    counted as `flops` says: "eq3" Narayanan's eq. 3 with full recomputation, "model" [2]'s model FLOPs)."""

    name: str
    model: ModelSpec
    hardware: str                    # a `parlab.cluster.hardware` preset
    gpus: int
    tp: int
    pp: int
    global_batch: int                # sequences per step
    tflops: float                    # measured, per GPU
    flops: str                       # how the source counts FLOPs: "eq3" or "model"
    source: str
    framework: str
    micro_batch: int = 1
    zero: int = 0
    recompute: str = "full"
    sequence_parallel: bool = False
    attention: str = "fused"         # the attention kernel; the 2021 runs of [1] materialised the scores
    assumed: str = ""
    ep: int = 1                      # expert parallelism, and the experts' tensor parallelism (None: tp)
    etp: int | None = None
    virtual: int = 1                 # interleaved 1F1B's model chunks per pipeline rank
    tp_overlap: bool = False
    dp_overlap: bool = False

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def replay_inputs(self) -> tuple:
        """(Schedule, step_costs.Layout) of the run as parlab replays it: plain 1F1B over its micro-batches, and
        the layout its source states (with the assumptions of `assumed`)."""
        from parlab.cluster.step_costs import Layout
        from parlab.parallel.pipeline import interleaved_1f1b, one_f_one_b
        schedule = (interleaved_1f1b(self.pp, self.micro_batches, self.virtual) if self.virtual > 1
                    else one_f_one_b(self.pp, self.micro_batches))
        return schedule, Layout(
            tp=self.tp, pp=self.pp, dp=self.dp, micro_batch=self.micro_batch, recompute=self.recompute,
            sequence_parallel=self.sequence_parallel, zero=self.zero, attention=self.attention, ep=self.ep,
            etp=self.etp, virtual=self.virtual, tp_overlap=self.tp_overlap, dp_overlap=self.dp_overlap)

    @property
    def step_s(self) -> float:
        """The step time the measured throughput implies: the source's FLOPs of one step / (TFLOP/s x GPUs)."""
        f = (T.hardware_flops(self.model, self.global_batch, "full") if self.flops == "eq3"
             else T.model_flops(self.model, self.global_batch))
        return f / (self.tflops * 1e12 * self.gpus)


def _gpt(b: str, heads: int, hidden: int, layers: int) -> ModelSpec:
    return ModelSpec(f"gpt-{b}b", layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048)


_MEGATRON = ("micro-batch 1 (table 1 does not print it; table 2's PTD-P runs use 1), plain 1F1B (which runs "
             "interleaved is not stated), full recomputation (eq. 3 counts it), no sequence parallelism (2022), "
             "materialised attention, the gradient all-reduce after the backward")
_ZERO3 = ("full recomputation (eq. 3 counts it), materialised attention; DeepSpeed's prefetch and bucket sizes are "
          "not stated: the model overlaps each micro-batch's gathers with its compute")
_LLAMA = ("micro-batch 1 and plain 1F1B over 126 layers split 8/7 per stage (Meta's own schedule and its tuning of "
          "micro-batches are not modelled), no recomputation, fused attention (FlashAttention), the distributed "
          "optimizer (zero 1) for Meta's FSDP without resharding, model FLOPs with full attention scores")

#: [1] table 1: (params as printed, heads, hidden, layers, t, p, GPUs, global batch, TFLOP/s per GPU)
_TABLE1 = [("1.7", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
           ("7.5", 32, 4096, 36, 4, 1, 128, 512, 142), ("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
           ("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140),
           ("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155),
           ("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163), ("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163)]

_GPT175, _GPT530 = _gpt("174.6", 96, 12288, 96), _gpt("529.6", 128, 20480, 105)
_LLAMA405 = ModelSpec("llama3-405b", layers=126, hidden=16384, heads=128, vocab=128000, seq=8192, ffn=53248,
                      swiglu=True, bias=False, tied=False, learned_pos=False, dropout=False, kv_heads=8)

_MIXTRAL = ("balanced routing (the run is dropless with an auxiliary loss: its experts' loads are not equal), "
            "interleaved 1F1B as stated, the distributed optimizer (zero 1), overlap as the config turns on "
            "(TP communication behind weight gradients, the gradient reduce behind the last backward); the "
            "all-to-alls not overlapped; model FLOPs (Megatron-LM's count for a mixture of experts without the "
            "router's, with full attention scores: the script does not print its FLOP count)")
_MIXTRAL_8X22B = ModelSpec("mixtral-8x22b", layers=56, hidden=6144, heads=48, vocab=32000, seq=4096, ffn=16384,
                           swiglu=True, bias=False, tied=False, learned_pos=False, dropout=False, kv_heads=8,
                           experts=8, top_k=2)

VALIDATION: list[MeasuredRun] = [
    *(MeasuredRun(f"GPT {b}B, {g} GPUs", _gpt(b, a, h, l), "dgx-a100", g, t, p, B, tf, "eq3", "[1] table 1",
                  "Megatron-LM", attention="materialised", assumed=_MEGATRON)
      for b, a, h, l, t, p, g, B, tf in _TABLE1),
    *(MeasuredRun(f"GPT-3 175B PTD-P, {g} GPUs", _GPT175, "dgx-a100", g, 8, 12, 1536, tf, "eq3", "[1] table 2",
                  "Megatron-LM", attention="materialised", assumed=_MEGATRON)
      for g, tf in ((384, 153), (768, 149), (1536, 141))),
    *(MeasuredRun(f"GPT 530B PTD-P, {g} GPUs", _GPT530, "dgx-a100", g, 8, 35, 2240, tf, "eq3", "[1] table 2",
                  "Megatron-LM", attention="materialised", assumed=_MEGATRON)
      for g, tf in ((560, 171), (1120, 167), (2240, 159))),
    *(MeasuredRun(f"GPT-3 175B ZeRO-3, {g} GPUs", _GPT175, "dgx-a100", g, 1, 1, 1536, tf, "eq3", "[1] table 2",
                  "DeepSpeed ZeRO-3", micro_batch=b, zero=3, attention="materialised",
                  assumed=_ZERO3)
      for g, b, tf in ((384, 4, 144), (768, 2, 88), (1536, 1, 44))),
    *(MeasuredRun(f"Llama 3 405B, {g} GPUs", _LLAMA405, "dgx-h100", g, 8, 16, 2048, tf, "model", "[2] table 4",
                  "Meta (4D parallelism in PyTorch)", zero=1, recompute="none", sequence_parallel=True,
                  attention="fused", assumed=_LLAMA) for g, tf in ((8192, 430), (16384, 400))),
    MeasuredRun("Mixtral 8x22B, 128 GPUs", _MIXTRAL_8X22B, "dgx-h100", 128, 2, 8, 256, 455, "model", "[3]",
                "Megatron-Core MoE", zero=1, recompute="none", sequence_parallel=True, attention="fused",
                assumed=_MIXTRAL, ep=8, etp=1, virtual=7, tp_overlap=True, dp_overlap=True),
]

#: published runs the model cannot yet express, and why
NOT_EXPRESSED: dict[str, str] = {
    "[1] table 2, ZeRO-3 with 2-way model parallelism (768 and 1120 GPUs)":
        "the table does not say how the 2-way model parallelism was laid out",
    "[2] table 4, 16,384 GPUs with CP 16 at 131,072 tokens":
        "at s = 131,072 attention is over half the FLOPs and [2] does not say whether its count halves them for the "
        "causal mask; the step time it implies is uncertain by about 30%",
}
