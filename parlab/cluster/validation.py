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
    attention: str = "materialised"
    assumed: str = ""

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
        from parlab.parallel.pipeline import one_f_one_b
        return one_f_one_b(self.pp, self.micro_batches), Layout(
            tp=self.tp, pp=self.pp, dp=self.dp, micro_batch=self.micro_batch, recompute=self.recompute,
            sequence_parallel=self.sequence_parallel, zero=self.zero, attention=self.attention)

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

VALIDATION: list[MeasuredRun] = [
    *(MeasuredRun(f"GPT {b}B, {g} GPUs", _gpt(b, a, h, l), "dgx-a100", g, t, p, B, tf, "eq3", "[1] table 1",
                  "Megatron-LM", assumed=_MEGATRON) for b, a, h, l, t, p, g, B, tf in _TABLE1),
    *(MeasuredRun(f"GPT-3 175B PTD-P, {g} GPUs", _GPT175, "dgx-a100", g, 8, 12, 1536, tf, "eq3", "[1] table 2",
                  "Megatron-LM", assumed=_MEGATRON) for g, tf in ((384, 153), (768, 149), (1536, 141))),
    *(MeasuredRun(f"GPT 530B PTD-P, {g} GPUs", _GPT530, "dgx-a100", g, 8, 35, 2240, tf, "eq3", "[1] table 2",
                  "Megatron-LM", assumed=_MEGATRON) for g, tf in ((560, 171), (1120, 167), (2240, 159))),
    *(MeasuredRun(f"GPT-3 175B ZeRO-3, {g} GPUs", _GPT175, "dgx-a100", g, 1, 1, 1536, tf, "eq3", "[1] table 2",
                  "DeepSpeed ZeRO-3", micro_batch=b, zero=3, assumed=_ZERO3)
      for g, b, tf in ((384, 4, 144), (768, 2, 88), (1536, 1, 44))),
    *(MeasuredRun(f"Llama 3 405B, {g} GPUs", _LLAMA405, "dgx-h100", g, 8, 16, 2048, tf, "model", "[2] table 4",
                  "Meta (4D parallelism in PyTorch)", zero=1, recompute="none", sequence_parallel=True,
                  attention="fused", assumed=_LLAMA) for g, tf in ((8192, 430), (16384, 400))),
]

#: published runs the model cannot yet express, and why
NOT_EXPRESSED: dict[str, str] = {
    "[1] table 2, ZeRO-3 with 2-way model parallelism (768 and 1120 GPUs)":
        "the table does not say how the 2-way model parallelism was laid out",
    "[2] table 4, 16,384 GPUs with CP 16 at 131,072 tokens":
        "at s = 131,072 attention is over half the FLOPs and [2] does not say whether its count halves them for the "
        "causal mask; the step time it implies is uncertain by about 30%",
}
