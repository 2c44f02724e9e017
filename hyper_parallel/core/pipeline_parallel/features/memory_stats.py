"""Activation memory of the last run of a schedule on this rank: ``track_memory`` / ``memory_stats``.

Measured from what the forwards packed for their backward (saved-tensor hooks on both frameworks)
and the storage sizes of those tensors, not from allocator totals:

* ``peak_saved_bytes`` -- the largest total, during the run, of the distinct storages that saved
  activations held on the compute device (parameters and buffers excluded; an offloaded tensor
  counts from its load on; a load in flight counts). Sampled after every stage forward, every
  recompute and every swap load, the only moments it can grow.
* ``peak_output_bytes`` -- the largest total, at the same moments, of the stage outputs still
  holding data (an output is released once sent, unless its own graph saved it; MindSpore keeps
  them: ``release_storage`` is a no-op there).
* ``swapped`` -- the (stage, micro-batch) pairs whose saved activations went to host memory
  (schedule-driven swap), ``swapped_bytes`` their size, ``late_loads`` how many were read back by
  a backward before their load step (0 when the schedule's swap steps are right).

Tracking costs a walk over the live saved tensors at every sample; it is on once
``track_memory(schedule)`` was called, and always with ``swap=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.pipeline_parallel.runtime.executor import PipelineRuntime
from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule, RunHook, register_feature


@dataclass(frozen=True)
class MemoryStats:
    """Activation memory of one run on one rank (see the module docstring)."""

    rank: int
    peak_saved_bytes: int
    peak_output_bytes: int
    swapped: tuple[tuple[int, int], ...]
    swapped_bytes: int
    late_loads: int
    samples: int

    @property
    def swapped_micro_batches(self) -> dict[int, list[int]]:
        """Stage index -> the micro-batches swapped on it."""
        out: dict[int, list[int]] = {}
        for stage, micro in self.swapped:
            out.setdefault(stage, []).append(micro)
        return {s: sorted(m) for s, m in sorted(out.items())}


class MemoryHook(RunHook):
    def __init__(self) -> None:
        self.last: MemoryStats | None = None

    def before_run(self, schedule: PipelineSchedule, runtime: PipelineRuntime) -> None:
        support = runtime.p.saved_tensors()
        modules = [st.submodule for st in schedule.stages]
        support.start_tracking(modules, records=lambda: list(runtime.records.values()))

    def after_run(self, schedule: PipelineSchedule, runtime: PipelineRuntime) -> None:
        tracker = runtime.p.saved_tensors().stop_tracking()
        swap = runtime.extras.get("swap")
        self.last = MemoryStats(
            rank=runtime.rank,
            peak_saved_bytes=tracker.peak_saved_bytes if tracker else 0,
            peak_output_bytes=tracker.peak_output_bytes if tracker else 0,
            swapped=tuple(swap.swapped) if swap else (),
            swapped_bytes=swap.swapped_bytes if swap else 0,
            late_loads=swap.late_loads if swap else 0,
            samples=tracker.samples if tracker else 0,
        )

    def on_failure(self, schedule: PipelineSchedule) -> None:
        schedule.platform.saved_tensors().stop_tracking()


def track_memory(schedule: PipelineSchedule) -> None:
    """Measure activation memory in every following training run of ``schedule`` (idempotent)."""
    if getattr(schedule, "memory_hook", None) is None:
        hook = MemoryHook()
        schedule.memory_hook = hook
        schedule.add_feature(hook=hook)


def memory_stats(schedule: PipelineSchedule) -> MemoryStats:
    """The activation memory of the last training run of ``schedule`` on this rank."""
    hook: Any = getattr(schedule, "memory_hook", None)
    if hook is None:
        raise RuntimeError("memory tracking is off for this schedule: call "
                           "hyper_parallel.core.pipeline_parallel.features.memory_stats.track_memory(schedule) before run() "
                           "(swap=True turns it on)")
    if hook.last is None:
        raise RuntimeError("memory_stats() needs a training run of the schedule after track_memory(schedule)")
    return hook.last


def register() -> None:
    """Answer ``schedule.memory_stats()`` (``features/__init__`` calls this)."""
    register_feature("memory_stats", reader=memory_stats)
