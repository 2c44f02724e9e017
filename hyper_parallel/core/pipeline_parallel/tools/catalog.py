"""The schedule classes the tools know, by short name.

Any class with the classmethods ``generate(num_ranks, num_chunks, num_microbatches)`` and
``stage_placement(num_ranks, num_chunks)`` works with the simulator and the tuner; this
module only names the library's own (those not importable yet are left out) and resolves a
user's ``module:Class``.
"""

from __future__ import annotations

import importlib
from typing import Any

KNOWN: dict[str, tuple[str, int]] = {
    # short name: (class name in hyper_parallel.core.pipeline_parallel, default chunks per rank)
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
    "looped-bfs": ("ScheduleLoopedBFS", 2),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipev": ("ScheduleDualPipeV", 2),
}


def _library_class(class_name: str) -> Any | None:
    for module in ("hyper_parallel.core.pipeline_parallel", "hyper_parallel.core.pipeline_parallel.schedule"):
        try:
            found = getattr(importlib.import_module(module), class_name, None)
        except ImportError:
            found = None
        if found is not None:
            return found
    return None


def available_schedules() -> dict[str, Any]:
    """Short name -> class, for the library schedules importable in this version."""
    out = {}
    for name, (class_name, _) in KNOWN.items():
        cls = _library_class(class_name)
        if cls is not None:
            out[name] = cls
    return out


def default_chunks(schedule_class: Any) -> int:
    """Chunks per rank a schedule runs when none is asked for."""
    for class_name, chunks in KNOWN.values():
        if getattr(schedule_class, "__name__", None) == class_name:
            return chunks
    return max(1, int(getattr(schedule_class, "min_chunks", 1)))


def chunk_range(schedule_class: Any) -> tuple[int, int]:
    """(fewest, most) chunks per rank the class accepts (its ``min_chunks`` / ``max_chunks``
    when it has them; V schedules hold exactly 2)."""
    if getattr(schedule_class, "placement", None) == "v":
        return 2, 2
    low = int(getattr(schedule_class, "min_chunks", 1))
    high = int(getattr(schedule_class, "max_chunks", 64))
    return low, high


def resolve_schedule(name: str) -> tuple[str, Any]:
    """(short name, class) for a short name, a library class name or ``module:Class``."""
    available = available_schedules()
    if name in available:
        return name, available[name]
    for short, (class_name, _) in KNOWN.items():
        if name == class_name and short in available:
            return short, available[short]
    if name in KNOWN:
        raise ValueError(f"schedule {name!r} ({KNOWN[name][0]}) is not available in this version; "
                         f"available: {', '.join(available)}")
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load schedule class {name!r}: {exc}") from None
        for method in ("generate", "stage_placement"):
            if not callable(getattr(cls, method, None)):
                raise ValueError(f"{name} has no {method} classmethod")
        return class_name, cls
    raise ValueError(f"unknown schedule {name!r}; available: {', '.join(available)} (or module:Class)")
