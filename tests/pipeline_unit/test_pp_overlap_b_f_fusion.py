"""overlap_b_f on interleaved 1F1B: which (backward, forward) pairs become OVERLAP_B_F steps, how many,
and that the fused schedules lower and validate for every transport and prefetch setting."""

import itertools

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.schedules import generate_interleaved_1f1b
from hyper_parallel.core.pipeline_parallel.schedules.overlap_pairs import can_pair, fuse_overlap_pairs
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_compute, validate_lowered

T = MetaStepType


def steps(text: str) -> list[MetaStep]:
    return [MetaStep.from_str(word) for word in text.split()]


def flat(rank_steps):
    return [part for step in rank_steps for part in step.parts]


def test_p2_v2_m4_by_hand():
    """Rank 0 runs F s0m0 s0m1 s2m0 s2m1, then (F s0m2, B s2m0), (F s0m3, B s2m1), (F s2m2, B s0m0),
    (F s2m3, B s0m1), then the rest of the backwards: B s2m0 + F s0m3 and B s0m0 + F s2m3 pair up,
    B s2m1 + F s2m2 (same chunk) does not. Rank 1 (stages 1 and 3) likewise."""
    fused = generate_interleaved_1f1b(2, 2, 4, overlap_b_f=True)
    assert fused[0] == steps(
        "F.s0.m0 F.s0.m1 F.s2.m0 F.s2.m1 F.s0.m2 OVERLAP_B_F[B.s2.m0+F.s0.m3] B.s2.m1 F.s2.m2 "
        "OVERLAP_B_F[B.s0.m0+F.s2.m3] B.s0.m1 B.s2.m2 B.s2.m3 B.s0.m2 B.s0.m3"
    )
    assert fused[1] == steps(
        "F.s1.m0 F.s1.m1 F.s3.m0 B.s3.m0 F.s3.m1 OVERLAP_B_F[B.s3.m1+F.s1.m2] B.s1.m0 F.s1.m3 "
        "OVERLAP_B_F[B.s1.m1+F.s3.m2] B.s3.m2 F.s3.m3 B.s3.m3 B.s1.m2 B.s1.m3"
    )


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9])
def test_fusion_regroups_the_plain_schedule(p, m):
    """Same steps in the same order; every pair is a backward then a forward of another stage and
    micro-batch; no two adjacent steps that could pair are left apart."""
    plain = generate_interleaved_1f1b(p, 2, m)
    fused = generate_interleaved_1f1b(p, 2, m, overlap_b_f=True)
    for r in range(p):
        assert flat(fused[r]) == plain[r]
        pairs = [s for s in fused[r] if s.meta_type is T.OVERLAP_B_F]
        for pair in pairs:
            backward, forward = pair.sub_steps
            assert backward.meta_type is T.BWD and forward.meta_type is T.FWD
            assert backward.stage_index != forward.stage_index and backward.micro_index != forward.micro_index
        for a, b in zip(fused[r], fused[r][1:]):  # greedy left to right: nothing pairable left behind
            assert not can_pair(a, b), (r, a, b)
        assert len(pairs) == sum(
            1 for k in range(len(plain[r]) - 1) if can_pair(plain[r][k], plain[r][k + 1])
            and (k == 0 or not can_pair(plain[r][k - 1], plain[r][k]))
        )


@pytest.mark.parametrize(("p", "m", "count"), [(1, 4, 6), (2, 4, 4), (2, 8, 12)])
def test_pair_counts(p, m, count):
    """Pairs over all ranks, by hand: p=1 runs F00 F10 B10 F01 B00 F11 B11 F02 ... (F<stage><micro>),
    and every backward but the last two is followed by a forward of the other stage: 6 pairs for m=4.
    p=2: every other steady-state backward is followed by a forward of the other chunk: 2 pairs per
    rank for m=4, 6 per rank for m=8."""
    fused = generate_interleaved_1f1b(p, 2, m, overlap_b_f=True)
    assert sum(s.meta_type is T.OVERLAP_B_F for r in fused for s in fused[r]) == count


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 12])
def test_fused_schedules_lower_and_validate(p, m):
    fused = generate_interleaved_1f1b(p, 2, m, overlap_b_f=True)
    placement = looped_placement(p, 2)
    validate_compute(fused, placement, m)
    for transport, prefetch, metadata in itertools.product(("plain", "batch"), (False, True), ("first", "all")):
        lowered = lower(fused, placement, transport, metadata=metadata, prefetch=prefetch)
        assert [flat(rank) for rank in lowered.values()] == [flat(fused[r]) for r in sorted(fused)]
        for engine in ("eager", "stream") if transport == "batch" else ("eager",):
            validate_lowered(lowered, placement, m, transport, engine=engine)
            forwards = {r: [part for part in flat(fused[r]) if part.meta_type is T.FWD] for r in fused}
            validate_lowered(lower(forwards, placement, transport, metadata=metadata, prefetch=prefetch),
                             placement, m, transport, forward_only=True, engine=engine)


def test_a_pair_whose_fusion_deadlocks_is_split_back():
    """p=4, v=3, m=6: fusing every candidate deadlocks (rank 0's B.s8.m0 would wait for F.s4.m5's
    input, which needs rank 3, which waits for B.s8.m0); the fuser keeps those two steps apart."""
    p, v, m = 4, 3, 6
    placement = looped_placement(p, v)
    plain = generate_interleaved_1f1b(p, v, m)
    fused = fuse_overlap_pairs(plain, placement)
    validate_compute(fused, placement, m)
    assert steps("B.s8.m0 F.s4.m5") == fused[0][fused[0].index(MetaStep.from_str("B.s8.m0")):][:2]
    assert any(s.meta_type is T.OVERLAP_B_F for r in fused for s in fused[r])  # the others stay fused


def test_fuser_keeps_idle_slots_and_never_pairs_across_them():
    schedule = {0: [*steps("F.s0.m0 F.s2.m0 F.s0.m1 B.s2.m0"), None, *steps("F.s2.m1 B.s2.m1 B.s0.m0 B.s0.m1")],
                1: steps("F.s1.m0 F.s3.m0 B.s3.m0 F.s1.m1 F.s3.m1 B.s3.m1 B.s1.m0 B.s1.m1")}
    fused = fuse_overlap_pairs(schedule, looped_placement(2, 2))
    assert fused[0] == schedule[0]
    assert fused[1][2:4] == [MetaStep(None, T.OVERLAP_B_F, None, steps("B.s3.m0 F.s1.m1")), MetaStep.from_str("F.s3.m1")]
