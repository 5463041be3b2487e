"""parlab: learn how large models are trained on many GPUs by running it.

    import parlab
    res = parlab.run(fn, world_size=4, trace=True)   # simulated ranks (gloo on CPU) or one GPU per rank
    ctx = parlab.init()                               # the same code under torchrun or srun

The map of the library, in the order its imports run (each package's ``__init__`` is the map of its chapter):

    i18n/       the course's two languages (English, 简体中文): the language in force, gettext catalogues, the
                command lines' argument parser
    trace/      what the ranks did: events, regions, the byte model, the cost meter            (pure data)
    comm/       the only place that talks: traced collectives and point-to-point, strict mode
    launch/     starting ranks: run() for simulated ranks, init() under torchrun / srun
    models/     the tiny GPT (and its MoE MLP) every technique shards;  corpus.py  a shipped character data set
    parallel/   the techniques: data/, zero/, tensor/, pipeline/, context/, expert/ on a topology; hybrid.py composes them
    cluster/    the virtual cluster: hardware, replay, scale-up, cost model, planner, calibration
    viz/        plotly figures and widgets, drawn from traces, spans and grids
    course/     notebooks, the student's workspace, handouts, figure checks, grading, ``parlab grade``
    labs/       the techniques as ``torchrun -m parlab.labs.NAME`` scripts;  cli.py  the ``parlab`` command

A package imports only from the lines above it; no technique imports another. The module paths of the earlier
flat layout still import: ``_moved.py`` maps each to its new home. ``_deferred_imports.py`` spares every kernel
a third-party import that costs two seconds. The names below load on first use, so
``import parlab.cluster.formulas`` needs no torch.
"""
from __future__ import annotations

import importlib

from parlab import _deferred_imports, _moved

_moved.install()
_deferred_imports.defer_iri_grammars()

__version__ = "0.1.0"
#: public name -> the module it lives in
_LAZY = {"run": "parlab.launch.ranks", "RunResult": "parlab.launch.ranks", "RankError": "parlab.launch.blame",
         "RankTimeout": "parlab.launch.blame", "RankKilled": "parlab.launch.blame",
         "init": "parlab.launch.torchrun", "Context": "parlab.launch.torchrun",
         "Trace": "parlab.trace.events", "region": "parlab.trace.events",
         "comm": "parlab.comm", "trace": "parlab.trace"}
__all__ = ["run", "init", "Context", "RunResult", "RankError", "RankTimeout", "RankKilled", "Trace", "region",
           "comm", "trace"]


def __getattr__(name: str):
    """PEP 562: `parlab.run`, `parlab.comm`, ... import their module on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module 'parlab' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if module.__name__ == f"parlab.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
