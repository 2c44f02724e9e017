"""Cost-model simulation of a schedule: makespan, bubble fraction, peak activations.

Every rank runs its list in order. A compute step starts when the rank is free and its
inputs exist: a forward needs the previous stage's forward of the same micro-batch, a
backward (B or I) its own forward and the next stage's backward, W its I. An input made on
another rank arrives ``comm_cost`` after it was produced. In a lowered list a recv step
blocks the rank until its data arrived; sends and other steps take no time.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import DataKey, MetaStep, MetaStepType, Schedule, consumes, message_key, produces
from .validate import ScheduleError

_T = MetaStepType
DEFAULT_COSTS: dict[MetaStepType, float] = {_T.FWD: 1.0, _T.BWD: 2.0, _T.BWD_INPUT: 1.0, _T.BWD_WEIGHT: 1.0}
"""Cost of each compute type; OVERLAP steps cost the sum of their sub-steps unless given."""


@dataclass
class SimulationResult:
    """What `simulate` predicts. ``timeline[rank]`` lists (start, end, step) of compute steps."""

    makespan: float
    bubble_fraction: float
    peak_activations: dict[int, int]
    timeline: dict[int, list[tuple[float, float, MetaStep]]]


def step_cost(step: MetaStep, costs: dict[MetaStepType, float]) -> float:
    """Duration of a compute step under ``costs`` (OVERLAP = sum of its parts by default)."""
    if step.meta_type in costs:
        return costs[step.meta_type]
    if step.meta_type.is_overlap:
        return sum(step_cost(part, costs) for part in step.parts)
    raise ValueError(f"no cost given for {step.meta_type.name} (step {step})")


def simulate(
    schedule: Schedule,
    stage_to_rank: dict[int, int],
    costs: dict[MetaStepType, float] | None = None,
    comm_cost: float = 0.0,
) -> SimulationResult:
    """Simulate a compute-only or lowered schedule; ScheduleError if it cannot finish."""
    table = {**DEFAULT_COSTS, **(costs or {})}
    for kind, cost in table.items():
        if cost < 0:
            raise ValueError(f"cost of {kind.name} must be >= 0, got {cost}")
    if comm_cost < 0:
        raise ValueError(f"comm_cost must be >= 0, got {comm_cost}")
    num_stages = len(stage_to_rank)
    made: dict[DataKey, tuple[float, int]] = {}
    clock = dict.fromkeys(schedule, 0.0)
    cursor = dict.fromkeys(schedule, 0)
    timeline: dict[int, list[tuple[float, float, MetaStep]]] = {rank: [] for rank in schedule}

    def arrival(key: DataKey, rank: int) -> float | None:
        if key not in made:
            return None
        time, where = made[key]
        return time + (comm_cost if where != rank else 0.0)

    progress = True
    while progress:
        progress = False
        for rank in sorted(schedule):
            steps = schedule[rank]
            while cursor[rank] < len(steps):
                step = steps[cursor[rank]]
                if step is not None:
                    recvs = [message_key(op) for op in step.comm_parts if op.meta_type.is_recv]
                    needs = recvs + [k for part in step.parts for k in consumes(part, num_stages)]
                    times = [arrival(key, rank) for key in needs if key is not None]
                    if any(t is None for t in times):
                        break
                    start = max([clock[rank], *times])
                    if step.meta_type.is_compute:
                        end = start + step_cost(step, table)
                        timeline[rank].append((start, end, step))
                        made.update((key, (end, rank)) for p in step.parts for key in produces(p))
                        start = end
                    clock[rank] = start
                cursor[rank] += 1
                progress = True
    stuck = [rank for rank in sorted(schedule) if cursor[rank] < len(schedule[rank])]
    if stuck:
        reason = "simulation cannot finish: ranks " + ", ".join(map(str, stuck)) + " wait forever"
        raise ScheduleError(reason, schedule, [(rank, cursor[rank]) for rank in stuck])
    return _summarize(schedule, timeline)


def _summarize(schedule: Schedule, timeline: dict) -> SimulationResult:
    makespan = max((end for steps in timeline.values() for _, end, _ in steps), default=0.0)
    busy = sum(end - start for steps in timeline.values() for start, end, _ in steps)
    capacity = len(schedule) * makespan
    bubble = 1.0 - busy / capacity if capacity > 0 else 0.0
    peaks = {rank: peak_activations(steps) for rank, steps in schedule.items()}
    return SimulationResult(makespan, bubble, peaks, timeline)


def peak_activations(steps: list[MetaStep | None]) -> int:
    """Most (stage, micro) pairs forwarded but not yet released (after B, or after W when
    the backward is split) at any point of one rank's list."""
    live = peak = 0
    for step in steps:
        if step is None:
            continue
        kinds = [part.meta_type for part in step.parts]
        live += kinds.count(_T.FWD)
        peak = max(peak, live)
        live -= kinds.count(_T.BWD) + kinds.count(_T.BWD_WEIGHT)
    return peak
