"""Schedule-driven activation swap (``swap=True`` on a schedule).

For every micro-batch whose backward comes at least ``swap_threshold`` compute slots after its
forward on this rank (slot = position in the rank's compute list, idle slots counted), a lowering
pass inserts, per stage and micro-batch:

* ``SWAP_LAUNCH_OFFLOAD`` right after the forward: start copying what the forward saved to host;
* ``SWAP_WAIT_OFFLOAD`` right after the next compute step: the copy is done, the device memory
  is released (the copy overlaps that compute);
* ``SWAP_LAUNCH_LOAD`` right before the compute step that precedes the backward (so the load
  overlaps it), or right before the backward when nothing lies between;
* ``SWAP_WAIT_LOAD`` right before the backward (``B``, or ``I`` with the dx/dW split; the data
  stays until ``W``).

Short gaps (the last ranks of 1F1B) stay resident: the copies would cost more than they save.
The steps touch only this rank (no communication), so validation and the job model skip them.
The handlers drive the platform's swap groups (``platform/activations``) through the forward
record: parameters, stage inputs and stage outputs are never swapped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from hyper_parallel.core.pipeline_parallel.features.memory_stats import track_memory
from hyper_parallel.core.pipeline_parallel.ir.placement import is_int
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.runtime.executor import PipelineRuntime
from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule, RunHook, register_feature

DEFAULT_SWAP_THRESHOLD = 4
_T = MetaStepType
SWAP_TYPES = (_T.SWAP_LAUNCH_OFFLOAD, _T.SWAP_WAIT_OFFLOAD, _T.SWAP_LAUNCH_LOAD, _T.SWAP_WAIT_LOAD)
Key = tuple[int, int]


def check_threshold(threshold: Any) -> int:
    if not is_int(threshold) or isinstance(threshold, bool):
        raise TypeError(f"swap_threshold must be an int (compute slots), got {threshold!r}")
    if threshold < 2:
        raise ValueError(f"swap_threshold must be >= 2 compute slots (a forward and its backward are at least "
                         f"one slot apart, and the offload needs one compute to overlap), got {threshold}")
    return int(threshold)


def swap_gaps(compute: list[MetaStep | None]) -> dict[Key, int]:
    """(stage, micro) -> slots from its forward to its backward (B, or I with the dx/dW split)."""
    fwd: dict[Key, int] = {}
    gaps: dict[Key, int] = {}
    for slot, step in enumerate(compute):
        for part in step.parts if step is not None else ():
            key = (part.stage_index, part.micro_index)
            if part.meta_type is _T.FWD:
                fwd[key] = slot
            elif part.meta_type in (_T.BWD, _T.BWD_INPUT) and key in fwd and key not in gaps:
                gaps[key] = slot - fwd[key]
    return gaps


def swapped_keys(compute: list[MetaStep | None], threshold: int) -> list[Key]:
    """The (stage, micro) pairs of one rank that swap: a gap of at least ``threshold`` slots."""
    return sorted(key for key, gap in swap_gaps(compute).items() if gap >= threshold)


def insert_swap_steps(steps: list[MetaStep], keys: list[Key]) -> list[MetaStep]:
    """``steps`` (one rank's lowered list) with the four swap steps of every key inserted."""
    where: dict[tuple[str, int, int], int] = {}  # (F|B, stage, micro) -> index of its compute step
    computes = [j for j, st in enumerate(steps) if st.meta_type.is_compute]
    for k, j in enumerate(computes):
        for part in steps[j].parts:
            kind = "F" if part.meta_type is _T.FWD else "B" if part.meta_type in (_T.BWD, _T.BWD_INPUT) else None
            if kind is not None:
                where.setdefault((kind, part.stage_index, part.micro_index), k)
    after: dict[int, list[tuple[int, MetaStep]]] = {}  # (order, step): waits of earlier forwards first
    before: dict[int, list[MetaStep]] = {}
    for s, i in keys:
        kf, kb = where.get(("F", s, i)), where.get(("B", s, i))
        if kf is None or kb is None or kb <= kf:
            continue
        wait_at = kf + 1 if kf + 1 < kb else kf
        load_at = kb - 1 if kb - 1 > wait_at else kb
        after.setdefault(kf, []).append((1, MetaStep(i, _T.SWAP_LAUNCH_OFFLOAD, s)))
        after.setdefault(wait_at, []).append((0 if wait_at > kf else 2, MetaStep(i, _T.SWAP_WAIT_OFFLOAD, s)))
        before.setdefault(load_at, []).append(MetaStep(i, _T.SWAP_LAUNCH_LOAD, s))
        before.setdefault(kb, []).append(MetaStep(i, _T.SWAP_WAIT_LOAD, s))
    out: list[MetaStep] = []
    k = 0
    for step in steps:
        if step.meta_type.is_compute:
            out += before.get(k, [])
            out.append(step)
            out += [st for _, st in sorted(after.get(k, []), key=lambda e: e[0])]
            k += 1
        else:
            out.append(step)
    return out


def swap_pass(threshold: int) -> Any:
    def lowering_pass(lowered: dict[int, list[MetaStep]], schedule: PipelineSchedule,
                      forward_only: bool) -> dict[int, list[MetaStep]]:
        if forward_only:
            return lowered
        return {rank: insert_swap_steps(steps, swapped_keys(schedule.compute_schedule[rank], threshold))
                for rank, steps in lowered.items()}

    return lowering_pass


@dataclass
class SwapRunState:
    """What the swap steps of one run did on this rank."""

    groups: dict[Key, Any] = field(default_factory=dict)
    swapped: list[Key] = field(default_factory=list)
    swapped_bytes: int = 0
    late_loads: int = 0


def _state(runtime: PipelineRuntime) -> SwapRunState:
    return runtime.extras.setdefault("swap", SwapRunState())


def _launch_offload(runtime: PipelineRuntime, step: MetaStep) -> None:
    key = (step.stage_index, step.micro_index)
    record = runtime.records.get(key)
    if record is None:
        return
    group = runtime.p.saved_tensors().offload(record)
    if group is not None:
        state = _state(runtime)
        state.groups[key] = group
        state.swapped.append(key)
        state.swapped_bytes += group.nbytes


def _wait_offload(runtime: PipelineRuntime, step: MetaStep) -> None:
    group = _state(runtime).groups.get((step.stage_index, step.micro_index))
    if group is not None:
        runtime.p.saved_tensors().finish_offload(group)


def _launch_load(runtime: PipelineRuntime, step: MetaStep) -> None:
    group = _state(runtime).groups.get((step.stage_index, step.micro_index))
    if group is not None:
        runtime.p.saved_tensors().load(group)


def _wait_load(runtime: PipelineRuntime, step: MetaStep) -> None:
    state = _state(runtime)
    group = state.groups.pop((step.stage_index, step.micro_index), None)
    if group is not None:
        runtime.p.saved_tensors().finish_load(group)
        state.late_loads += group.late_loads


class SwapHook(RunHook):
    """Fresh swap state per run; the last run's state is kept for ``memory_stats``."""

    def __init__(self) -> None:
        self.last: SwapRunState | None = None

    def before_run(self, schedule: PipelineSchedule, runtime: PipelineRuntime) -> None:
        runtime.extras["swap"] = SwapRunState()

    def after_run(self, schedule: PipelineSchedule, runtime: PipelineRuntime) -> None:
        state = _state(runtime)
        if state.groups:
            left = sorted(state.groups)
            raise RuntimeError(f"rank {runtime.rank}: swapped activations never loaded back: {left}")
        self.last = state


def enable_swap(schedule: PipelineSchedule, threshold: int = DEFAULT_SWAP_THRESHOLD) -> None:
    """Register schedule-driven swap on ``schedule`` (what ``swap=True`` does)."""
    threshold = check_threshold(threshold)
    schedule.swap_threshold = threshold
    hook = SwapHook()
    schedule.swap_hook = hook
    handlers = {_T.SWAP_LAUNCH_OFFLOAD: _launch_offload, _T.SWAP_WAIT_OFFLOAD: _wait_offload,
                _T.SWAP_LAUNCH_LOAD: _launch_load, _T.SWAP_WAIT_LOAD: _wait_load}
    schedule.add_feature(lowering_pass=swap_pass(threshold), handlers=handlers, hook=hook)
    track_memory(schedule)


def _set_up(schedule: PipelineSchedule, options: Mapping[str, Any]) -> None:
    if options.get("swap"):
        enable_swap(schedule, options.get("swap_threshold", DEFAULT_SWAP_THRESHOLD))


def register() -> None:
    """Make ``swap=True`` work on every schedule built from now on (``features/__init__`` calls this)."""
    register_feature("swap", _set_up, options=("swap", "swap_threshold"), order=10)
