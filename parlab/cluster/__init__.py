"""parlab.cluster: the virtual cluster. What a run would cost on hardware this machine is not.

    from parlab.cluster import hardware, replay
    replay.replay(trace, hardware.preset("dgx-h100"), gpus_per_node=8)     # the same program, re-timed

Read in this order:

* ``formulas.py``   the closed forms lesson 00 quotes: speed-up, efficiency, training FLOPs, GPU-days (no torch).
* ``hardware.py``   `Hardware`: how fast a GPU computes and how fast its links move bytes (DGX A100 / H100
                     presets, each number cited; or this machine, measured by ``calibrate/``).
* ``program.py``    a trace turned into per-rank programs: the ordered steps a replay re-times.
* ``replay.py``     `replay(trace, hardware)`: every rank's program re-timed on the hardware model, its waits
                     and overlaps kept; an ordinary trace comes back, drawn like any other.
* ``scaleup.py``    a tiny pipeline run replayed as a named model (GPT-3 175B) on a big cluster.
* ``transformer.py`` the arithmetic of a dense GPT, one formula per function: parameters (Megatron eq. 2), model
                     and hardware FLOPs (eqs. 3, 7, 8), MFU and HFU, activations per layer (Korthikanti table 2).
* ``costs.py``      the cost model of one training step: model and cluster presets, per-GPU memory and time.
* ``published.py``  published training runs as data (Korthikanti et al. tables 3 and 5) to hold the estimates to.
* ``planner.py``    the layout search over (dp, tp, pp, cp, micro-batches, ZeRO stage, recomputation):
                     ``parlab plan``.
* ``plan_report.py`` the planner's answers as text: the ranked table, bytes per dimension, why the best is best.
* ``calibrate/``    measuring this machine (compute, messages, costs inside a real step) into a `Hardware`.

The virtual cluster reads traces and models, never a technique's internals. This face imports nothing, so
``import parlab.cluster.formulas`` needs no torch.
"""
