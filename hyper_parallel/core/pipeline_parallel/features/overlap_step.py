"""The built-in runtime handler of ``OVERLAP_B_F`` / ``OVERLAP_F_B`` steps on a `CommComputeOverlap`.

A schedule given ``comm_compute_overlap=overlap`` runs every overlap pair through
``overlap.run(forward, backward)``: the forward and the backward run on two helper threads of
the rank that take turns at the sync points of the MoE layers wrapped by ``overlap``
(``wrap_dispatch`` / ``wrap_combine``), so one side's all-to-all is in flight while the other
side computes. Each side runs its sub-step exactly as the runtime would run it alone, including
the wait for its received input (a forward's activation, a backward's output gradient); the
receives themselves were posted before the pair, as for any compute step.

Without wrapped layers there are no sync points: the backward side (it holds the first turn)
runs to its end, then the forward side runs, the same as running the two sub-steps in
sequence. Without ``comm_compute_overlap`` the runtime runs the sub-steps in sequence itself.
``schedule.register_custom_function(MetaStepType.OVERLAP_B_F, fn)`` overrides this handler;
``ctx.run_default(step)`` in ``fn`` runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hyper_parallel.core.pipeline_parallel.features.overlap import CommComputeOverlap, OverlapError
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.runtime.executor import PipelineRuntime
from hyper_parallel.core.pipeline_parallel.schedule import CheckBeforeRun, PipelineSchedule, register_feature
from hyper_parallel.platform.base import WaitAborted

_T = MetaStepType
_BACKWARDS = frozenset({_T.BWD, _T.BWD_INPUT, _T.BWD_WEIGHT})


def split_pair(step: MetaStep) -> tuple[MetaStep, MetaStep]:
    """``(backward, forward)`` of an overlap step, whatever the order of its sub-steps."""
    subs = step.sub_steps or ()
    forwards = [s for s in subs if s.meta_type is _T.FWD]
    backwards = [s for s in subs if s.meta_type in _BACKWARDS]
    if len(subs) != 2 or len(forwards) != 1 or len(backwards) != 1:
        raise ValueError(f"{step}: an overlap step must hold one forward and one backward")
    return backwards[0], forwards[0]


class OverlapPairHandler:
    """Runs one overlap step of a `PipelineRuntime` through ``overlap.run``."""

    def __init__(self, overlap: CommComputeOverlap) -> None:
        if not isinstance(overlap, CommComputeOverlap):
            raise TypeError(f"comm_compute_overlap must be a CommComputeOverlap, got {overlap!r}")
        self.overlap = overlap

    def __call__(self, runtime: PipelineRuntime, step: MetaStep) -> None:
        backward, forward = split_pair(step)
        try:
            self.overlap.run(
                lambda: runtime.run_step(forward),
                lambda: runtime.run_step(backward),
                forward_micro=forward.micro_index,
                backward_micro=backward.micro_index,
            )
        except OverlapError as exc:  # names the side and its micro-batch; a StageError cause names the step
            if isinstance(exc.error, WaitAborted):  # the job stops: the error that says why is elsewhere
                raise exc.error from None
            raise


def check_stages_run_op_by_op(schedule: PipelineSchedule) -> None:
    """``comm_compute_overlap`` cannot work with compiled stages: the sync points of the wrapped
    MoE layers (and any Python-level all-to-all) are Python calls, which a compiled stage graph
    does not make at each step (measured on MindSpore: not one sync point fires under GRAPH_MODE,
    so the pairs would silently not overlap). Raises ValueError when the platform compiles them."""
    why = schedule.platform.compiled_stages()
    if why is not None:
        raise ValueError(
            f"{type(schedule).__name__}: comm_compute_overlap needs stages that run op by op, but {why}. The "
            "sync points of the MoE layers wrapped by wrap_dispatch/wrap_combine are Python calls that a "
            "compiled stage graph does not make at each step, so the pairs would not overlap (and a "
            "Python-level all-to-all cannot run inside a graph). Set HYPER_PARALLEL_MS_COMPILE=eager "
            "(or MindSporePlatform(compile='eager')), or drop comm_compute_overlap: the OVERLAP_B_F pairs "
            "then run their two halves one after the other, compiled"
        )


def check_schedule_has_pairs(schedule: PipelineSchedule) -> None:
    """Raise ValueError when the schedule makes no OVERLAP step for ``comm_compute_overlap`` to run,
    naming what would make one."""
    if any(st is not None and st.meta_type.is_overlap for steps in schedule.compute_schedule.values()
           for st in steps):
        return
    hint = "use ScheduleDualPipeV or ScheduleInterleaved1F1B(overlap_b_f=True)"
    if getattr(schedule, "overlap_b_f", False):  # it pairs, only not at this m
        least = schedule.min_overlap_microbatches(schedule.num_ranks)
        hint = (f"with overlap_b_f=True it makes its first pair at {least} micro-batches: run at least "
                f"{least} or drop comm_compute_overlap")
    raise ValueError(
        f"comm_compute_overlap runs overlapped (backward, forward) pairs, but this "
        f"{type(schedule).__name__} (p={schedule.num_ranks}, m={schedule.micro_batch_num}) has none: {hint}"
    )


def enable_comm_compute_overlap(schedule: PipelineSchedule, overlap: Any) -> None:
    """Run the schedule's overlap steps through ``overlap`` (see the module docstring)."""
    check_schedule_has_pairs(schedule)
    handler = OverlapPairHandler(overlap)
    check_stages_run_op_by_op(schedule)
    schedule.add_feature(handlers={_T.OVERLAP_B_F: handler, _T.OVERLAP_F_B: handler},
                         hook=CheckBeforeRun(check_stages_run_op_by_op))
    schedule.comm_compute_overlap = overlap


def _set_up(schedule: PipelineSchedule, options: Mapping[str, Any]) -> None:
    overlap = options.get("comm_compute_overlap")
    if overlap is not None:
        enable_comm_compute_overlap(schedule, overlap)


def register() -> None:
    """Make ``comm_compute_overlap=`` work on every schedule built from now on (``features/__init__``
    calls this)."""
    register_feature("overlap_step", _set_up, options=("comm_compute_overlap",), order=30)
