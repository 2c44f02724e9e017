"""Cost-model simulation: closed-form bubbles, peaks, timelines, errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.schedules import (
    generate_1f1b,
    generate_gpipe,
    generate_interleaved_1f1b,
    generate_looped_bfs,
)
from hyper_parallel.core.pipeline_parallel.simulation.simulate import SimulationResult, simulate
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError

T = MetaStepType
UNIT = {T.FWD: 1.0, T.BWD: 1.0}


def sched(*rows: str) -> dict:
    return {r: [MetaStep.from_str(w) for w in row.split()] for r, row in enumerate(rows)}


# Closed forms. In 1F1B and GPipe the first forward reaches the last rank after (p-1) tf,
# the last rank then works m (tf + tb) without a gap, and the last gradient needs (p-1) tb
# to get back to rank 0: makespan = (m + p - 1)(tf + tb); each rank is busy m (tf + tb), so
# bubble = (p - 1) / (m + p - 1). Interleaving v chunks (m a multiple of p) shrinks the
# ramp to one chunk's worth: makespan = (v m + p - 1)(tf + tb) in per-chunk costs.


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13])
def test_1f1b_bubble_matches_formula_unit_costs(p, m):
    result = simulate(generate_1f1b(p, m), looped_placement(p, 1), UNIT)
    assert result.makespan == 2 * (m + p - 1)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (2.0, 1.0), (1.0, 3.0)])
@pytest.mark.parametrize("generator", [generate_1f1b, generate_gpipe])
def test_1f1b_and_gpipe_makespan_any_costs(generator, tf, tb):
    for p, m in [(2, 3), (4, 8), (5, 2)]:
        result = simulate(generator(p, m), looped_placement(p, 1), {T.FWD: tf, T.BWD: tb})
        assert result.makespan == pytest.approx((m + p - 1) * (tf + tb))
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4, 9])
def test_gpipe_bubble_matches_formula(p, m):
    result = simulate(generate_gpipe(p, m), looped_placement(p, 1), UNIT)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.peak_activations == dict.fromkeys(range(p), m)


@pytest.mark.parametrize(("p", "v", "k"), [(2, 2, 1), (4, 2, 2), (3, 3, 2), (4, 4, 1)])
def test_interleaved_bubble_with_full_rounds(p, v, k):
    m = k * p
    result = simulate(generate_interleaved_1f1b(p, v, m), looped_placement(p, v))
    assert result.makespan == (v * m + p - 1) * 3.0
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_1f1b_peak_activations():
    result = simulate(generate_1f1b(4, 8), looped_placement(4, 1))
    assert result.peak_activations == {0: 4, 1: 3, 2: 2, 3: 1}


def test_gpipe_timeline_with_comm_cost_by_hand():
    result = simulate(generate_gpipe(2, 1), looped_placement(2, 1), comm_cost=0.5)
    assert result.timeline == {
        0: [(0.0, 1.0, MetaStep.from_str("F.s0.m0")), (5.0, 7.0, MetaStep.from_str("B.s0.m0"))],
        1: [(1.5, 2.5, MetaStep.from_str("F.s1.m0")), (2.5, 4.5, MetaStep.from_str("B.s1.m0"))],
    }
    assert result.makespan == 7.0
    assert result.bubble_fraction == pytest.approx(1 - 6 / 14)


def test_split_backward_releases_after_weight():
    schedule = sched("F.s0.m0 F.s0.m1 I.s0.m0 F.s0.m2 W.s0.m0 I.s0.m1 W.s0.m1 I.s0.m2 W.s0.m2")
    result = simulate(schedule, {0: 0})
    assert result.peak_activations == {0: 3}
    assert result.makespan == 9.0 and result.bubble_fraction == 0.0


def test_overlap_costs_sum_of_parts_unless_given():
    overlap = MetaStep(None, T.OVERLAP_F_B, 0, [MetaStep.from_str("F.s0.m1"), MetaStep.from_str("B.s0.m0")])
    schedule = {0: [MetaStep.from_str("F.s0.m0"), overlap, MetaStep.from_str("B.s0.m1")]}
    assert simulate(schedule, {0: 0}).makespan == 1 + 3 + 2
    assert simulate(schedule, {0: 0}, {T.OVERLAP_F_B: 2.0}).makespan == 1 + 2 + 2
    assert simulate(schedule, {0: 0}).peak_activations == {0: 2}


def test_idle_slots_and_non_compute_steps_take_no_time():
    schedule = {0: [None, MetaStep.from_str("FSDP_UNSHARD.s0"), MetaStep.from_str("F.s0.m0"), None,
                    MetaStep.from_str("B.s0.m0")]}
    result = simulate(schedule, {0: 0})
    assert result.makespan == 3.0
    assert [step for _, _, step in result.timeline[0]] == [MetaStep.from_str("F.s0.m0"),
                                                             MetaStep.from_str("B.s0.m0")]


def test_empty_schedule():
    result = simulate({0: []}, {0: 0})
    assert result == SimulationResult(0.0, 0.0, {0: 0}, {0: []}, {0: 0.0}, {0: 0.0}, {0: 0.0}, [])


def test_deadlock_raises_schedule_error():
    bad = sched("F.s0.m0 B.s0.m0 F.s0.m1 B.s0.m1", "F.s1.m1 B.s1.m1 F.s1.m0 B.s1.m0")
    with pytest.raises(ScheduleError, match="cannot finish") as info:
        simulate(bad, looped_placement(2, 1))
    assert ">>B.s0.m0<<" in str(info.value) and ">>F.s1.m1<<" in str(info.value)


def test_bad_costs():
    with pytest.raises(ValueError, match="BWD"):
        simulate(generate_1f1b(2, 2), looped_placement(2, 1), {T.BWD: -1.0})
    with pytest.raises(ValueError, match="comm_cost"):
        simulate(generate_1f1b(2, 2), looped_placement(2, 1), comm_cost=-1.0)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), v=st.integers(2, 4), m=st.integers(1, 13),
       comm=st.sampled_from([0.0, 0.25, 1.0]), transport=st.sampled_from(["plain"]))
def test_lowered_and_compute_simulations_agree(p, v, m, comm, transport):
    cases = [
        (generate_1f1b(p, m), looped_placement(p, 1)),
        (generate_interleaved_1f1b(p, v, m), looped_placement(p, v)),
        (generate_looped_bfs(p, v, m), looped_placement(p, v)),
    ]
    for compute, placement in cases:
        plain = simulate(compute, placement, comm_cost=comm)
        lowered = simulate(lower(compute, placement, transport), placement, comm_cost=comm)
        assert lowered.makespan == pytest.approx(plain.makespan)
        assert lowered.peak_activations == plain.peak_activations
        assert 0.0 <= plain.bubble_fraction < 1.0
        busy = sum(end - start for steps in plain.timeline.values() for start, end, _ in steps)
        assert busy == pytest.approx(3.0 * len(placement) * m)
