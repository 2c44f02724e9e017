"""Zero-bubble generators: exact small orders (worked out by hand), counts, dependencies,
peak in-flight activations, deadlock freedom, bubbles against the closed forms, lowering."""

import itertools

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, v_placement
from hyper_parallel.core.pipeline_parallel.schedules import (
    generate_dualpipe_v,
    generate_interleaved_zero_bubble,
    generate_zbv_zero_bubble,
)
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_compute, validate_lowered

T = MetaStepType
UNIT = {T.FWD: 1.0, T.BWD_INPUT: 1.0, T.BWD_WEIGHT: 1.0, T.BWD: 2.0}


def steps(text: str) -> list[MetaStep]:
    return [MetaStep.from_str(word) for word in text.split()]


def parts(rank_steps):
    for step in rank_steps:
        if step is not None:
            yield from (step.sub_steps if step.meta_type.is_overlap else (step,))


def in_flight_peak(rank_steps) -> int:
    """Most (stage, micro) activations between their F and their W (or B), counted here."""
    live = peak = 0
    for step in rank_steps:
        if step is None:
            continue
        kinds = [p.meta_type for p in (step.sub_steps if step.meta_type.is_overlap else (step,))]
        live += kinds.count(T.FWD)
        peak = max(peak, live)
        live -= kinds.count(T.BWD) + kinds.count(T.BWD_WEIGHT)
    return peak


# --- exact orders, worked out by hand (unit-cost placement of W, see _weights.py) ---------------


def test_zb_h1_p2_m3():
    # Rank 0 warms up with p - 0 = 2 forwards, rank 1 with 1. Rank 0 then holds p = 2
    # activations, so its third F comes after W0; rank 1 holds one more (r = 1) W back and runs
    # it while it waits for F.s0.m2 (time 5); both end with the W's left.
    assert generate_interleaved_zero_bubble(2, 1, 3) == {
        0: steps("F.s0.m0 F.s0.m1 I.s0.m0 W.s0.m0 F.s0.m2 I.s0.m1 W.s0.m1 I.s0.m2 W.s0.m2"),
        1: steps("F.s1.m0 I.s1.m0 F.s1.m1 I.s1.m1 W.s1.m0 F.s1.m2 I.s1.m2 W.s1.m1 W.s1.m2"),
    }


def test_zbv_p2_m2():
    # F/I order: rank 0 F0 F0 | F1 I1 F1 I1 | I0 I0; rank 1 F0 | F1 F0 | F1 I1 | I0 I1 | I0.
    # W's fill the waits (rank 0 at t=8 waits for I.s1.m1) and the end.
    assert generate_zbv_zero_bubble(2, 2) == {
        0: steps("F.s0.m0 F.s0.m1 F.s3.m0 I.s3.m0 F.s3.m1 I.s3.m1 I.s0.m0 W.s3.m0 I.s0.m1 W.s3.m1 W.s0.m0 W.s0.m1"),
        1: steps("F.s1.m0 F.s2.m0 F.s1.m1 F.s2.m1 I.s2.m0 I.s1.m0 I.s2.m1 I.s1.m1 W.s2.m0 W.s1.m0 W.s2.m1 W.s1.m1"),
    }


def test_dualpipe_v_p1_m2():
    assert generate_dualpipe_v(1, 2) == {
        0: steps("F.s0.m0 F.s1.m0 F.s0.m1 B.s1.m0 OVERLAP_B_F[B.s0.m0+F.s1.m1] B.s1.m1 I.s0.m1 W.s0.m1"),
    }


def test_dualpipe_v_p2_m4():
    # Phases of the module docstring with p = 2, m = 4; rank 1 runs its first pair unfused.
    assert generate_dualpipe_v(2, 4) == {
        0: steps(
            "F.s0.m0 F.s0.m1 F.s0.m2 F.s3.m0 I.s3.m0 W.s3.m0 F.s3.m1 "
            "OVERLAP_B_F[B.s3.m1+F.s0.m3] OVERLAP_B_F[B.s0.m0+F.s3.m2] "
            "B.s3.m2 OVERLAP_B_F[B.s0.m1+F.s3.m3] B.s3.m3 I.s0.m2 W.s0.m2 I.s0.m3 W.s0.m3"
        ),
        1: steps(
            "F.s1.m0 F.s2.m0 F.s1.m1 F.s2.m1 F.s1.m2 B.s2.m0 OVERLAP_B_F[B.s1.m0+F.s2.m2] "
            "OVERLAP_B_F[B.s2.m1+F.s1.m3] OVERLAP_B_F[B.s1.m1+F.s2.m3] B.s2.m2 B.s1.m2 "
            "I.s2.m3 I.s1.m3 W.s2.m3 W.s1.m3"
        ),
    }


# --- arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: generate_dualpipe_v(4, 7), ValueError,
         "DualPipeV needs at least 2 \\* num_ranks = 8 micro-batches with 4 ranks, got 7"),
        (lambda: generate_dualpipe_v(0, 4), ValueError, "num_ranks must be an int >= 1, got 0"),
        (lambda: generate_zbv_zero_bubble(2, 0), ValueError, "num_microbatches must be an int >= 1, got 0"),
        (lambda: generate_interleaved_zero_bubble(2, 0, 4), ValueError, "num_chunks must be an int >= 1, got 0"),
        (lambda: generate_interleaved_zero_bubble(2, 1, True), ValueError,
         "num_microbatches must be an int >= 1, got True"),
    ],
)
def test_bad_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --- properties over many shapes --------------------------------------------------------------------


def cases():
    """(name, p, m, schedule, placement, peak bound) for p <= 6 and m from the minimum to 3p."""
    for p in range(1, 7):
        for m in range(1, 3 * p + 1):
            for v in (1, 2, 3):
                yield (f"zb-h1 v={v}", p, m, generate_interleaved_zero_bubble(p, v, m), looped_placement(p, v),
                       v * min(p, m))
            yield "zb-v", p, m, generate_zbv_zero_bubble(p, m), v_placement(p), 2 * min(p, m)
            if m >= 2 * p:
                yield "dualpipe-v", p, m, generate_dualpipe_v(p, m), v_placement(p), 2 * p + 1


ALL = list(cases())


def check_counts_and_order(schedule, placement, m):
    """Every (stage, micro) has one F and one B or one I and one W, on its rank, in that order."""
    for rank, rank_steps in schedule.items():
        seen = {}
        for k, part in enumerate(parts(rank_steps)):
            assert placement[part.stage_index] == rank
            key = (part.stage_index, part.micro_index)
            assert (key, part.meta_type) not in seen, f"{part} twice"
            seen[(key, part.meta_type)] = k
        stages = [s for s, r in placement.items() if r == rank]
        for s, i in itertools.product(stages, range(m)):
            f = seen[((s, i), T.FWD)]
            if ((s, i), T.BWD) in seen:
                assert f < seen[((s, i), T.BWD)] and ((s, i), T.BWD_INPUT) not in seen
            else:
                assert f < seen[((s, i), T.BWD_INPUT)] < seen[((s, i), T.BWD_WEIGHT)]
        assert {key for key, _ in seen} == set(itertools.product(stages, range(m)))


@pytest.mark.parametrize(("name", "p", "m", "schedule", "placement", "bound"), ALL,
                         ids=[f"{c[0]}-p{c[1]}-m{c[2]}" for c in ALL])
def test_counts_dependencies_peak_and_deadlock_freedom(name, p, m, schedule, placement, bound):
    check_counts_and_order(schedule, placement, m)
    validate_compute(schedule, placement, m)  # dependencies across ranks, deadlock freedom
    peaks = [in_flight_peak(rank_steps) for rank_steps in schedule.values()]
    assert max(peaks) <= bound
    if m >= p:
        assert max(peaks) == bound  # the bound is reached: the schedule uses the memory it may
    assert simulate(schedule, placement, UNIT).peak_activations == dict(enumerate(peaks))


def test_dualpipe_v_overlaps_backward_first_of_two_micro_batches():
    for p, m in [(2, 4), (3, 9), (4, 12)]:
        overlapped = 0
        for rank_steps in generate_dualpipe_v(p, m).values():
            for step in rank_steps:
                if step.meta_type is T.OVERLAP_B_F:
                    backward, forward = step.sub_steps
                    assert backward.meta_type is T.BWD and forward.meta_type is T.FWD
                    assert backward.stage_index != forward.stage_index
                    overlapped += 1
        # phases 4 and 5: 2 (m - 2p + r + 1) + (p - r - 1) per rank, minus rank p-1's unfused one
        assert overlapped == sum(2 * (m - 2 * p + r + 1) + (p - r - 1) for r in range(p)) - 1


# --- bubbles against the closed forms (F = I = W = 1, B = 2) -----------------------------------------


@pytest.mark.parametrize("p", range(1, 7))
def test_zb_h1_bubble_is_a_third_of_1f1b(p):
    # Each rank works 3m units; its only idle time is (p - 1)(F + I - W) = p - 1 units, a third
    # of 1F1B's (p - 1)(F + B) = 3 (p - 1).
    for m in range(p, 3 * p + 1):
        result = simulate(generate_interleaved_zero_bubble(p, 1, m), looped_placement(p, 1), UNIT)
        assert result.makespan == 3 * m + p - 1
        assert result.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))


@pytest.mark.parametrize(("f", "i", "w"), [(1.0, 1.5, 0.5), (1.0, 1.2, 0.8), (1.0, 2.0, 1.0)])
@pytest.mark.parametrize(("p", "m"), [(3, 9), (4, 16)])
def test_zb_h1_idle_time_with_unequal_costs(p, m, f, i, w):
    # the paper's (p - 1)(F + I - W) also holds when W is cheaper than I
    costs = {T.FWD: f, T.BWD_INPUT: i, T.BWD_WEIGHT: w}
    result = simulate(generate_interleaved_zero_bubble(p, 1, m), looped_placement(p, 1), costs)
    assert result.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))


@pytest.mark.parametrize(("p", "v", "rounds"), [(2, 2, 1), (2, 3, 2), (3, 2, 2), (4, 2, 2), (4, 3, 1), (5, 2, 3),
                                                  (6, 3, 2)])
def test_interleaved_zero_bubble_with_full_rounds(p, v, rounds):
    m = rounds * p
    result = simulate(generate_interleaved_zero_bubble(p, v, m), looped_placement(p, v), UNIT)
    assert result.makespan == 3 * v * m + p - 1


@pytest.mark.parametrize("p", range(1, 7))
def test_zbv_bubble_is_only_the_ramp(p):
    for m in range(p, 3 * p + 1):
        result = simulate(generate_zbv_zero_bubble(p, m), v_placement(p), UNIT)
        assert result.makespan == 6 * m + p - 1
        assert result.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))


@pytest.mark.parametrize("p", range(1, 7))
def test_dualpipe_v_bubble_formula(p):
    # (p - 1)(F&B + B - 3W) with F&B = F + B = 3, B = 2, W = 1: 2 (p - 1) per rank.
    for m in range(2 * p, 3 * p + 1):
        result = simulate(generate_dualpipe_v(p, m), v_placement(p), UNIT)
        assert result.makespan == 6 * m + 2 * (p - 1)
        assert result.bubble_fraction == pytest.approx(2 * (p - 1) / (6 * m + 2 * (p - 1)))


@pytest.mark.parametrize("pair_cost", [3.0, 2.5, 2.0])
@pytest.mark.parametrize(("p", "m"), [(2, 8), (3, 9), (4, 16)])
def test_dualpipe_v_bubble_with_cheaper_overlapped_pairs(p, m, pair_cost):
    # An overlapped pair costing F&B <= F + B: the ranks with the fewest overlapped pairs idle
    # (p - 1)(F&B + B - 3W), the others less.
    result = simulate(generate_dualpipe_v(p, m), v_placement(p), {**UNIT, T.OVERLAP_B_F: pair_cost})
    idle = [result.makespan - sum(end - start for start, end, _ in steps) for steps in result.timeline.values()]
    assert max(idle) == (p - 1) * (pair_cost + 2 - 3)


# --- lowering --------------------------------------------------------------------------------------


LOWERING = [  # a sample: batch lowering of the larger interleaved lists takes seconds each
    c for c in ALL
    if (c[1], c[2]) in {(1, 2), (2, 3), (2, 4), (3, 6), (4, 8)} and c[0] != "zb-h1 v=3"
    and (c[0], c[1]) != ("zb-h1 v=2", 4)
]


@pytest.mark.parametrize(("name", "p", "m", "schedule", "placement", "bound"), LOWERING,
                         ids=[f"{c[0]}-p{c[1]}-m{c[2]}" for c in LOWERING])
@pytest.mark.parametrize(("transport", "metadata"), itertools.product(("plain", "batch"), ("none", "first", "all")))
def test_lowered_forms_are_valid(name, p, m, schedule, placement, bound, transport, metadata):
    for prefetch in (False, True):
        lowered = lower(schedule, placement, transport, metadata=metadata, prefetch=prefetch)
        validate_lowered(lowered, placement, m, transport)
