"""Old module paths, from before parlab became a package per technique, still import.

A notebook a student saved earlier may say ``from parlab import schedules as sch`` or
``from parlab.tensor_parallel import ColumnParallelLinear``. Each old path in `MOVED` resolves to its new home,
and to the very same module object (``parlab.zero is parlab.parallel.zero.optimizer``), so monkeypatching and
the grader's guards see one module. ``python -m OLD`` runs the new module too.

How: a finder at the front of ``sys.meta_path`` (PEP 451) answers for the old names alone (None for any other, so
the usual finders go on): it imports the new module and hands it back as the old one. It must come first, or the
path finder would load ``parlab.grading.guard`` a second time from the moved package's folder. New code uses the new paths (a test keeps the
old ones out of the repository).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

#: old path -> new path (the module whose names the old one had; a face where the old module was split)
MOVED = {
    "parlab.meta_init": "parlab.parallel.meta_init",
    "parlab.trace_clock": "parlab.trace.clock",
    "parlab.wire": "parlab.trace.wire",
    "parlab.replay_meter": "parlab.trace.meter",
    "parlab.comm_direct": "parlab.comm.direct",
    "parlab.comm_strict": "parlab.comm.strict_mode",
    "parlab.rank_process": "parlab.launch.child",
    "parlab.torchrun": "parlab.launch.torchrun",
    "parlab.topology": "parlab.parallel.topology",
    "parlab.groups": "parlab.parallel.groups",
    "parlab.hybrid": "parlab.parallel.hybrid",
    "parlab.data_parallel": "parlab.parallel.data",
    "parlab.dp_comm": "parlab.parallel.data.buckets",
    "parlab.dp_loss": "parlab.parallel.data.loss",
    "parlab.meters": "parlab.parallel.data.meters",
    "parlab.zero": "parlab.parallel.zero.optimizer",
    "parlab.zero_comm": "parlab.parallel.zero.bucket_sync",
    "parlab.zero_flat": "parlab.parallel.zero.flat",
    "parlab.fsdp": "parlab.parallel.zero.fsdp",
    "parlab.memory": "parlab.parallel.zero.memory",
    "parlab.checkpoint": "parlab.parallel.zero.checkpoint",
    "parlab.mixed_precision": "parlab.parallel.zero.mixed_precision",
    "parlab.tensor_parallel": "parlab.parallel.tensor",
    "parlab.tp_comm": "parlab.parallel.tensor.mappings",
    "parlab.tp_loss": "parlab.parallel.tensor.loss",
    "parlab.tp_grads": "parlab.parallel.tensor.grads",
    "parlab.schedules": "parlab.parallel.pipeline",
    "parlab.schedule_sim": "parlab.parallel.pipeline.simulation",
    "parlab.p2p_plan": "parlab.parallel.pipeline.plan",
    "parlab.pipeline_p2p": "parlab.parallel.pipeline.p2p",
    "parlab.pipeline_parallel": "parlab.parallel.pipeline",
    "parlab.sequence_parallel": "parlab.parallel.context",
    "parlab.ring_attention": "parlab.parallel.context",
    "parlab.ring_plan": "parlab.parallel.context.ring_plan",
    "parlab.hardware": "parlab.cluster.hardware",
    "parlab.replay": "parlab.cluster.replay",
    "parlab.replay_program": "parlab.cluster.program",
    "parlab.scaleup": "parlab.cluster.scaleup",
    "parlab.costs": "parlab.cluster.costs",
    "parlab.planner": "parlab.cluster.planner",
    "parlab.formulas": "parlab.cluster.formulas",
    "parlab.calibrate": "parlab.cluster.calibrate.measure",
    "parlab.calibrate_comm": "parlab.cluster.calibrate.programs",
    "parlab.calibrate_compute": "parlab.cluster.calibrate.compute",
    "parlab.calibrate_report": "parlab.cluster.calibrate.report",
    "parlab.calibrate_special": "parlab.cluster.calibrate.special",
    "parlab.calibrate_step": "parlab.cluster.calibrate.step",
    "parlab.handout": "parlab.course.handout",
    "parlab.workspace": "parlab.course.workspace",
    "parlab.grading": "parlab.course.grading",
    "parlab.grader": "parlab.course.gradebook",
    "parlab.viz.check": "parlab.course.figcheck",
    # issue 39: names that collided with another module's
    "parlab.course.grader": "parlab.course.gradebook",
    "parlab.parallel.zero.comm": "parlab.parallel.zero.bucket_sync",
    "parlab.course.grading.sequence_parallel": "parlab.course.grading.ulysses",
    "parlab.data": "parlab.corpus",
}
#: moved packages: an old path under one of them is the same path under the new package
_PACKAGES = ("parlab.grading", "parlab.grader", "parlab.course.grader")


def new_name(old: str) -> str | None:
    """The new path of an old module path (its own entry, or under a moved package), or None."""
    if old in MOVED:
        return MOVED[old]
    for package in _PACKAGES:
        if old.startswith(package + "."):
            new = MOVED[package] + old[len(package):]
            return MOVED.get(new, new)                # a module renamed inside the moved package too
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module that lives under the new one."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.own_spec  # the import system set the old name's spec on it: put back its own

    def get_code(self, fullname):        # `python -m parlab.OLD` runs the new module's code
        return importlib.util.find_spec(self.new).loader.get_code(self.new)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), is_package=new.endswith(("grading", "gradebook")))


def install() -> None:
    """Put the finder at the front of sys.meta_path, once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
