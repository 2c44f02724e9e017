"""Old module paths of ``pipeline_parallel`` (before its role sub-packages) still import.

Before the role sub-packages every module sat flat in ``hyper_parallel/core/pipeline_parallel/``; docs and
user code import some of them (``...pipeline_parallel.simulate``, ``...pipeline_parallel.overlap``,
``...pipeline_parallel.split_layers`` ...). Importing an old path gives the module at its new home
(the same module object, so patches and ``isinstance`` agree). New code should use the new path.
The table is the whole list; ``ir``, ``lowering`` and ``runtime`` need no entry: they are the
names of packages now, which re-export the public names their modules held.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

PACKAGE = "hyper_parallel.core.pipeline_parallel"
MOVED = {
    "agreement": "runtime.agreement",
    "catalog": "tools.catalog",
    "compiled_check": "features.compiled_check",
    "costs": "simulation.costs",
    "dtensor_boundary": "runtime.dtensor_boundary",
    "gc_pause": "lowering.gc_pause",
    "grad_state": "runtime.grad_state",
    "job_model": "lowering.job_model",
    "memory_stats": "features.memory_stats",
    "meta": "runtime.meta",
    "microbatch": "runtime.microbatch",
    "mpipe": "features.mpipe.transpose",
    "mpipe_model": "features.mpipe.model",
    "mpipe_plan": "features.mpipe.plan",
    "order_search": "tools.order_search",
    "overlap": "features.overlap",
    "overlap_step": "features.overlap_step",
    "partition": "simulation.partition",
    "placement": "ir.placement",
    "plan_cache": "lowering.plan_cache",
    "profile": "tools.profile",
    "schedule_csv": "ir.schedule_csv",
    "shared_params": "runtime.shared_params",
    "simulate": "simulation.simulate",
    "split_layers": "tools.split_layers",
    "stage": "runtime.stage",
    "swap": "features.swap",
    "timed_model": "simulation.timed_model",
    "trace": "tools.trace",
    "tracing": "runtime.tracing",
    "tune": "tools.tune",
    "validate": "lowering.validate",
    "visualize": "tools.visualize",
    "wait_watch": "runtime.wait_watch",
}
"""Old module name (relative to ``PACKAGE``) -> where it lives now."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the old names of moved modules with the modules at their new paths."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix = PACKAGE + "."
        if not fullname.startswith(prefix) or fullname[len(prefix):] not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(f"{PACKAGE}.{MOVED[spec.name[len(PACKAGE) + 1:]]}")
        spec.loader_state = module.__spec__  # the import system sets module.__spec__ = spec next
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = module.__spec__.loader_state  # the module keeps its own spec (reload, tools)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once per process."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())  # before PathFinder: a stale old file never wins
