"""The compact chart's slot letters (numpy, ``_majority_row``) against the loop they replaced.

The loop below is the code before the change, kept as the oracle: for each step and each slot it
touches, add its overlap to the slot's amount of its letter; a slot shows the letter with the most
(the first filled among equal), idle when idle time was more. The sums decide ties, so the new
code must give the very same floats: timelines with exact ties, steps across slots, zero-length
steps, overlapped pairs and empty ranks are compared row by row.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule
from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, chunk_range
from hyper_parallel.core.pipeline_parallel.tools.visualize import _compact_rows, _letter, ascii_chart

_T = MetaStepType


def _rows_before(result, slot: float) -> dict[int, str]:
    ncells = max(1, math.ceil(result.makespan / slot - 1e-9))
    rows = {}
    for rank in sorted(result.timeline):
        filled: list[dict[str, float]] = [{} for _ in range(ncells)]
        for start, end, step in result.timeline[rank]:
            letter = _letter(step)
            for k in range(int(start / slot), min(ncells, math.ceil(end / slot - 1e-9))):
                overlap = min(end, (k + 1) * slot) - max(start, k * slot)
                if overlap > 0:
                    filled[k][letter] = filled[k].get(letter, 0.0) + overlap
        row = []
        for k, amounts in enumerate(filled):
            busy = sum(amounts.values())
            idle = min(slot, result.makespan - k * slot) - busy
            top = max(amounts, key=amounts.get) if amounts else "."
            row.append(top if amounts and amounts[top] >= idle else ".")
        rows[rank] = "".join(row)
    return rows


_KINDS = [_T.FWD, _T.BWD, _T.BWD_INPUT, _T.BWD_WEIGHT, _T.PRE_FWD, _T.PRE_BWD, _T.FWD_SEND]


def _random_result(rng: random.Random, grid: bool):
    timeline = {}
    for rank in range(rng.randint(1, 4)):
        now, steps = 0.0, []
        for micro in range(rng.randint(0, 30)):
            now += rng.choice([0.0, 0.0, 0.5, 1.0]) if grid else rng.choice([0.0, rng.random()])
            length = rng.choice([0.0, 0.25, 0.5, 1.0, 1.5, 3.0]) if grid else rng.random() * 2
            kind = rng.choice(_KINDS + ["overlap"])
            if kind == "overlap":
                step = MetaStep(None, _T.OVERLAP_F_B, None, (MetaStep(micro, _T.FWD, 0), MetaStep(micro, _T.BWD, 1)))
            else:
                step = MetaStep(micro, kind, 0)
            steps.append((now, now + length, step))
            now += length
        timeline[rank] = steps
    makespan = max((end for steps in timeline.values() for _, end, _ in steps), default=0.0) + rng.choice([0.0, 0.5])
    return SimpleNamespace(timeline=timeline, makespan=makespan)


@pytest.mark.parametrize("seed", range(300))
def test_slot_letters_equal_the_loop(seed):
    rng = random.Random(seed)
    result = _random_result(rng, grid=seed % 2 == 0)
    slot = rng.choice([0.3, 0.5, 1.0, 1.5, 2.0, 2.5, 0.7])
    _, rows = _compact_rows(result, slot, exact=False)
    assert rows == _rows_before(result, slot)


@pytest.mark.parametrize("name", sorted(available_schedules()))
def test_library_schedules_chart_as_before(name):
    """Simulated schedules with uneven costs, charted narrow enough to squeeze several steps per
    slot: every row equals the loop's."""
    cls = available_schedules()[name]
    chunks = chunk_range(cls)[1] if chunk_range(cls)[1] <= 3 else 2
    costs = CostModel.per_rank_share(4, chunks)
    _, result = simulate_schedule(cls, 4, chunks, 12, costs)
    for slot in (0.37, 1.0, 2.5):
        _, rows = _compact_rows(result, slot, exact=False)
        assert rows == _rows_before(result, slot)
    assert "one column" in ascii_chart(result, width=40, mode="compact")


def test_a_step_before_time_zero_is_cut_not_wrapped():
    """Review finding: a hand-made result with a step starting before 0 made ``bincount`` raise
    (the old loop wrapped the negative slots into the last columns). What lies before 0 is not
    drawn; the rest of the step is."""
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import SimulationResult

    result = SimulationResult(4.0, 0.0, {0: 0}, {0: [(-0.5, 0.25, MetaStep(0, _T.FWD, 0)),
                                                   (0.5, 4.0, MetaStep(0, _T.BWD, 0))]})
    _, rows = _compact_rows(result, 0.2, exact=False)
    assert rows[0] == "F." + "B" * 18


def test_numpy_times_chart_as_floats():
    """Review finding: with numpy scalars as times, ``(0.0).__lt__`` answered NotImplemented (true),
    so zero-length steps set the unit to 0 and the chart raised."""
    import numpy as np

    from hyper_parallel.core.pipeline_parallel.simulation.simulate import SimulationResult

    steps = [(0.0, 0.0, MetaStep(0, _T.FWD, 0)), (0.0, 4.0, MetaStep(0, _T.BWD, 0))]
    plain = SimulationResult(4.0, 0.0, {0: 0}, {0: steps})
    typed = SimulationResult(4.0, 0.0, {0: 0}, {0: [(np.float32(a), np.float32(b), s) for a, b, s in steps]})
    for mode in ("auto", "full", "compact"):
        assert ascii_chart(typed, width=60, mode=mode) == ascii_chart(plain, width=60, mode=mode)
