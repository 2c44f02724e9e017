"""Trace records, Chrome export, plan-versus-run comparison, StepTracer."""

from __future__ import annotations

import json

import pytest

from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule
from hyper_parallel.core.pipeline_parallel.tools.trace import (
    causality_violations,
    chrome_trace,
    compare,
    costs_from_records,
    load_trace,
    merge_records,
    save_trace,
)
from hyper_parallel.core.pipeline_parallel.runtime.tracing import StepTracer
from hyper_parallel.core.pipeline_parallel.tools.visualize import write_chrome_trace


def rec(rank, step, kind, start, end):
    return {"rank": rank, "step": step, "kind": kind, "start": start, "end": end}


RANK0 = [rec(0, "F.s0.m0", "compute", 0.0, 0.001), rec(0, "SEND_F.s0.m0", "p2p-issue", 0.001, 0.0011),
         rec(0, "RECV_B.s0.m0", "p2p-wait", 0.0011, 0.004), rec(0, "B.s0.m0", "compute", 0.004, 0.006)]
RANK1 = [rec(1, "RECV_F.s1.m0", "p2p-wait", 0.0, 0.0012), rec(1, "F.s1.m0", "compute", 0.0012, 0.0022),
         rec(1, "B.s1.m0", "compute", 0.0022, 0.0042)]


def _check_chrome(trace):
    # otherData: the Chrome JSON format's free-form metadata (what the records cannot tell)
    assert {"traceEvents", "displayTimeUnit"} <= set(trace) <= {"traceEvents", "displayTimeUnit", "otherData"}
    json.dumps(trace)  # serialisable
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M", "b", "e")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["name"], str)


def test_merge_and_chrome_trace():
    merged = merge_records([RANK1, RANK0])
    assert [r["start"] for r in merged] == sorted(r["start"] for r in merged)
    trace = chrome_trace(merged, "s")
    _check_chrome(trace)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 7
    b0 = next(e for e in slices if e["name"] == "B.s0.m0")
    assert (b0["pid"], b0["cat"], b0["ts"], b0["dur"]) == (0, "compute", 4000.0, pytest.approx(2000.0))


def test_bad_records_are_named():
    with pytest.raises(ValueError, match="record 0 of part 0: kind must be one of"):
        merge_records([[rec(0, "F.s0.m0", "busy", 0, 1)]])
    with pytest.raises(ValueError, match="ends .* before it starts"):
        merge_records([[rec(0, "F.s0.m0", "compute", 2, 1)]])
    with pytest.raises(ValueError, match="lacks end"):
        merge_records([[{"rank": 0, "step": "F", "kind": "compute", "start": 0}]])


def test_files_round_trip(tmp_path):
    save_trace(RANK0 + RANK1, tmp_path / "t.json")
    assert load_trace(tmp_path / "t.json")[""] == merge_records([RANK0, RANK1])
    _, plan = simulate_schedule(available_schedules()["1f1b"], 2, 1, 2)
    write_chrome_trace(tmp_path / "both.json", plan, RANK0 + RANK1)
    _check_chrome(json.loads((tmp_path / "both.json").read_text()))
    parts = load_trace(tmp_path / "both.json")
    assert set(parts) == {"plan", "run"}
    assert [r["step"] for r in parts["run"] if r["kind"] == "compute"][:2] == ["F.s0.m0", "F.s1.m0"]
    assert len([r for r in parts["plan"] if r["kind"] == "compute"]) == 8


def test_compare_reports_ratio_and_order():
    _, plan = simulate_schedule(available_schedules()["1f1b"], 2, 1, 1)  # F=1, B=2 ms, p=2, m=1
    report = compare(RANK0 + RANK1, plan.records)
    assert report["planned_makespan_ms"] == 6.0
    assert report["measured_makespan_ms"] == pytest.approx(6.0)
    assert report["makespan_ratio"] == pytest.approx(1.0)
    assert report["order_mismatch"] == {0: None, 1: None}
    swapped = [rec(1, "B.s1.m0", "compute", 0.0012, 0.0022), rec(1, "F.s1.m0", "compute", 0.0022, 0.0042)]
    report = compare(RANK0 + swapped, plan.records)
    assert report["order_mismatch"][1] == {"index": 0, "measured": "B.s1.m0", "planned": "F.s1.m0"}
    costs = costs_from_records(RANK0 + RANK1, 2)
    assert costs.stages[0].F == pytest.approx(1.0) and costs.stages[1].B == pytest.approx(2.0)


class FakeClock:
    def __init__(self):
        self.t = 10.0
        self.reads = 0

    def __call__(self):
        self.reads += 1
        self.t += 0.5
        return self.t


def test_disabled_tracer_reads_no_clock_and_keeps_nothing():
    clock = FakeClock()
    tracer = StepTracer(clock=clock)
    before = clock.reads
    t0 = tracer.now()
    tracer.record("F.s0.m0", "compute", t0, tracer.now())
    with tracer.span("B.s0.m0"):
        pass
    assert (t0, clock.reads - before, tracer.records()) == (0.0, 0, [])


def test_enabled_tracer_records_relative_times():
    clock = FakeClock()
    tracer = StepTracer(enabled=True, rank=3, clock=clock)
    tracer.start()
    t0 = tracer.now()
    tracer.record("F.s0.m0", "compute", t0, tracer.now())
    with tracer.span("RECV_B.s0.m0", "p2p-wait"):
        pass
    assert tracer.records() == [rec(3, "F.s0.m0", "compute", 0.5, 1.0), rec(3, "RECV_B.s0.m0", "p2p-wait", 1.5, 2.0)]
    tracer.record("x", "busy", 0, 1)
    with pytest.raises(ValueError, match="unknown record kind 'busy'"):
        tracer.records()


@pytest.mark.timeout(120)
def test_gather_collects_every_rank_through_the_platform():
    from hyper_parallel.core.pipeline_parallel.ir import MetaStep
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.local import LocalCluster

    def body():
        platform = get_platform()
        tracer = StepTracer(enabled=True)
        tracer.start(platform)
        t0 = tracer.now()
        tracer.record(MetaStep.from_str(f"F.s{platform.rank}.m0"), "compute", t0, tracer.now())
        return tracer.gather(platform)

    results = LocalCluster(3, platform="torch").run(body)
    assert results[0] == results[1] == results[2]
    assert sorted((r["rank"], r["step"]) for r in results[0]) == [(0, "F.s0.m0"), (1, "F.s1.m0"), (2, "F.s2.m0")]


class _PeerAnchor:
    """The platform calls ``StepTracer.start`` makes, for rank 1 of two whose peer (rank 0)
    took its clock anchor at wall time ``peer_wall`` (ns): what ``all_gather_object`` would return."""

    rank = 1

    def __init__(self, peer_wall):
        self.peer_wall = peer_wall

    def all_gather_object(self, obj, group=None):
        return [(self.peer_wall, 0.0), obj]


def test_start_counts_from_the_earliest_ranks_anchor_not_from_its_own_wake_up():
    # rank 1 took its anchor 27 ms (wall) after rank 0: its time 0 is rank 0's, so a step it runs
    # right after start is at 27 ms, not at 0 (a barrier-exit origin gave 0: the issue-25 skew)
    mono = {"t": 50.0}  # this rank's monotonic clock: any origin of its own
    tracer = StepTracer(enabled=True, clock=lambda: mono["t"], wall_clock=lambda: 1_000_027_000_000)
    tracer.start(_PeerAnchor(1_000_000_000_000))
    assert tracer.origin_ns == 1_000_000_000_000 and tracer.rank == 1
    mono["t"] = 50.001
    t0 = tracer.now()
    mono["t"] = 50.003
    tracer.record("F.s1.m0", "compute", t0, tracer.now())
    (record,) = tracer.records()
    assert record["start"] == pytest.approx(0.028) and record["end"] == pytest.approx(0.030)
    assert tracer.clock_error == 0.0  # a constant wall clock: the anchor reads had no gap


def test_a_compute_record_starts_when_its_received_input_is_in_hand():
    tracer = StepTracer(enabled=True, clock=FakeClock())
    tracer.start()
    tracer.record("RECV_F.s1.m0", "p2p-wait", 2.0, 5.0)  # nested in F.s1.m0 (the runtime waits inside)
    tracer.record("F.s1.m0", "compute", 1.0, 6.0)
    tracer.record("RECV_B.s1.m3", "p2p-wait", 7.0, 8.0)  # another part's input: not the first part's
    tracer.record("OVERLAP_B_F[B.s1.m0+F.s1.m3]", "compute", 6.5, 9.0)
    tracer.record("B.s1.m1", "compute", 9.0, 10.0)
    assert [(r["step"], r["start"], r["end"]) for r in tracer.records()] == [
        ("RECV_F.s1.m0", 2.0, 5.0), ("F.s1.m0", 5.0, 6.0), ("RECV_B.s1.m3", 7.0, 8.0),
        ("OVERLAP_B_F[B.s1.m0+F.s1.m3]", 6.5, 9.0), ("B.s1.m1", 9.0, 10.0)]


def test_causality_violations_names_a_step_that_ran_before_its_data_was_sent():
    run = RANK0 + RANK1 + [rec(1, "SEND_B.s1.m0", "p2p-issue", 0.0042, 0.0043)]
    run[2:4] = [rec(0, "RECV_B.s0.m0", "p2p-wait", 0.0011, 0.0044), rec(0, "B.s0.m0", "compute", 0.0044, 0.006)]
    assert causality_violations(run) == []
    early = [dict(r, start=r["start"] - 0.0005, end=r["end"] - 0.0005) if r["rank"] == 1 else r for r in run]
    found = causality_violations(early)
    assert len(found) == 2 and all("before rank 0 posted SEND_F.s0.m0" in f for f in found)
    assert causality_violations(early, tolerance=0.0005) == []
    never = [r for r in run if r["step"] != "SEND_F.s0.m0"]
    assert any("never posted SEND_F.s0.m0" in f for f in causality_violations(never))
