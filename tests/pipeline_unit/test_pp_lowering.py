"""Lowering: P2P insertion, FIFO order, batching, and deadlock freedom of the result."""

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import counterpart, lower, peer_rank
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, v_placement
from hyper_parallel.core.pipeline_parallel.schedules import (
    generate_1f1b,
    generate_gpipe,
    generate_interleaved_1f1b,
    generate_looped_bfs,
)
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_lowered

T = MetaStepType


def steps(text: str) -> list[MetaStep]:
    return [MetaStep.from_str(word) for word in text.split()]


def texts(schedule):
    return {rank: " ".join(map(str, rank_steps)) for rank, rank_steps in schedule.items()}


def p2p_order(lowered, stage_to_rank, sends: bool):
    """(src, dst) -> the messages in program order, as (kind, producer stage, micro)."""
    order = defaultdict(list)
    for rank, rank_steps in lowered.items():
        for step in rank_steps:
            for op in step.comm_parts:
                if op.meta_type.is_send != sends:
                    continue
                peer = peer_rank(op, stage_to_rank)
                src = op if sends else counterpart(op)
                pair = (rank, peer) if sends else (peer, rank)
                order[pair].append((src.meta_type, src.stage_index, src.micro_index))
    return dict(order)


def test_1f1b_p2_m2_plain_by_hand():
    lowered = lower(generate_1f1b(2, 2), looped_placement(2, 1))
    assert texts(lowered) == {
        0: "F.s0.m0 SEND_F.s0.m0 F.s0.m1 SEND_F.s0.m1 RECV_B.s0.m0 B.s0.m0 RECV_B.s0.m1 B.s0.m1",
        1: "RECV_F.s1.m0 F.s1.m0 B.s1.m0 SEND_B.s1.m0 RECV_F.s1.m1 F.s1.m1 B.s1.m1 SEND_B.s1.m1",
    }


def test_1f1b_p2_m2_batch_by_hand():
    lowered = lower(generate_1f1b(2, 2), looped_placement(2, 1), transport="batch")
    assert texts(lowered) == {
        0: "F.s0.m0 BATCH[SEND_F.s0.m0] F.s0.m1 BATCH[SEND_F.s0.m1+RECV_B.s0.m0] B.s0.m0 "
        "BATCH[RECV_B.s0.m1] B.s0.m1",
        1: "BATCH[RECV_F.s1.m0] F.s1.m0 B.s1.m0 BATCH[SEND_B.s1.m0+RECV_F.s1.m1] F.s1.m1 "
        "B.s1.m1 BATCH[SEND_B.s1.m1]",
    }


def test_idle_slots_dropped_and_single_rank_needs_no_comm():
    compute = {0: [MetaStep.from_str("F.s0.m0"), None, MetaStep.from_str("F.s1.m0"),
                   MetaStep.from_str("B.s1.m0"), None, MetaStep.from_str("B.s0.m0")]}
    lowered = lower(compute, {0: 0, 1: 0})
    assert texts(lowered) == {0: "F.s0.m0 F.s1.m0 B.s1.m0 B.s0.m0"}
    validate_lowered(lowered, {0: 0, 1: 0}, 1)


def test_adjacent_stages_on_one_rank_pass_directly():
    # V placement on 2 ranks: stages 1 and 2 both live on rank 1.
    placement = v_placement(2)
    compute = {
        0: steps("F.s0.m0 F.s3.m0 B.s3.m0 B.s0.m0"),
        1: steps("F.s1.m0 F.s2.m0 B.s2.m0 B.s1.m0"),
    }
    lowered = lower(compute, placement)
    assert texts(lowered) == {
        0: "F.s0.m0 SEND_F.s0.m0 RECV_F.s3.m0 F.s3.m0 B.s3.m0 SEND_B.s3.m0 RECV_B.s0.m0 B.s0.m0",
        1: "RECV_F.s1.m0 F.s1.m0 F.s2.m0 SEND_F.s2.m0 RECV_B.s2.m0 B.s2.m0 B.s1.m0 SEND_B.s1.m0",
    }
    validate_lowered(lowered, placement, 1)


def test_input_weight_split_sends_after_input_backward():
    compute = {
        0: steps("F.s0.m0 I.s0.m0 W.s0.m0"),
        1: steps("F.s1.m0 I.s1.m0 W.s1.m0"),
    }
    lowered = lower(compute, looped_placement(2, 1))
    assert texts(lowered) == {
        0: "F.s0.m0 SEND_F.s0.m0 RECV_B.s0.m0 I.s0.m0 W.s0.m0",
        1: "RECV_F.s1.m0 F.s1.m0 I.s1.m0 SEND_B.s1.m0 W.s1.m0",
    }
    validate_lowered(lowered, looped_placement(2, 1), 1)


def test_overlap_composite_gets_recvs_before_and_sends_after():
    # 3 ranks, 1F1B shape where the middle rank overlaps B of micro 0 with F of micro 1.
    overlap = MetaStep(None, T.OVERLAP_B_F, 1, steps("B.s1.m0 F.s1.m1"))
    compute = {
        0: steps("F.s0.m0 F.s0.m1 B.s0.m0 B.s0.m1"),
        1: [MetaStep.from_str("F.s1.m0"), overlap, MetaStep.from_str("B.s1.m1")],
        2: steps("F.s2.m0 B.s2.m0 F.s2.m1 B.s2.m1"),
    }
    placement = looped_placement(3, 1)
    for transport in ("plain", "batch"):
        lowered = lower(compute, placement, transport)
        validate_lowered(lowered, placement, 2)
    plain = lower(compute, placement)
    at = plain[1].index(overlap)
    assert set(plain[1][at - 2 : at]) == set(steps("RECV_B.s1.m0 RECV_F.s1.m1"))
    assert plain[1][at + 1 : at + 3] == steps("SEND_B.s1.m0 SEND_F.s1.m1")
    batch = lower(compute, placement, "batch")[1]
    at = batch.index(overlap)
    assert str(batch[at + 1]) == "BATCH[SEND_B.s1.m0+SEND_F.s1.m1+RECV_B.s1.m1]"  # one group per gap


def test_fifo_recvs_follow_send_order_in_interleaved_partial_round():
    # p=2, v=2, m=3: rank 1 sends SEND_B.s3.m1 before SEND_F.s1.m2, but rank 0 consumes
    # F.s2.m2 before B.s2.m1, so RECV_B.s2.m1 must be posted before RECV_F.s2.m2.
    placement = looped_placement(2, 2)
    lowered = lower(generate_interleaved_1f1b(2, 2, 3), placement)
    rank0 = [str(s) for s in lowered[0]]
    assert rank0.index("RECV_B.s2.m1") < rank0.index("RECV_F.s2.m2") < rank0.index("F.s2.m2")
    assert p2p_order(lowered, placement, sends=True) == p2p_order(lowered, placement, sends=False)


def test_sends_directly_follow_their_producer():
    placement = looped_placement(3, 2)
    lowered = lower(generate_interleaved_1f1b(3, 2, 5), placement)
    for rank_steps in lowered.values():
        for k, step in enumerate(rank_steps):
            if step.meta_type.is_send:
                prev = next(s for s in reversed(rank_steps[:k]) if not s.meta_type.is_comm)
                kind = T.FWD if step.meta_type is T.FWD_SEND else T.BWD
                assert prev == MetaStep(step.micro_index, kind, step.stage_index)


def test_unknown_transport_lists_valid_ones():
    with pytest.raises(ValueError, match="'nccl'.*plain, batch"):
        lower(generate_1f1b(2, 2), looped_placement(2, 1), transport="nccl")


def test_lowering_rejects_already_lowered_and_unknown_stage():
    placement = looped_placement(2, 1)
    with pytest.raises(ValueError, match="already a communication step"):
        lower(lower(generate_1f1b(2, 2), placement), placement)
    with pytest.raises(ValueError, match="stage 5"):
        lower({0: steps("F.s5.m0")}, placement)


def _lower_and_validate(compute, placement, m):
    for transport in ("plain", "batch"):
        lowered = lower(compute, placement, transport)
        assert all(step is not None for rank_steps in lowered.values() for step in rank_steps)
        validate_lowered(lowered, placement, m)
        assert p2p_order(lowered, placement, True) == p2p_order(lowered, placement, False)


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("v", range(2, 5))
def test_interleaved_lowered_valid_for_every_m(p, v):
    for m in range(1, 14):
        _lower_and_validate(generate_interleaved_1f1b(p, v, m), looped_placement(p, v), m)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), v=st.integers(1, 4), m=st.integers(1, 13))
def test_all_generators_lower_to_valid_schedules(p, v, m):
    _lower_and_validate(generate_gpipe(p, m), looped_placement(p, 1), m)
    _lower_and_validate(generate_1f1b(p, m), looped_placement(p, 1), m)
    _lower_and_validate(generate_looped_bfs(p, v, m), looped_placement(p, v), m)
