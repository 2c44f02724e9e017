"""The timed job model: message times, eager versus stream semantics, deadlocks, agreement
with the untimed job model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost
from hyper_parallel.core.pipeline_parallel.ir import MetaStep
from hyper_parallel.core.pipeline_parallel.lowering.job_model import run_job
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b, generate_interleaved_1f1b
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate
from hyper_parallel.core.pipeline_parallel.simulation.timed_model import run_timed
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError


def steps(text: str) -> list[MetaStep]:
    return [MetaStep.from_str(t) for t in text.split()]


def test_message_time_is_latency_plus_bytes_over_bandwidth():
    stage = StageCost(F=1.0, B=2.0, output_bytes=2e6)
    costs = CostModel(stages=(stage, stage), p2p_latency_ms=0.5, p2p_bandwidth_gb_per_s=1.0)
    # 2e6 bytes at 1 GB/s = 2 ms, plus 0.5 ms latency
    lowered = lower({0: steps("F.s0.m0 B.s0.m0"), 1: steps("F.s1.m0 B.s1.m0")}, {0: 0, 1: 1})
    result = simulate(lowered, {0: 0, 1: 1}, costs)
    assert [(a, b, str(s)) for a, b, s in result.timeline[1]] == [(3.5, 4.5, "F.s1.m0"), (4.5, 6.5, "B.s1.m0")]
    assert [(a, b, str(s)) for a, b, s in result.timeline[0]] == [(0.0, 1.0, "F.s0.m0"), (9.0, 11.0, "B.s0.m0")]
    assert result.makespan == 11.0
    waits = [r for r in result.records if r["kind"] == "p2p-wait"]
    assert {(r["rank"], r["step"], r["start"], r["end"]) for r in waits} == {
        (1, "RECV_F.s1.m0", 0.0, 3.5), (0, "RECV_B.s0.m0", 1.0, 9.0)}
    flights = sorted((r["step"], r["start"], r["end"]) for r in result.records if r["kind"] == "p2p")
    assert flights == [("SEND_B.s1.m0", 6.5, 9.0), ("SEND_F.s0.m0", 1.0, 3.5)]


def test_stream_groups_run_one_after_another():
    # rank 1 posts its receive for micro 1 in the same group as its send of micro 0's gradient:
    # in the stream model that group completes only when rank 0 takes the gradient.
    lowered = {
        0: steps("F.s0.m0 BATCH[SEND_F.s0.m0] F.s0.m1 BATCH[SEND_F.s0.m1] BATCH[RECV_B.s0.m0] B.s0.m0 "
                 "BATCH[RECV_B.s0.m1] B.s0.m1"),
        1: steps("BATCH[RECV_F.s1.m0] F.s1.m0 B.s1.m0 BATCH[SEND_B.s1.m0+RECV_F.s1.m1] F.s1.m1 B.s1.m1 "
                 "BATCH[SEND_B.s1.m1]"),
    }
    placement = {0: 0, 1: 1}
    eager = simulate(lowered, placement, {}, model="eager")
    stream = simulate(lowered, placement, {}, model="stream")
    assert eager.makespan == stream.makespan == 9.0  # no message time: the order decides nothing here
    slow = CostModel.uniform(2, F=1.0, B=2.0, p2p_latency_ms=1.0)
    e = simulate(lowered, placement, slow, model="eager")
    s = simulate(lowered, placement, slow, model="stream")
    # eager: F.s1.m1 waits for its own message only (sent at 2, arrives 3); stream: the group
    # that receives it also sends SEND_B.s1.m0 at 5 and is active from 5, so it completes at 6
    f1_eager = next(a for a, _, st_ in e.timeline[1] if str(st_) == "F.s1.m1")
    f1_stream = next(a for a, _, st_ in s.timeline[1] if str(st_) == "F.s1.m1")
    assert f1_eager == 5.0 and f1_stream == 6.0
    # and rank 0's gradient receive queues behind its SEND_F.s0.m1 group (done at 6): B0 at 7, not 6
    b0_eager = next(a for a, _, st_ in e.timeline[0] if str(st_) == "B.s0.m0")
    b0_stream = next(a for a, _, st_ in s.timeline[0] if str(st_) == "B.s0.m0")
    assert b0_eager == 6.0 and b0_stream == 7.0


def test_hand_broken_order_deadlocks_with_both_ranks_named():
    broken = {0: steps("F.s0.m0 B.s0.m0 F.s0.m1 B.s0.m1"), 1: steps("F.s1.m1 B.s1.m1 F.s1.m0 B.s1.m0")}
    with pytest.raises(ScheduleError, match="cannot finish") as info:
        simulate(broken, looped_placement(2, 1))
    text = str(info.value)
    assert "rank 0 is stuck at B.s0.m0" in text and "rank 1 is stuck at F.s1.m1" in text
    assert ">>B.s0.m0<<" in text and ">>F.s1.m1<<" in text


def test_lowered_deadlock_is_found_too():
    good = lower(generate_1f1b(2, 2), looped_placement(2, 1))
    broken = dict(good)
    broken[1] = list(reversed(good[1][:4])) + good[1][4:]  # a receive after the compute that needs it
    with pytest.raises(ScheduleError, match="cannot finish"):
        simulate(broken, looped_placement(2, 1))


def _perturb(schedule, seed):
    import random

    rng = random.Random(seed)
    out = {r: list(s) for r, s in schedule.items()}
    for _ in range(3):
        rank = rng.choice(sorted(out))
        if len(out[rank]) > 1:
            k = rng.randrange(len(out[rank]) - 1)
            out[rank][k], out[rank][k + 1] = out[rank][k + 1], out[rank][k]
    return out


@settings(max_examples=80, deadline=None)
@given(p=st.integers(2, 4), v=st.integers(1, 3), m=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_finishes_exactly_when_the_job_model_finishes(p, v, m, seed):
    compute = generate_interleaved_1f1b(p, v, m) if v > 1 else generate_1f1b(p, m)
    placement = looped_placement(p, v)
    perturbed = _perturb(compute, seed)
    timed = run_timed(perturbed, placement, lambda s: 1.0, lambda k: 0.25, lowered=False)
    assert timed.finished == run_job(perturbed, placement, lowered=False).finished
    lowered = lower(compute, placement, "batch")
    broken = _perturb(lowered, seed)
    for model in ("eager", "stream"):
        timed = run_timed(broken, placement, lambda s: 1.0, lambda k: 0.5, model=model)
        assert timed.finished == run_job(broken, placement, model=model).finished, model
