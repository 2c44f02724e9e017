"""Fuse a backward and the forward right after it into one ``OVERLAP_B_F`` step.

A schedule's steady state alternates forwards and backwards. Where a backward (B or I) of
one stage is directly followed, on the same rank, by a forward of another stage (another
chunk of the rank) and another micro-batch, the two become one ``OVERLAP_B_F`` step with
sub-steps ``(backward, forward)``: a runtime that overlaps them (``CommComputeOverlap``)
hides one side's all-to-all behind the other side's compute.

A fused step starts once the inputs of both halves are there and hands its outputs on once
both ran, so fusing can add waits: after fusing, the compute job model (``job_model.py``)
runs the whole schedule, and every fused step a rank is stuck at is split back into its two
steps until the schedule finishes. The result is deterministic (the same on every rank).
"""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType, Schedule
from hyper_parallel.core.pipeline_parallel.lowering.job_model import run_job

_BACKWARDS = (MetaStepType.BWD, MetaStepType.BWD_INPUT)


def can_pair(backward: MetaStep | None, forward: MetaStep | None) -> bool:
    """Whether ``backward`` then ``forward`` may run as one overlapped step: a B or I and an F of
    different stages (chunks) and different micro-batches."""
    return (
        backward is not None and forward is not None
        and backward.meta_type in _BACKWARDS and forward.meta_type is MetaStepType.FWD
        and backward.stage_index != forward.stage_index and backward.micro_index != forward.micro_index
    )


def fuse_overlap_pairs(schedule: Schedule, stage_to_rank: dict[int, int]) -> Schedule:
    """``schedule`` with every adjacent (backward, forward) pair of `can_pair` fused into one
    ``OVERLAP_B_F`` step (left to right, each step in at most one pair), except the pairs whose
    fusion would deadlock the schedule (see the module docstring). Idle slots are kept and
    never fused across."""
    pairs = {rank: _candidates(steps) for rank, steps in schedule.items()}
    while True:
        fused = {rank: _fused(steps, pairs[rank]) for rank, steps in schedule.items()}
        outcome = run_job(fused, stage_to_rank, lowered=False)
        if outcome.finished:
            return fused
        split = False
        for rank, (index, _) in outcome.stuck.items():
            step = [s for s in fused[rank] if s is not None][index]
            if step.meta_type is MetaStepType.OVERLAP_B_F and step.sub_steps is not None:
                start = _position_of(schedule[rank], step.sub_steps[0])
                if start in pairs[rank]:
                    pairs[rank].discard(start)
                    split = True
        if not split:  # the schedule deadlocks without any fused step: validation reports it
            return fused


def _candidates(steps: list[MetaStep | None]) -> set[int]:
    chosen: set[int] = set()
    k = 0
    while k + 1 < len(steps):
        if can_pair(steps[k], steps[k + 1]):
            chosen.add(k)
            k += 2
        else:
            k += 1
    return chosen


def _fused(steps: list[MetaStep | None], starts: set[int]) -> list[MetaStep | None]:
    out: list[MetaStep | None] = []
    k = 0
    while k < len(steps):
        step = steps[k]
        if k in starts and step is not None and steps[k + 1] is not None:
            out.append(MetaStep(None, MetaStepType.OVERLAP_B_F, None, (step, steps[k + 1])))  # type: ignore[arg-type]
            k += 2
        else:
            out.append(step)
            k += 1
    return out


def _position_of(steps: list[MetaStep | None], step: MetaStep) -> int:
    return next(k for k, s in enumerate(steps) if s == step)
