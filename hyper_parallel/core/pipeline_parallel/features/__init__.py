"""Features that plug into a schedule through its one seam, ``PipelineSchedule.add_feature``.

Each feature is a lowering pass (steps it inserts after the point-to-point lowering), handlers
for its step types, and a run hook. Those behind a constructor option register themselves with
``schedule.register_feature`` when this package is imported (``hyper_parallel.core.pipeline_parallel``
imports it), so the schedule class knows no feature by name: ``swap`` (schedule-driven activation
swap), ``memory_stats`` (activation memory of a run), ``compiled_check`` (refuses activation
features where stages run compiled), ``overlap`` + ``overlap_step`` (``overlap_b_f``: one
side's communication in flight while the other computes), ``mpipe`` (the MPipe transpose
schedule, its planner and its model). FSDP's steps live with FSDP (``core/fully_shard``).

May import: the core (``ir``, ``lowering``, ``runtime``, ``schedule``), ``simulation`` and the
platform. Never the tools; the core never imports a feature.
"""

from hyper_parallel.core.pipeline_parallel.features import compiled_check, memory_stats, overlap_step, swap

# each states its order (swap 10, compiled_check 20, overlap_step 30): the order the constructor ran
# them in when it called them by name; the order of these calls does not matter
for _feature in (swap, compiled_check, overlap_step, memory_stats):
    _feature.register()

__all__ = ["compiled_check", "memory_stats", "overlap_step", "swap"]
