"""Schedule generators: exact small orders (derived by hand), bounds and validity."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.schedules import (
    generate_1f1b,
    generate_gpipe,
    generate_interleaved_1f1b,
    generate_looped_bfs,
)
from hyper_parallel.core.pipeline_parallel.schedules._common import bwd, fwd, one_f_one_b
from hyper_parallel.core.pipeline_parallel.schedules.interleaved_1f1b import (
    interleaved_warmup,
    microbatch_rounds,
)
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError, validate_compute


def steps(text: str) -> list[MetaStep]:
    return [MetaStep.from_str(word) for word in text.split()]


def in_flight_peak(rank_steps) -> int:
    """Most micro-batches forwarded but not yet backwarded, counted independently here."""
    live = peak = 0
    for step in rank_steps:
        live += step.meta_type is MetaStepType.FWD
        peak = max(peak, live)
        live -= step.meta_type is MetaStepType.BWD
    return peak


# --- exact orders, worked out by hand from the algorithm descriptions -------------------------


def test_gpipe_p2_m2():
    assert generate_gpipe(2, 2) == {
        0: steps("F.s0.m0 F.s0.m1 B.s0.m0 B.s0.m1"),
        1: steps("F.s1.m0 F.s1.m1 B.s1.m0 B.s1.m1"),
    }


def test_1f1b_p2_m3():
    # rank 0 warms up with p-r-1 = 1 forward, rank 1 with none.
    assert generate_1f1b(2, 3) == {
        0: steps("F.s0.m0 F.s0.m1 B.s0.m0 F.s0.m2 B.s0.m1 B.s0.m2"),
        1: steps("F.s1.m0 B.s1.m0 F.s1.m1 B.s1.m1 F.s1.m2 B.s1.m2"),
    }


def test_1f1b_p3_m2_warmup_capped_by_m():
    assert generate_1f1b(3, 2) == {
        0: steps("F.s0.m0 F.s0.m1 B.s0.m0 B.s0.m1"),
        1: steps("F.s1.m0 F.s1.m1 B.s1.m0 B.s1.m1"),
        2: steps("F.s2.m0 B.s2.m0 F.s2.m1 B.s2.m1"),
    }


def test_interleaved_p2_v2_m4():
    # Rounds {0,1}, {2,3}. Warm-up (v-1)p + 2(p-1-r): 4 on rank 0, 2 on rank 1.
    assert generate_interleaved_1f1b(2, 2, 4) == {
        0: steps(
            "F.s0.m0 F.s0.m1 F.s2.m0 F.s2.m1 "
            "F.s0.m2 B.s2.m0 F.s0.m3 B.s2.m1 F.s2.m2 B.s0.m0 F.s2.m3 B.s0.m1 "
            "B.s2.m2 B.s2.m3 B.s0.m2 B.s0.m3"
        ),
        1: steps(
            "F.s1.m0 F.s1.m1 "
            "F.s3.m0 B.s3.m0 F.s3.m1 B.s3.m1 F.s1.m2 B.s1.m0 F.s1.m3 B.s1.m1 "
            "F.s3.m2 B.s3.m2 F.s3.m3 B.s3.m3 "
            "B.s1.m2 B.s1.m3"
        ),
    }


def test_interleaved_p2_v2_m3_partial_round():
    # Rounds {0,1}, {2}: forward units s0m0 s0m1 s2m0 s2m1 s0m2 s2m2 (stages of rank 0),
    # backward units s2m0 s2m1 s0m0 s0m1 s2m2 s0m2. Warm-up 4 on rank 0, 2 on rank 1.
    assert generate_interleaved_1f1b(2, 2, 3) == {
        0: steps(
            "F.s0.m0 F.s0.m1 F.s2.m0 F.s2.m1 F.s0.m2 B.s2.m0 F.s2.m2 B.s2.m1 "
            "B.s0.m0 B.s0.m1 B.s2.m2 B.s0.m2"
        ),
        1: steps(
            "F.s1.m0 F.s1.m1 F.s3.m0 B.s3.m0 F.s3.m1 B.s3.m1 F.s1.m2 B.s1.m0 F.s3.m2 B.s1.m1 "
            "B.s3.m2 B.s1.m2"
        ),
    }


def test_interleaved_single_microbatch():
    assert generate_interleaved_1f1b(2, 2, 1) == {
        0: steps("F.s0.m0 F.s2.m0 B.s2.m0 B.s0.m0"),
        1: steps("F.s1.m0 F.s3.m0 B.s3.m0 B.s1.m0"),
    }


def test_looped_bfs_p2_v2_m2():
    assert generate_looped_bfs(2, 2, 2) == {
        0: steps("F.s0.m0 F.s0.m1 F.s2.m0 F.s2.m1 B.s2.m0 B.s2.m1 B.s0.m0 B.s0.m1"),
        1: steps("F.s1.m0 F.s1.m1 F.s3.m0 F.s3.m1 B.s3.m0 B.s3.m1 B.s1.m0 B.s1.m1"),
    }


# --- argument checks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: generate_gpipe(0, 2), "num_ranks must be an int >= 1, got 0"),
        (lambda: generate_gpipe(2, 0), "num_microbatches must be an int >= 1, got 0"),
        (lambda: generate_1f1b(True, 2), "num_ranks must be an int >= 1, got True"),
        (lambda: generate_1f1b(2, 2.0), "num_microbatches must be an int >= 1, got 2.0"),
        (lambda: generate_interleaved_1f1b(2, 1, 4), "num_chunks must be an int >= 2, got 1"),
        (lambda: generate_interleaved_1f1b(2, 2, -3), "num_microbatches must be an int >= 1, got -3"),
        (lambda: generate_interleaved_1f1b(2, False, 4), "num_chunks must be an int >= 2, got False"),
        (lambda: generate_looped_bfs(2, 0, 4), "num_chunks must be an int >= 1, got 0"),
        (lambda: generate_looped_bfs("2", 1, 4), "num_ranks must be an int >= 1, got '2'"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- counts and bounds ------------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_1f1b_in_flight_bound_and_counts(p, m):
    schedule = generate_1f1b(p, m)
    for r, rank_steps in schedule.items():
        assert in_flight_peak(rank_steps) == min(m, p - r)
        assert rank_steps.count(None) == 0
        assert sorted(map(str, rank_steps)) == sorted(
            [f"F.s{r}.m{i}" for i in range(m)] + [f"B.s{r}.m{i}" for i in range(m)]
        )
        assert rank_steps[: min(m, p - r - 1)] == [fwd(r, i) for i in range(min(m, p - r - 1))]


@pytest.mark.parametrize(("p", "m"), [(1, 1), (3, 4), (4, 2)])
def test_gpipe_in_flight_is_m(p, m):
    for rank_steps in generate_gpipe(p, m).values():
        assert in_flight_peak(rank_steps) == m


def test_looped_bfs_in_flight_is_v_times_m():
    for rank_steps in generate_looped_bfs(3, 3, 4).values():
        assert in_flight_peak(rank_steps) == 12


def test_microbatch_rounds():
    assert microbatch_rounds(4, 10) == [range(0, 4), range(4, 8), range(8, 10)]
    assert microbatch_rounds(4, 3) == [range(0, 3)]


@pytest.mark.parametrize(("p", "v", "m"), [(4, 2, 8), (4, 3, 12), (3, 2, 3), (2, 4, 6)])
def test_interleaved_warmup_is_textbook_for_full_rounds(p, v, m):
    for r in range(p):
        assert interleaved_warmup(p, v, m, r) == min(v * m, (v - 1) * p + 2 * (p - 1 - r))


def test_interleaved_warmup_capped_for_short_last_round():
    # p=4, v=3, m=5: last round holds one micro-batch, extra warm-up capped at p + 1 = 5.
    assert [interleaved_warmup(4, 3, 5, r) for r in range(4)] == [13, 12, 10, 8]


def test_textbook_warmup_deadlocks_where_the_cap_applies():
    p, v, m = 4, 3, 5
    rounds = microbatch_rounds(p, m)
    textbook = {}
    for r in range(p):
        fwds = [fwd(c * p + r, i) for rnd in rounds for c in range(v) for i in rnd]
        bwds = [bwd(c * p + r, i) for rnd in rounds for c in reversed(range(v)) for i in rnd]
        textbook[r] = one_f_one_b(fwds, bwds, (v - 1) * p + 2 * (p - 1 - r))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_compute(textbook, looped_placement(p, v), m)
    validate_compute(generate_interleaved_1f1b(p, v, m), looped_placement(p, v), m)


@pytest.mark.parametrize(("p", "v", "m"), [(4, 2, 8), (4, 3, 5), (3, 2, 7), (5, 4, 2)])
def test_interleaved_in_flight_follows_warmup(p, v, m):
    for r, rank_steps in generate_interleaved_1f1b(p, v, m).items():
        assert in_flight_peak(rank_steps) == min(v * m, interleaved_warmup(p, v, m, r) + 1)


def test_one_f_one_b_helper():
    f = [fwd(0, i) for i in range(3)]
    b = [bwd(0, i) for i in range(3)]
    assert one_f_one_b(f, b, 1) == [f[0], f[1], b[0], f[2], b[1], b[2]]
    assert one_f_one_b(f, b, 9) == f + b
    with pytest.raises(ValueError, match="3 forwards but 2 backwards"):
        one_f_one_b(f, b[:2], 0)


# --- validity over many shapes ----------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("v", range(2, 5))
def test_interleaved_valid_for_every_m(p, v):
    for m in range(1, 14):
        validate_compute(generate_interleaved_1f1b(p, v, m), looped_placement(p, v), m)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), v=st.integers(1, 4), m=st.integers(1, 13))
def test_all_generators_valid(p, v, m):
    validate_compute(generate_gpipe(p, m), looped_placement(p, 1), m)
    validate_compute(generate_1f1b(p, m), looped_placement(p, 1), m)
    validate_compute(generate_looped_bfs(p, v, m), looped_placement(p, v), m)
    if v >= 2:
        validate_compute(generate_interleaved_1f1b(p, v, m), looped_placement(p, v), m)
