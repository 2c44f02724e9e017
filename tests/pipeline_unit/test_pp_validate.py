"""Validation errors: each kind raises ScheduleError showing the grid with the step marked."""

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b, generate_gpipe
from hyper_parallel.core.pipeline_parallel.lowering.validate import (
    ScheduleError,
    format_grid,
    validate_compute,
    validate_lowered,
    validate_schedule,
)

P2 = looped_placement(2, 1)


def sched(*rows: str) -> dict:
    return {r: [None if w == "." else MetaStep.from_str(w) for w in row.split()] for r, row in enumerate(rows)}


def expect_error(check, schedule, m, match, marked, placement=P2):
    with pytest.raises(ScheduleError, match=match) as info:
        check(schedule, placement, m)
    err = info.value
    message = str(err)
    for text in marked:
        assert f">>{text}<<" in message
    assert message.count(">>") == len(marked) == len(err.marks)
    for rank in schedule:
        assert f"rank {rank} |" in message
    return err


def test_format_grid_aligns_columns_and_marks():
    grid = format_grid(sched("F.s0.m0 . B.s0.m0", "F.s1.m0 B.s1.m0"), marks=[(1, 1)])
    assert grid.splitlines() == [
        "rank 0 | F.s0.m0 .           B.s0.m0",
        "rank 1 | F.s1.m0 >>B.s1.m0<<",
    ]


def test_valid_schedules_pass():
    validate_compute(generate_1f1b(2, 3), P2, 3)
    validate_compute(sched("F.s0.m0 . I.s0.m0 W.s0.m0", "F.s1.m0 I.s1.m0 W.s1.m0"), P2, 1)
    validate_schedule(generate_gpipe(2, 2), P2, 2)
    validate_schedule(lower(generate_gpipe(2, 2), P2), P2, 2)


# --- compute errors ---------------------------------------------------------------------------


def test_swapped_backward_before_forward():
    bad = sched("F.s0.m0 B.s0.m1 F.s0.m1 B.s0.m0", "F.s1.m0 F.s1.m1 B.s1.m0 B.s1.m1")
    err = expect_error(validate_compute, bad, 2, "before its forward F.s0.m1", ["B.s0.m1"])
    assert err.marks == ((0, 1),)


def test_missing_backward_marks_the_forward():
    bad = sched("F.s0.m0 F.s0.m1 B.s0.m0", "F.s1.m0 F.s1.m1 B.s1.m0 B.s1.m1")
    expect_error(validate_compute, bad, 2, r"F.s0.m1 has no backward", ["F.s0.m1"])


def test_missing_forward_names_stage_and_rank():
    bad = sched("F.s0.m0 B.s0.m0", "")
    with pytest.raises(ScheduleError, match=r"F.s1.m0 is missing \(stage 1 is on rank 1\)"):
        validate_compute(bad, P2, 1)


def test_step_on_the_wrong_rank():
    bad = sched("F.s0.m0 F.s1.m0 B.s1.m0 B.s0.m0", "")
    expect_error(validate_compute, bad, 1, "stage 1 belongs to rank 1", ["F.s1.m0"])


def test_unknown_stage_and_micro_out_of_range():
    expect_error(validate_compute, sched("F.s7.m0", ""), 1, "unknown stage 7", ["F.s7.m0"])
    expect_error(validate_compute, sched("F.s0.m3", ""), 2, r"micro-batch 3 out of range 0..1", ["F.s0.m3"])
    expect_error(validate_compute, sched("F.s0", ""), 2, "micro-batch None", ["F.s0"])


def test_duplicate_forward_marks_both():
    bad = sched("F.s0.m0 F.s0.m0 B.s0.m0", "F.s1.m0 B.s1.m0")
    expect_error(validate_compute, bad, 1, "runs twice", ["F.s0.m0", "F.s0.m0"])


def test_input_and_weight_backward_rules():
    w_first = sched("F.s0.m0 W.s0.m0 I.s0.m0", "F.s1.m0 B.s1.m0")
    expect_error(validate_compute, w_first, 1, "before its I.s0.m0", ["W.s0.m0"])
    w_after_b = sched("F.s0.m0 B.s0.m0 W.s0.m0", "F.s1.m0 B.s1.m0")
    expect_error(validate_compute, w_after_b, 1, "follows a full backward", ["B.s0.m0", "W.s0.m0"])
    no_w = sched("F.s0.m0 I.s0.m0", "F.s1.m0 B.s1.m0")
    expect_error(validate_compute, no_w, 1, "I.s0.m0 has no W.s0.m0", ["I.s0.m0"])
    two_backwards = sched("F.s0.m0 I.s0.m0 B.s0.m0", "F.s1.m0 B.s1.m0")
    expect_error(validate_compute, two_backwards, 1, "already ran the backward", ["I.s0.m0", "B.s0.m0"])


def test_same_rank_stage_order():
    both = {0: 0, 1: 0}
    fwd_order = sched("F.s1.m0 F.s0.m0 B.s1.m0 B.s0.m0")
    expect_error(validate_compute, fwd_order, 1, "before F.s0.m0", ["F.s1.m0"], both)
    bwd_order = sched("F.s0.m0 F.s1.m0 B.s0.m0 B.s1.m0")
    expect_error(validate_compute, bwd_order, 1, "before the backward of stage 1", ["B.s0.m0"], both)


def test_bad_overlap_composite():
    bad = {0: [MetaStep(None, MetaStepType.OVERLAP_F_B, 0, [MetaStep.from_str("F.s0.m0")])], 1: []}
    expect_error(validate_compute, bad, 1, "one forward and one backward", ["OVERLAP_F_B[F.s0.m0].s0"])


def test_comm_step_in_compute_schedule():
    bad = sched("F.s0.m0 SEND_F.s0.m0 B.s0.m0", "F.s1.m0 B.s1.m0")
    expect_error(validate_compute, bad, 1, "communication step in a compute-only", ["SEND_F.s0.m0"])


def test_cross_rank_cycle_in_compute_schedule():
    bad = sched("F.s0.m0 B.s0.m0 F.s0.m1 B.s0.m1", "F.s1.m1 B.s1.m1 F.s1.m0 B.s1.m0")
    err = expect_error(validate_compute, bad, 2, "deadlock", ["B.s0.m0", "F.s1.m1"])
    assert "rank 1 is stuck at F.s1.m1, waiting for F.s0.m1 on rank 0" in err.reason


def test_bad_stage_map_and_micro_count():
    with pytest.raises(ValueError, match="stages 0..n-1"):
        validate_compute(generate_1f1b(2, 2), {0: 0, 2: 1}, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        validate_compute(generate_1f1b(2, 2), P2, 0)


# --- lowered errors ---------------------------------------------------------------------------

GOOD_0 = "F.s0.m0 SEND_F.s0.m0 F.s0.m1 SEND_F.s0.m1 RECV_B.s0.m0 B.s0.m0 RECV_B.s0.m1 B.s0.m1"
GOOD_1 = "RECV_F.s1.m0 F.s1.m0 RECV_F.s1.m1 F.s1.m1 B.s1.m0 SEND_B.s1.m0 B.s1.m1 SEND_B.s1.m1"


def test_hand_lowered_gpipe_is_valid():
    validate_lowered(sched(GOOD_0, GOOD_1), P2, 2)


def test_send_without_recv():
    bad = sched(GOOD_0, GOOD_1.replace("RECV_F.s1.m1 ", ""))
    expect_error(validate_lowered, bad, 2, "SEND_F.s0.m1 has no matching RECV_F.s1.m1 on rank 1",
                 ["SEND_F.s0.m1"])


def test_recv_without_send():
    bad = sched(GOOD_0, GOOD_1.replace(" SEND_B.s1.m0", ""))
    expect_error(validate_lowered, bad, 2, "RECV_B.s0.m0 has no matching SEND_B.s1.m0 on rank 1",
                 ["RECV_B.s0.m0"])


def test_fifo_order_violation():
    bad = sched(GOOD_0, "RECV_F.s1.m1 RECV_F.s1.m0 F.s1.m0 F.s1.m1 B.s1.m0 SEND_B.s1.m0 B.s1.m1 SEND_B.s1.m1")
    err = expect_error(validate_lowered, bad, 2, "FIFO order violation from rank 0 to rank 1",
                       ["SEND_F.s0.m0", "RECV_F.s1.m1"])
    assert set(err.marks) == {(0, 1), (1, 0)}


def test_recv_after_its_consumer():
    bad = sched(GOOD_0, "F.s1.m0 RECV_F.s1.m0 RECV_F.s1.m1 F.s1.m1 B.s1.m0 SEND_B.s1.m0 B.s1.m1 SEND_B.s1.m1")
    expect_error(validate_lowered, bad, 2, "after the step that consumes", ["RECV_F.s1.m0", "F.s1.m0"])


def test_send_before_its_producer():
    bad = sched("SEND_F.s0.m0 F.s0.m0 F.s0.m1 SEND_F.s0.m1 RECV_B.s0.m0 B.s0.m0 RECV_B.s0.m1 B.s0.m1", GOOD_1)
    expect_error(validate_lowered, bad, 2, "before the step that produces", ["SEND_F.s0.m0", "F.s0.m0"])


def test_missing_recv_and_send_pair():
    bad = sched(GOOD_0.replace(" SEND_F.s0.m1", ""), GOOD_1.replace("RECV_F.s1.m1 ", ""))
    expect_error(validate_lowered, bad, 2, "F.s1.m1 needs RECV_F.s1.m1 before it", ["F.s1.m1"])


def test_send_to_own_rank():
    both = {0: 0, 1: 0}
    bad = sched("F.s0.m0 SEND_F.s0.m0 RECV_F.s1.m0 F.s1.m0 B.s1.m0 B.s0.m0")
    expect_error(validate_lowered, bad, 1, "talks to its own rank 0", ["SEND_F.s0.m0"], both)


def test_send_with_no_peer_stage():
    bad = sched(GOOD_0 + " SEND_B.s0.m0", GOOD_1)
    expect_error(validate_lowered, bad, 2, "stage -1 does not exist", ["SEND_B.s0.m0"])


def test_deliberately_deadlocking_lowered_schedule():
    # Rank 0 waits for the gradient before it sends the forward output rank 1 needs to make it.
    bad = sched(
        "F.s0.m0 RECV_B.s0.m0 B.s0.m0 SEND_F.s0.m0",
        "RECV_F.s1.m0 F.s1.m0 B.s1.m0 SEND_B.s1.m0",
    )
    err = expect_error(validate_lowered, bad, 1, "deadlock", ["B.s0.m0", "F.s1.m0"])
    assert "rank 0 is stuck at B.s0.m0, waiting for a completed receive of B.s1.m0 or I.s1.m0 from rank 1" in err.reason
    assert "rank 1 is stuck at F.s1.m0, waiting for a completed receive of F.s0.m0 from rank 0" in err.reason


def test_batch_posts_its_sends_before_waiting():
    ok = sched(
        "F.s0.m0 BATCH[SEND_F.s0.m0+RECV_B.s0.m0] B.s0.m0",
        "BATCH[RECV_F.s1.m0] F.s1.m0 B.s1.m0 BATCH[SEND_B.s1.m0]",
    )
    validate_lowered(ok, P2, 1, "batch")
    # On one NCCL stream the receive blocks the send behind it, which rank 1 needs first; gloo
    # (eager sends, waits at the consumer) runs it.
    recv_first = sched(
        "F.s0.m0 BATCH[RECV_B.s0.m0] SEND_F.s0.m0 B.s0.m0",
        "BATCH[RECV_F.s1.m0] F.s1.m0 B.s1.m0 BATCH[SEND_B.s1.m0]",
    )
    validate_lowered(recv_first, P2, 1, "plain")
    err = expect_error(lambda *a: validate_lowered(*a, "batch"), recv_first, 1, "deadlock", ["F.s1.m0", "B.s0.m0"])
    assert "rank 1 is stuck at F.s1.m0, waiting for a completed receive of F.s0.m0 from rank 0" in err.reason


def test_batch_holding_a_compute_step():
    bad = sched("F.s0.m0 BATCH[SEND_F.s0.m0+F.s0.m0]", "")
    expect_error(validate_lowered, bad, 1, "may only hold data sends and recvs", ["BATCH[SEND_F.s0.m0+F.s0.m0]"])
