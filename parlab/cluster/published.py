"""Published training runs, as data: what parlab's cost model, planner and replay are held to.

Korthikanti et al. [1] trained four GPT models on NVIDIA's Selene (DGX A100 80 GB nodes, 312 TFLOP/s bf16 per
GPU) with tensor and pipeline parallelism, once with full activation recomputation and once with sequence
parallelism + selective recomputation ("present work"), and printed the step times with the MFU and HFU they
make (table 5). Table 3 gives each model and its layout; all four use s = 2048, V = 51200 and micro-batch 1.

`KORTHIKANTI` holds one `PublishedRun` per model and setting. Nothing here is computed: every number is the
paper's, transcribed, so a test can compare parlab's formulas with it (tests/test_transformer_costs.py).

    [1] V. Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023,
        arXiv:2205.05198, tables 3 (models and layouts) and 5 (step times, MFU, HFU).
    [2] M. Isaev et al., "Calculon: a Methodology and Tool for High-Level Codesign of Systems and Large Language
        Models", SC 2023; github.com/calculon-ai/calculon at caa4b11, validation/seqsel/tab5/*.json (the layouts
        it replays table 5 with) and its `llm-validation` command (its estimates, run here 2026-11-26).
"""
from __future__ import annotations

from dataclasses import dataclass

from parlab.cluster.costs import ModelSpec

__all__ = ["PublishedRun", "KORTHIKANTI_MODELS", "KORTHIKANTI", "SELENE_PEAK_FLOPS", "KORTHIKANTI_VIRTUAL",
           "CALCULON_TABLE5"]

SELENE_PEAK_FLOPS = 312e12          # A100 dense bf16, per GPU ([1] section 6; NVIDIA A100 datasheet)


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048)


#: [1] table 3: (model, tensor-parallel size, pipeline stages, GPUs, global batch)
KORTHIKANTI_MODELS: dict[str, tuple[ModelSpec, int, int, int, int]] = {
    "22B": (_gpt("gpt-22b", 48, 6144, 64), 8, 1, 8, 4),
    "175B": (_gpt("gpt-175b", 96, 12288, 96), 8, 8, 64, 64),
    "530B": (_gpt("gpt-530b", 105, 20480, 128), 8, 35, 280, 280),
    "1T": (_gpt("gpt-1t", 128, 25600, 160), 8, 64, 512, 512),
}


@dataclass(frozen=True)
class PublishedRun:
    """One row of [1] table 5: a model trained in one setting, its step time and the utilisation printed."""

    model_name: str
    recompute: str               # "full" or "selective"
    sequence_parallel: bool
    step_s: float                # seconds per iteration
    mfu: float                   # as printed, a fraction
    hfu: float

    @property
    def model(self) -> ModelSpec:
        return KORTHIKANTI_MODELS[self.model_name][0]

    @property
    def layout(self) -> dict:
        _, tp, pp, gpus, batch = KORTHIKANTI_MODELS[self.model_name]
        return {"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "gpus": gpus, "global_batch": batch,
                "micro_batch": 1}

    @property
    def virtual(self) -> int:
        """Model chunks per pipeline rank the run interleaved (`KORTHIKANTI_VIRTUAL`)."""
        return KORTHIKANTI_VIRTUAL[self.model_name]

    def replay_inputs(self) -> tuple:
        """(Schedule, step_costs.Layout) of the run as parlab replays it: micro-batch 1, m = global batch / dp
        micro-batches, 1F1B interleaved with `virtual` chunks when > 1."""
        from parlab.cluster.step_costs import Layout
        from parlab.parallel.pipeline import interleaved_1f1b, one_f_one_b
        lay, v = self.layout, self.virtual
        m = lay["global_batch"] // lay["dp"]
        schedule = interleaved_1f1b(lay["pp"], m, v) if v > 1 else one_f_one_b(lay["pp"], m)
        return schedule, Layout(tp=lay["tp"], pp=lay["pp"], dp=lay["dp"], recompute=self.recompute,
                                sequence_parallel=self.sequence_parallel, virtual=v,
                                attention="materialised")     # Megatron's kernels of 2022: the scores written out

    @property
    def label(self) -> str:
        return f"{self.model_name}, " + ("full recomputation" if self.recompute == "full"
                                         else "sequence parallel + selective recomputation")


#: [1] table 5, in its order.
KORTHIKANTI: list[PublishedRun] = [
    PublishedRun("22B", "full", False, 1.42, 0.323, 0.431),
    PublishedRun("22B", "selective", True, 1.10, 0.415, 0.437),
    PublishedRun("175B", "full", False, 18.13, 0.390, 0.519),
    PublishedRun("175B", "selective", True, 13.75, 0.514, 0.528),
    PublishedRun("530B", "full", False, 49.05, 0.432, 0.576),
    PublishedRun("530B", "selective", True, 37.83, 0.560, 0.570),
    PublishedRun("1T", "full", False, 94.42, 0.426, 0.568),
    PublishedRun("1T", "selective", True, 71.49, 0.563, 0.570),
]


#: model chunks per pipeline rank (the interleaved schedule) of each table 5 run: table 3 does not print them;
#: these are the ``pipeline_interleaving`` of Calculon's validation configurations [2] (175B: 12 layers per rank in
#: 3 chunks of 4; 530B: 3 layers per rank, one per chunk; 1T: plain 1F1B; 22B has no pipeline)
KORTHIKANTI_VIRTUAL: dict[str, int] = {"22B": 1, "175B": 3, "530B": 3, "1T": 1}

#: Calculon's own estimate of each table 5 step time, seconds, (full recomputation, SP + selective) [2]: an
#: analytical model with fitted efficiency curves, for comparison beside parlab's replay
CALCULON_TABLE5: dict[str, tuple[float, float]] = {"22B": (1.40, 1.14), "175B": (18.03, 13.64),
                                                   "530B": (49.89, 34.47), "1T": (90.08, 66.04)}
