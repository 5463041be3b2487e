"""The validation set (`parlab.cluster.validation`): transcribed as printed, and the cost model held to it."""
import pytest

from parlab.cluster import transformer as T
from parlab.cluster.hardware import hardware_preset
from parlab.cluster.scaleup import planner_estimate
from parlab.cluster.validation import NOT_EXPRESSED, VALIDATION


def test_every_run_is_transcribed_as_its_source_prints_it():
    table1 = [r for r in VALIDATION if r.source == "[1] table 1"]
    assert len(table1) == 10 and len(VALIDATION) >= 12
    for r in table1:
        # the printed parameter count is Megatron's eq. 2 of the printed heads, hidden size and layers
        printed = float(r.name.split("B")[0].split()[-1])
        assert round(T.params(r.model) / 1e9, 1) == pytest.approx(printed, abs=0.051)
    for r in VALIDATION:
        assert r.gpus == r.tp * r.pp * r.dp and r.global_batch == r.dp * r.micro_batch * r.micro_batches
        # the step time the throughput implies, back to the throughput
        f = T.hardware_flops(r.model, r.global_batch, "full") if r.flops == "eq3" else T.model_flops(r.model, r.global_batch)
        assert f / (r.step_s * r.gpus) / 1e12 == pytest.approx(r.tflops, rel=1e-12)   # float rounding only
    llama = [r for r in VALIDATION if r.model.name == "llama3-405b"]
    # [2] table 4: 16M tokens per batch, 32 and 16 sequences per data-parallel rank
    assert [(r.global_batch * r.model.seq // 2**20, r.global_batch // r.dp) for r in llama] == [(16, 32), (16, 16)]
    assert {r.source for r in VALIDATION} >= {"[1] table 1", "[1] table 2", "[2] table 4"}
    assert {r.hardware for r in VALIDATION} == {"dgx-a100", "dgx-h100"} and NOT_EXPRESSED


def test_the_cost_model_is_within_the_issues_bounds_on_the_megatron_runs_it_was_not_built_on():
    # the 16 Megatron rows of [1] tables 1 and 2, each with its stated layout and the source's one rule for what it
    # leaves unsaid; the planner (the replay's step: it runs the schedule as the replay does). The bounds are
    # issue 40's acceptance (10% mean, 20% worst), not a tolerance of ours; the other rows' errors and why are in
    # benchmarks/README.md
    errs = []
    for r in (r for r in VALIDATION if r.framework == "Megatron-LM"):
        t = planner_estimate(r.model, hardware_preset(r.hardware), r.replay_inputs()[1], r.global_batch).step_s
        errs.append(abs(t / r.step_s - 1))
    assert len(errs) == 16
    assert sum(errs) / len(errs) <= 0.10 and max(errs) <= 0.20


def test_the_mixture_of_experts_run_is_transcribed_as_its_source_states_it():
    (r,) = [r for r in VALIDATION if r.model.experts]
    # Mistral AI prints Mixtral 8x22B as 141B parameters, 39B active (with the run's Llama-2 vocabulary of 32000)
    assert round(r.model.param_count() / 1e9) == 141 and round(r.model.active_params() / 1e9) == 39
    # the ModelZoo's runtime.conf row: TP 2, PP 8, EP 8, VPP 7, GBS 256 on 16 nodes; the model config's expert TP 1
    assert (r.gpus, r.tp, r.pp, r.ep, r.etp, r.virtual, r.global_batch, r.tflops) == (128, 2, 8, 8, 1, 7, 256, 455)
    schedule, layout = r.replay_inputs()
    assert schedule.name.startswith("interleaved") and r.micro_batches == 32 and layout.gpus == 128
    assert (r.tp * r.dp) % (r.ep * r.etp) == 0                       # EP 8 folds onto the 16 tp x dp ranks
