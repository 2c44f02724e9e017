"""Auto-schedule against brute force."""

from __future__ import annotations

import pytest

from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, chunk_range
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule
from hyper_parallel.core.pipeline_parallel.tools.tune import format_table, tune

SCHEDULES = {k: v for k, v in available_schedules().items() if k in ("gpipe", "1f1b", "interleaved-1f1b",
                                                                     "looped-bfs")}


def brute_force(costs, limit, batch, p, chunks, state_factor=4.0):
    best = None
    for name, cls in SCHEDULES.items():
        low, high = chunk_range(cls)
        for v in [v for v in chunks if low <= v <= high]:
            for m in [m for m in range(1, batch + 1) if batch % m == 0]:
                scaled = costs.for_micro_batch_size(batch // m)
                stage_costs = scaled.for_stages(p * v, allow_even_split=True)
                _, result = simulate_schedule(cls, p, v, m, stage_costs, lowered=False)
                memory = max(
                    result.peak_activation_bytes[r] + state_factor * sum(
                        stage_costs.stages[c * p + r].param_bytes for c in range(v))
                    for r in range(p))
                if memory <= limit:
                    key = (result.makespan, memory, m, v, name)
                    best = key if best is None or key < best else best
    return best


LAYER = StageCost(F=1.0, B=2.0, activation_bytes=100.0, param_bytes=10.0, overhead_ms=0.25)
COSTS = CostModel(stages=(LAYER,), layers=(LAYER,) * 8, micro_batch_size=2)


@pytest.mark.parametrize("limit", [1e9, 900.0, 700.0, 520.0])
@pytest.mark.parametrize(("batch", "p"), [(8, 2), (12, 4), (16, 4)])
def test_choice_equals_brute_force(limit, batch, p):
    expected = brute_force(COSTS, limit, batch, p, (1, 2))
    result = tune(COSTS, limit, batch, p, schedules=SCHEDULES, chunk_options=(1, 2))
    if expected is None:
        assert result.best is None
        return
    b = result.best
    assert (b.makespan_ms, b.peak_memory_bytes, b.num_microbatches, b.num_chunks, b.schedule) == \
        pytest.approx(expected)


def test_tight_limit_changes_the_choice_and_nothing_fits_below_the_weights():
    # p = 4, 8 layers: 2 layers per stage (v = 1) keep 100 bytes per sample each and hold 80 bytes of state
    roomy = tune(COSTS, 1e9, 16, 4, schedules=SCHEDULES, chunk_options=(1, 2)).best
    assert (roomy.schedule, roomy.num_chunks, roomy.num_microbatches, roomy.makespan_ms) == \
        ("interleaved-1f1b", 2, 8, 57.0)
    tight = tune(COSTS, 1000.0, 16, 4, schedules=SCHEDULES, chunk_options=(1, 2)).best
    assert (tight.schedule, tight.num_chunks, tight.num_microbatches) == ("interleaved-1f1b", 2, 16)
    tighter = tune(COSTS, 500.0, 16, 4, schedules=SCHEDULES, chunk_options=(1, 2)).best
    # 1F1B with 16 micro-batches of 1: rank 0 holds 4 micro-batches x 100 bytes + 80 bytes of state
    assert (tighter.schedule, tighter.num_microbatches, tighter.peak_memory_bytes) == ("1f1b", 16, 480.0)
    nothing = tune(COSTS, 50.0, 16, 4, schedules=SCHEDULES)
    assert nothing.best is None and all(not c.fits for c in nothing.candidates)
    table = format_table(nothing)
    assert "needs" in table and "*" not in table.split("\n", 1)[1][:1]


def test_unrunnable_candidates_are_listed_with_their_reason():
    class Broken:
        __name__ = "Broken"

        @classmethod
        def stage_placement(cls, p, v):
            return {s: s % p for s in range(p * v)}

        @classmethod
        def generate(cls, p, v, m):
            raise ValueError("needs at least 2p micro-batches")

    result = tune(COSTS, 1e9, 4, 2, schedules={"broken": Broken, "1f1b": SCHEDULES["1f1b"]})
    notes = {c.note for c in result.candidates if c.schedule == "broken"}
    assert notes == {"not runnable: needs at least 2p micro-batches"}
    assert result.best.schedule == "1f1b"
    with pytest.raises(ValueError, match="3 micro-batches do not divide the global batch 8"):
        tune(COSTS, 1e9, 8, 2, micro_batches=[3])


@pytest.mark.parametrize("search", [False, True])
def test_worker_processes_give_the_same_result(search):
    """``jobs`` simulates candidates in worker processes: the same candidates, numbers, order, choice
    and searched orders as in one process."""
    one = tune(COSTS, 900.0, 12, 4, chunk_options=(1, 2), search=search)
    two = tune(COSTS, 900.0, 12, 4, chunk_options=(1, 2), search=search, jobs=2)
    assert two.to_json() == one.to_json()
    assert [c.order for c in two.candidates] == [c.order for c in one.candidates]
    assert len(two.candidates) > 10 and (two.best is None) == (one.best is None)


def test_a_schedule_a_worker_cannot_import_runs_here():
    """A schedule class defined in a function cannot be sent to a worker process: tune simulates
    every candidate in this process then, with the same result."""
    class Local(SCHEDULES["1f1b"]):
        pass

    schedules = {"local": Local, "gpipe": SCHEDULES["gpipe"]}
    alone = tune(COSTS, 1e9, 8, 2, schedules=schedules)
    assert tune(COSTS, 1e9, 8, 2, schedules=schedules, jobs=3).to_json() == alone.to_json()
    assert {c.schedule for c in alone.candidates} == {"local", "gpipe"}


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True, "2"])
def test_jobs_must_be_a_positive_int(jobs):
    with pytest.raises(ValueError, match="jobs must be an int >= 1"):
        tune(COSTS, 1e9, 8, 2, schedules=SCHEDULES, jobs=jobs)


class _Exploding(SCHEDULES["1f1b"]):
    """A schedule whose generator fails with an error tune does not turn into a note."""

    @classmethod
    def generate(cls, p, v, m):
        raise RuntimeError(f"generator bug at m={m}")


def test_an_error_in_a_worker_is_raised_as_without_workers():
    schedules = {"gpipe": SCHEDULES["gpipe"], "exploding": _Exploding}
    with pytest.raises(RuntimeError, match="generator bug at m=1"):
        tune(COSTS, 1e9, 8, 2, schedules=schedules)
    with pytest.raises(RuntimeError, match="generator bug at m=1"):
        tune(COSTS, 1e9, 8, 2, schedules=schedules, jobs=2)


class _Oops(Exception):
    """An error whose arguments do not rebuild it: it cannot come back from a worker process."""

    def __init__(self, a, b):
        super().__init__(f"{a}-{b}")


class _RaisesOops(SCHEDULES["1f1b"]):
    @classmethod
    def generate(cls, p, v, m):
        raise _Oops(p, m)


def test_an_error_that_cannot_leave_a_worker_is_raised_as_without_workers():
    """Review finding: the worker's error could not be rebuilt in this process, and tune raised
    BrokenProcessPool instead of the schedule's own error; the candidates now run here then."""
    with pytest.raises(_Oops, match="2-1"):
        tune(COSTS, 1e9, 8, 2, schedules={"oops": _RaisesOops, "gpipe": SCHEDULES["gpipe"]}, jobs=2)
