"""parlab.cluster: the virtual cluster. What a run would cost on hardware this machine is not.

    from parlab.cluster import hardware, replay
    replay.replay(trace, hardware.hardware_preset("dgx-h100"), gpus_per_node=8)     # the same program, re-timed

Read in this order:

* ``formulas.py``   the closed forms lesson 00 quotes: speed-up, efficiency, training FLOPs, GPU-days (no torch).
* ``hardware.py``   `Hardware`: how fast a GPU computes (GEMMs in waves of tiles) and how fast its links move
                     bytes (DGX A100 / H100 presets, each number cited; or this machine, measured by
                     ``calibrate/``); ``hardware_checks.py`` the rules a description must satisfy;
                     ``collective_time.py`` how long a collective takes on it (ring, tree, all-to-all, messages).
* ``program.py``    a trace turned into per-rank programs: the ordered steps a replay re-times.
* ``replay.py``     `replay(trace, hardware)`: every rank's program re-timed on the hardware model, its waits
                     and overlaps kept; an ordinary trace comes back, drawn like any other.
* ``pipeline_program.py`` a pipeline step's program (every rank's actions, messages and waits) built from its
                     schedule, as a trace of the executor would record it, without running ranks.
* ``step_costs.py`` `Layout` and `StepCosts`: what every step of a big model's pipeline program costs (GEMMs by
                     shape, memory-bound ops, TP communication, recomputation, messages, gradient sync, Adam).
* ``layer_costs.py`` one layer's work on a GPU: its products' FLOPs, its memory-bound ops' bytes, fp8 casts.
* ``expert_costs.py`` a mixture of experts on a layout: expert parallelism folded onto the tp x cp x dp ranks,
                     the router and grouped expert products, the all-to-alls, the experts' states per rank.
* ``sync_costs.py`` `SyncCosts`: the gradient sync of each ZeRO stage and the Adam step, per pipeline rank.
* ``closed_form.py`` `step_terms`: the same costs added up in closed form (the planner's reading of the replay).
* ``pipeline_time.py`` `simulated_step`: a pipeline step timed by running its schedule with those costs under the
                     replay's rules (the planner's exact bubble), without building the program.
* ``scaleup.py``    a pipeline program (traced tiny run, or built) replayed as a named model (GPT-3 175B, GPT 1T)
                     on a big cluster.
* ``transformer.py`` the arithmetic of a dense GPT, one formula per function: parameters (Megatron eq. 2), model
                     and hardware FLOPs (eqs. 3, 7, 8), MFU and HFU, activations per layer (Korthikanti table 2), the
                     matrix products of a layer by shape.
* ``costs.py``      `ModelSpec` and `Cluster`: the model and cluster presets the estimates take (GPT-3, LLaMA; A100, H100).
* ``published.py``  published training runs as data (Korthikanti et al. tables 3 and 5) to hold the estimates to.
* ``validation.py`` a wider set of published runs (other papers, GPU generations and frameworks), each with its
                     stated layout, measured throughput and what we had to assume, replayed with nothing fitted.
* ``planner.py``    the layout search over (dp, tp, pp, cp, micro-batches, ZeRO stage, recomputation, schedule).
* ``plan_report.py`` the planner's answers as text: the ranked table, bytes per dimension, why the best is best.
* ``plan_cli.py``   ``parlab plan``: the planner on the command line.
* ``calibrate/``    measuring this machine (compute, messages, costs inside a real step) into a `Hardware`.

The virtual cluster reads traces, schedules (the pure data of ``parlab.parallel.pipeline``) and models, never
a technique's internals. This face imports nothing, so
``import parlab.cluster.formulas`` needs no torch.
"""
