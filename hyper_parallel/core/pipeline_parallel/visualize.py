"""Terminal charts of a schedule (from its simulation)."""

from __future__ import annotations

import math

from .ir import MetaStep, MetaStepType, Schedule
from .simulate import SimulationResult, simulate


def infer_stage_to_rank(schedule: Schedule) -> dict[int, int]:
    """Stage -> rank read off the compute steps of a schedule."""
    placement: dict[int, int] = {}
    for rank, steps in schedule.items():
        for step in steps:
            for part in step.parts if step is not None else ():
                if part.stage_index is None:
                    continue
                owner = placement.setdefault(part.stage_index, rank)
                if owner != rank:
                    raise ValueError(f"stage {part.stage_index} appears on ranks {owner} and {rank}")
    return dict(sorted(placement.items()))


def ascii_chart(
    schedule_or_result: Schedule | SimulationResult,
    stage_to_rank: dict[int, int] | None = None,
    costs: dict[MetaStepType, float] | None = None,
    comm_cost: float = 0.0,
    unit: float | None = None,
) -> str:
    """One row per rank, one column per ``unit`` of simulated time (default: the shortest
    step). A cell shows ``F3`` / ``B3`` (micro-batch 3), with ``.c`` appended for the rank's
    chunk c when ranks hold several stages; a step longer than one unit continues with
    ``-``; idle time is dots. Header: time ruler; footer: makespan, bubble, peak activations."""
    if isinstance(schedule_or_result, SimulationResult):
        result = schedule_or_result
    else:
        placement = stage_to_rank or infer_stage_to_rank(schedule_or_result)
        result = simulate(schedule_or_result, placement, costs, comm_cost)
    chunks = _chunk_indices(result)
    multi = any(len(stages) > 1 for stages in chunks.values())

    def label(rank: int, step: MetaStep) -> str:
        parts = step.parts or (step,)
        return "+".join(_part_label(part, chunks[rank] if multi else None) for part in parts)

    durations = [end - start for steps in result.timeline.values() for start, end, _ in steps]
    unit = unit or min((d for d in durations if d > 0), default=1.0)
    labels = {r: [label(r, step) for _, _, step in steps] for r, steps in result.timeline.items()}
    width = max((len(text) for texts in labels.values() for text in texts), default=1) + 1
    ncells = math.ceil(result.makespan / unit - 1e-9)
    head = f"rank {max(result.timeline, default=0)}"
    lines = [_ruler(ncells, width, unit, len(head))]
    for rank in sorted(result.timeline):
        row = ["." * (width - 1) + " "] * ncells
        free = 0
        for (start, end, _), text in zip(result.timeline[rank], labels[rank]):
            first = max(free, round(start / unit))
            last = max(first + 1, round(end / unit))
            span = (last - first) * width - 1
            row[first:last] = [text.ljust(span, "-") + " "] + [""] * (last - first - 1)
            free = last
        lines.append(f"{f'rank {rank}':<{len(head)}} |" + "".join(row).rstrip())
    peaks = " ".join(f"r{rank}={peak}" for rank, peak in sorted(result.peak_activations.items()))
    lines.append(
        f"makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}, "
        f"peak activations {peaks}"
    )
    return "\n".join(lines)


def _chunk_indices(result: SimulationResult) -> dict[int, dict[int, int]]:
    chunks: dict[int, dict[int, int]] = {}
    for rank, steps in result.timeline.items():
        stages = sorted({p.stage_index for _, _, s in steps for p in s.parts or (s,)} - {None})
        chunks[rank] = {stage: index for index, stage in enumerate(stages)}
    return chunks


def _part_label(part: MetaStep, chunk_of: dict[int, int] | None) -> str:
    text = part.meta_type.code + ("" if part.micro_index is None else str(part.micro_index))
    if chunk_of is not None and part.stage_index in chunk_of:
        text += f".{chunk_of[part.stage_index]}"
    return text


def _ruler(ncells: int, width: int, unit: float, indent: int) -> str:
    chars = [" "] * (ncells * width)
    for cell in range(0, ncells, 5):
        mark = f"{cell * unit:g}"
        at = cell * width
        if all(c == " " for c in chars[at : at + len(mark) + 1]):
            chars[at : at + len(mark)] = mark
    return f"{'time':<{indent}} |" + "".join(chars).rstrip()
