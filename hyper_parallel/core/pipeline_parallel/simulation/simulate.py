"""Timed simulation of a schedule: per-rank timelines, makespan, bubbles, peak activations.

`simulate` runs the step lists of all ranks together in the timed job model
(``timed_model.py``: the rules of ``job_model.py`` plus time), so a schedule that cannot
finish raises `ScheduleError` with the stuck steps marked. It takes a compute-only schedule
(a value made on another rank arrives one message time after it was made) or a lowered one
(send/recv steps with the eager or stream semantics of the transport).

Definitions (time in milliseconds; see ``costs.py``):

- ``makespan``: when the last rank finished (its last compute step, or a message it still
  waited for);
- ``busy[r]``: the sum of rank r's compute step times;
- ``bubble_per_rank[r] = 1 - busy[r] / makespan``; ``bubble_fraction = 1 - sum(busy) /
  (ranks * makespan)``, the idle share of all ranks' time;
- ``peak_activations[r]``: the most (stage, micro-batch) forwards rank r holds at once: a
  forward is held from its F until its B, or until its W when the backward is split;
  ``peak_activation_bytes[r]`` the same in bytes: ``activation_bytes`` of the stage from F,
  ``activation_bytes_after_input`` from I until W.

`simulate_schedule` does the whole chain for a schedule class: generate, place, lower,
simulate; without costs each rank's share of the model costs F = 1 and B = 2 (I = W = 1),
split evenly over its chunks, so schedules with different chunk counts compare in one unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter, itemgetter, sub
from typing import Any

from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, legacy_costs
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType, Schedule
from hyper_parallel.core.pipeline_parallel.simulation.fast_summary import fast_peaks
from hyper_parallel.core.pipeline_parallel.simulation.fast_timed import run_timed_fast
from hyper_parallel.core.pipeline_parallel.simulation.lazy_records import lazy_records, records_or_source
from hyper_parallel.core.pipeline_parallel.simulation.timed_model import run_timed
from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError

_T = MetaStepType
DEFAULT_COSTS: dict[MetaStepType, float] = {_T.FWD: 1.0, _T.BWD: 2.0, _T.BWD_INPUT: 1.0, _T.BWD_WEIGHT: 1.0}
"""Per-type costs used when none are given (every stage the same)."""


@lazy_records
@dataclass
class SimulationResult:
    """What `simulate` predicts (see the module docstring). ``timeline[rank]`` lists
    ``(start, end, step)`` of the compute steps; ``records`` is the trace of all ranks in the
    measured-trace format of ``trace.py`` (times in milliseconds here; made on first use)."""

    makespan: float
    bubble_fraction: float
    peak_activations: dict[int, int]
    timeline: dict[int, list[tuple[float, float, MetaStep]]]
    bubble_per_rank: dict[int, float] = field(default_factory=dict)
    peak_activation_bytes: dict[int, float] = field(default_factory=dict)
    busy: dict[int, float] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The numbers as plain JSON-ready data (ranks as string keys)."""
        ranks = sorted(self.timeline)
        return {
            "makespan_ms": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "bubble_percent": 100.0 * self.bubble_fraction,
            "ranks": [
                {
                    "rank": r,
                    "busy_ms": self.busy.get(r, 0.0),
                    "bubble_fraction": self.bubble_per_rank.get(r, 0.0),
                    "peak_activations": self.peak_activations.get(r, 0),
                    "peak_activation_bytes": self.peak_activation_bytes.get(r, 0.0),
                }
                for r in ranks
            ],
        }


def _cost_model(costs: CostModel | dict[MetaStepType, float] | None, comm_cost: float, num_stages: int) -> CostModel:
    if isinstance(costs, CostModel):
        if comm_cost:
            raise ValueError("give the message time in the CostModel (p2p_latency_ms), not as comm_cost")
        return costs.for_stages(num_stages)
    if costs is not None and not isinstance(costs, dict):
        raise TypeError(f"costs must be a CostModel or a dict of MetaStepType -> time, got {type(costs).__name__}")
    return legacy_costs(num_stages, {**DEFAULT_COSTS, **(costs or {})}, comm_cost)


def simulate(
    schedule: Schedule,
    stage_to_rank: dict[int, int],
    costs: CostModel | dict[MetaStepType, float] | None = None,
    comm_cost: float = 0.0,
    *,
    model: str = "eager",
    wait_at_post: bool = False,
    timelines: bool = True,
) -> SimulationResult:
    """Simulate a compute-only or lowered schedule; ScheduleError if it cannot finish.

    ``costs``: a `CostModel` (one entry per stage, or one for all), or the older per-type
    dict (``{MetaStepType.FWD: 1.0, ...}``, every stage the same; ``comm_cost`` is then the
    time of every message). ``model``: ``"eager"`` (gloo, the plain transport) or
    ``"stream"`` (NCCL/HCCL, the batch transport) for lowered lists; ``wait_at_post``: the
    communication steps wait for their receives. A `CostModel` with ``runtime`` costs (a
    machine file, ``machine.py``) also charges the runtime's own work per lowered step, and puts
    the first stage's I time into its W (that stage has no input gradient to compute), even when
    every runtime figure is 0; without a ``runtime`` object the prediction is the one of old.

    ``timelines=False`` asks for the numbers only (makespan, bubbles, busy times, peaks; what the
    tuner reads): the ``timeline`` lists may then be left empty and ``records`` with them.
    """
    table = _cost_model(costs, comm_cost, len(stage_to_rank))
    runtime = table.runtime  # present, even all 0: simulate as the runtime runs (monotonic from 0)
    outcome = None
    if runtime is None:  # the same run on compiled lists (fast_timed.py); None: the exact model must run
        with paused_gc():  # millions of tuples and floats without cycles: the collector would walk them again and again
            outcome = run_timed_fast(schedule, stage_to_rank, table.step_time, _link_time(table), lowered=None,
                                     model=model, wait_at_post=wait_at_post, timelines=timelines)  # None: a
            # list with send/recv or BATCH steps is a lowered one, as below
            if outcome is not None and outcome.finished:
                compiled = getattr(outcome, "compiled", None)
                peaks = None if compiled is None else fast_peaks(schedule, compiled, table)
                return _summarize(schedule, outcome.compute, outcome.finish, records_or_source(outcome), table,
                                  peaks, getattr(outcome, "busy", None))
    if outcome is None:
        step_time = table.step_time if runtime is None else _as_the_runtime_runs(table)
        outcome = run_timed(schedule, stage_to_rank, step_time, table.message_time, lowered=_has_communication(schedule),
                            model=model, wait_at_post=wait_at_post, runtime=runtime)
    if not outcome.finished:
        lines = []
        marks = []
        for rank, (index, wait) in sorted(outcome.stuck.items()):
            position = _position_of(schedule[rank], index)
            marks.append((rank, position))
            step = schedule[rank][position] if position < len(schedule[rank]) else "its end"
            lines.append(f"  rank {rank} is stuck at {step}, waiting for {wait}")
        stuck = ", ".join(str(rank) for rank in sorted(outcome.stuck))
        raise ScheduleError(f"simulation cannot finish: ranks {stuck} wait forever\n" + "\n".join(lines),
                            schedule, marks)
    return _summarize(schedule, outcome.compute, outcome.finish, records_or_source(outcome), table)


_COMM_TYPES = frozenset(t for t in MetaStepType if t.is_comm)
_TYPE_OF = attrgetter("meta_type")
_START, _END = itemgetter(0), itemgetter(1)


def _has_communication(schedule: Schedule) -> bool:
    """Whether any step is a send/recv or BATCH (a lowered list), without a Python loop per step."""
    return any(any(map(_COMM_TYPES.__contains__, map(_TYPE_OF, filter(None, steps)))) for steps in schedule.values())


def _busy(timeline: list[tuple[float, float, MetaStep]]) -> float:
    """``sum(end - start)`` over the steps, in their order (the same additions, made in C)."""
    return sum(map(sub, map(_END, timeline), map(_START, timeline)))


def _link_time(table: CostModel) -> Any:
    """``CostModel.message_time`` by (kind, stage): it does not depend on the micro-batch."""
    def link_time(kind: str, stage: int) -> float:
        return table.message_time((kind, stage, 0))
    return link_time


def _as_the_runtime_runs(table: CostModel) -> Any:
    """Step times as the runtime spends them: the first stage's input needs no gradient, so its
    input backward (I) has nothing to compute and its weight backward (W) runs its whole backward."""
    def step_time(step: MetaStep) -> float:
        if step.stage_index == 0 and step.meta_type in (_T.BWD_INPUT, _T.BWD_WEIGHT):
            first = table.stage(0)
            return 0.0 if step.meta_type is _T.BWD_INPUT else first.I + first.W
        return table.step_time(step)
    return step_time


def _position_of(steps: list[MetaStep | None], index: int) -> int:
    seen = -1
    for k, step in enumerate(steps):
        if step is not None:
            seen += 1
            if seen == index:
                return k
    return max(len(steps) - 1, 0)


def _summarize(schedule: Schedule, timeline: dict, finish: dict[int, float], records: Any, costs: CostModel,
               peaks_found: tuple[dict, dict] | None = None, busy: dict[int, float] | None = None,
               ) -> SimulationResult:
    makespan = max(finish.values(), default=0.0)
    if busy is None:
        busy = {rank: _busy(timeline[rank]) for rank in timeline}
    capacity = len(timeline) * makespan
    bubble = 1.0 - sum(busy.values()) / capacity if capacity > 0 else 0.0
    per_rank = {rank: (1.0 - busy[rank] / makespan if makespan > 0 else 0.0) for rank in timeline}
    if peaks_found is not None:  # the same numbers, counted with numpy (fast_summary.py)
        peaks, peak_bytes = peaks_found
    else:
        peaks = {rank: peak_activations(steps) for rank, steps in schedule.items()}
        peak_bytes = {rank: peak_activation_bytes(steps, costs) for rank, steps in schedule.items()}
    return SimulationResult(makespan, bubble, peaks, timeline, per_rank, peak_bytes, busy, records)


def peak_activations(steps: list[MetaStep | None]) -> int:
    """Most (stage, micro) pairs forwarded but not yet released (after B, or after W when
    the backward is split) at any point of one rank's list."""
    live = peak = 0
    for step in steps:
        if step is None:
            continue
        kind = step.meta_type
        if kind is _T.FWD:
            live += 1
            if live > peak:
                peak = live
        elif kind is _T.BWD or kind is _T.BWD_WEIGHT:
            live -= 1  # never above the peak: the count only rose at a forward
        elif kind.is_overlap:
            kinds = [part.meta_type for part in step.parts]
            live += kinds.count(_T.FWD)
            peak = max(peak, live)
            live -= kinds.count(_T.BWD) + kinds.count(_T.BWD_WEIGHT)
    return peak


def peak_activation_bytes(steps: list[MetaStep | None], costs: CostModel) -> float:
    """Like `peak_activations`, in bytes: a forward holds its stage's ``activation_bytes``,
    after its I only ``activation_bytes_after_input``, nothing after B or W."""
    held = {k: (s.activation_bytes, s.activation_bytes - s.activation_bytes_after_input, s.activation_bytes_after_input)
            for k, s in enumerate(costs.stages)}  # what F adds, I frees, W frees
    live = peak = 0.0
    for step in steps:
        if step is None:
            continue
        kind = step.meta_type
        if kind.is_overlap or (kind.is_compute and step.stage_index not in held):
            live, peak = _held_after(step, costs, live, peak)
            continue
        if kind is _T.FWD:
            live += held[step.stage_index][0]
        if live > peak:  # as max(peak, live), at every step: an I may free less than nothing
            peak = live
        if kind is _T.BWD:
            live -= held[step.stage_index][0]
        elif kind is _T.BWD_INPUT:
            live -= held[step.stage_index][1]
        elif kind is _T.BWD_WEIGHT:
            live -= held[step.stage_index][2]
    return peak


def _held_after(step: MetaStep, costs: CostModel, live: float, peak: float) -> tuple[float, float]:
    """One step of `peak_activation_bytes`, part by part (OVERLAP pairs, stages without costs)."""
    parts = step.parts
    for part in parts:
        if part.meta_type is _T.FWD:
            live += costs.stage(part.stage_index).activation_bytes
    peak = max(peak, live)
    for part in parts:
        stage = costs.stage(part.stage_index) if part.stage_index is not None else None
        if stage is None:
            continue
        if part.meta_type is _T.BWD:
            live -= stage.activation_bytes
        elif part.meta_type is _T.BWD_INPUT:
            live -= stage.activation_bytes - stage.activation_bytes_after_input
        elif part.meta_type is _T.BWD_WEIGHT:
            live -= stage.activation_bytes_after_input
    return live, peak


# ---------------------------------------------------------------------- whole chain


@dataclass
class PlannedSchedule:
    """A schedule class instantiated for (p, v, m): its compute lists, placement, lowered lists."""

    name: str
    num_ranks: int
    num_chunks: int
    num_microbatches: int
    compute: Schedule
    stage_to_rank: dict[int, int]
    lowered: dict[int, list[MetaStep]] | None


def plan_schedule(
    schedule_class: Any, num_ranks: int, num_chunks: int, num_microbatches: int, *,
    lowered: bool = True, transport: str = "plain", prefetch: bool = False, metadata: str = "none",
) -> PlannedSchedule:
    """Generate and place (and lower) a schedule of any class with the ``generate`` and
    ``stage_placement`` classmethods. The chunk count of the result is read off the placement
    (V schedules always hold 2 stages per rank)."""
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower

    placement = dict(schedule_class.stage_placement(num_ranks, num_chunks))
    compute = schedule_class.generate(num_ranks, num_chunks, num_microbatches)
    chunks = len(placement) // num_ranks
    low = lower(compute, placement, transport, metadata=metadata, prefetch=prefetch) if lowered else None
    return PlannedSchedule(getattr(schedule_class, "__name__", str(schedule_class)), num_ranks, chunks,
                           num_microbatches, compute, placement, low)


def simulate_schedule(
    schedule_class: Any, num_ranks: int, num_chunks: int, num_microbatches: int,
    costs: CostModel | None = None, *, lowered: bool = True, transport: str = "plain", prefetch: bool = False,
    metadata: str = "none", wait_at_post: bool = False, timelines: bool = True,
) -> tuple[PlannedSchedule, SimulationResult]:
    """`plan_schedule` then `simulate` (of the lowered lists when ``lowered``) with the
    transport's communication model; default costs: `CostModel.per_rank_share` (F=1, B=2)."""
    with paused_gc():  # the lists and the run's arrays live until the end: nothing for the collector
        plan = plan_schedule(schedule_class, num_ranks, num_chunks, num_microbatches, lowered=lowered,
                             transport=transport, prefetch=prefetch, metadata=metadata)
        if costs is None:
            costs = CostModel.per_rank_share(num_ranks, plan.num_chunks)
        model = "stream" if transport == "batch" else "eager"
        steps = plan.lowered if plan.lowered is not None else plan.compute
        result = simulate(steps, plan.stage_to_rank, costs.for_stages(len(plan.stage_to_rank)), model=model,
                          wait_at_post=wait_at_post, timelines=timelines)
    return plan, result
