"""parlab.cluster.calibrate: measure this machine into a `parlab.cluster.hardware.Hardware` description.

    parlab calibrate --world 2 --out here.json         # or: python -m parlab.cluster.calibrate

Read in this order:

* ``measure.py``   the procedure: time collectives of growing size and single ops on every rank, fit the
                    alpha-beta link model and the roofline compute model, write the description (`calibrate`,
                    `measure_rank`, `describe`, `main`).
* ``fit.py``       the least-squares fits (rates >= 0, on relative error) and the alpha-beta link model.
* ``compute.py``   the compute samples (products, batched products, adds, copies) and their fits.
* ``special.py``   the rate of special functions (exp, log, erf).
* ``step.py``      what single ops and isolated messages do not show: per-op, per-byte and per-message costs
                    inside a real training step, and the overlap of communication with compute.
* ``programs.py``  the traced training steps (DDP, ZeRO-3, 1F1B, ring attention) both the calibration and the
                    replay benchmark time.
* ``report.py``    the printed report: nccl-tests-like rows and how well each fit matches.
"""
from parlab.cluster.calibrate.compute import fit_compute, fit_roofline
from parlab.cluster.calibrate.fit import fit_alpha_beta, fit_rates
from parlab.cluster.calibrate.measure import SIZES, calibrate, default_world, describe, main, measure_rank

__all__ = ["calibrate", "measure_rank", "describe", "main", "SIZES", "default_world", "fit_alpha_beta", "fit_rates",
           "fit_compute", "fit_roofline"]
