"""The runtime's own costs in the timed model (``runtime_costs.py``), machine files, and the
calibration's analysis of traced records (``calibrate.py``): no framework, no timing."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from hyper_parallel import Schedule1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
from hyper_parallel.core.pipeline_parallel.tools.calibrate import Samples, collect, runtime_costs, sleep_costs, sleep_of
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost, load_costs, save_costs
from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.ir.steps import consumes, produces
from hyper_parallel.core.pipeline_parallel.simulation.machine import Machine, load_machine, save_machine
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import RUNTIME_LOWERING, SCALARS, PerKind, RuntimeCosts
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate, simulate_schedule
from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, chunk_range, default_chunks

_T = MetaStepType
S = MetaStep.from_str


def _costs(runtime=None, latency=0.0):
    return CostModel(stages=(StageCost(F=1.0, B=2.0),), p2p_latency_ms=latency, runtime=runtime).for_stages(2)


# ---------------------------------------------------------------------- backwards compatibility


@pytest.mark.parametrize("cls,v", [(Schedule1F1B, 1), (ScheduleInterleavedZeroBubble, 2), (ScheduleZBVZeroBubble, 2)])
@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_zero_runtime_costs_give_the_prediction_of_the_times_the_runtime_spends(cls, v, transport):
    """A runtime object with every figure 0 is the free runtime: exactly the prediction without
    one, of the stage times the runtime spends (the first stage's I is 0, its W is I + W)."""
    base = CostModel.per_rank_share(4, v, F=3.0, B=5.0, p2p_latency_ms=0.25)
    first = base.stages[0]
    spent = replace(base, stages=(StageCost(F=first.F, B=first.B, I=0.0, W=first.I + first.W), *base.stages[1:]))
    for zero in (RuntimeCosts(), RuntimeCosts.from_json({})):
        for lowering in ({}, RUNTIME_LOWERING):
            _, without = simulate_schedule(cls, 4, v, 8, spent, transport=transport, **lowering)
            _, with_zero = simulate_schedule(cls, 4, v, 8, replace(base, runtime=zero), transport=transport,
                                             **lowering)
            assert with_zero.makespan == without.makespan
            assert with_zero.timeline == without.timeline


def test_a_costs_file_without_runtime_predicts_exactly_as_before(tmp_path):
    """The backwards-compatibility promise: no runtime object, the prediction of old (the first
    stage's I and W as the file gives them)."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"format": "hyper-parallel-costs/1", "p2p": {"latency_ms": 0.25},
                                "stages": [{"F": 3, "B": 5, "I": 2, "W": 3}]}))
    costs = load_costs(path)
    assert costs.runtime is None
    _, result = simulate_schedule(ScheduleInterleavedZeroBubble, 2, 1, 4, costs.for_stages(2))
    spans = {str(step): (start, end) for start, end, step in result.timeline[0]}
    assert spans["I.s0.m0"][1] - spans["I.s0.m0"][0] == 2.0 and spans["W.s0.m0"][1] - spans["W.s0.m0"][0] == 3.0


def test_a_costs_file_without_runtime_reads_as_before_and_round_trips_with_it(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"format": "hyper-parallel-costs/1", "stages": [{"F": 1, "B": 2}]}))
    assert load_costs(path).runtime is None
    rt = RuntimeCosts(compute_ms=PerKind(0.1, 0.2, 0.3, 0.4), received_ms=PerKind(1, 2, 3, 4), send_ms=0.5,
                      recv_ms=0.6, wait_ms=0.7, meta_ms=0.8, batch_ms=0.9, run_ms=1.5)
    save_costs(CostModel(stages=(StageCost(F=1.0),), runtime=rt), path)
    assert load_costs(path).runtime == rt


def test_the_timed_model_is_deterministic_with_runtime_costs():
    costs = CostModel.per_rank_share(4, 2, F=3.0, B=5.0, p2p_latency_ms=0.3, runtime=RuntimeCosts(
        compute_ms=PerKind(0.3, 0.4, 0.2, 0.1), received_ms=PerKind(0.5, 0.6, 0.4, 0.1), send_ms=0.05,
        recv_ms=0.04, wait_ms=0.03, meta_ms=0.2, batch_ms=0.1, run_ms=1.0))
    runs = [simulate_schedule(ScheduleInterleavedZeroBubble, 4, 2, 8, costs, **RUNTIME_LOWERING)[1] for _ in range(3)]
    assert len({r.makespan for r in runs}) == 1
    assert runs[0].records == runs[1].records


# ---------------------------------------------------------------------- charged on the lowered steps


def test_runtime_costs_are_charged_on_each_lowered_step_as_documented():
    """Two ranks, one micro-batch: F0 on rank 0, sent, F1 and B1 on rank 1, B0 back on rank 0.

    rank 0: F.s0 ends 1 + 0.3 = 1.3; SEND_F posts until 1.3 + 0.05 = 1.35 (the message left at 1.3);
            RECV_B posts until 1.35 + 0.04 = 1.39; B.s0 waits for the gradient (below).
    rank 1: RECV_F posts until 0.04; F.s1: its input arrives at 1.3 + 0.2 = 1.5 (it waited since 0.04):
            ends 1.5 + 1 + 0.5 (received F) = 3.0; B.s1 (local input) ends 3.0 + 2 + 0.4 = 5.4;
            SEND_B posts from 5.4 until 5.45.
    rank 0: B.s0's gradient arrives at 5.4 + 0.2 = 5.6 > 1.39 + 0.03 + 2 + 0.4: ends 5.6 + 2 + 0.6 = 8.2.
    run_ms: everyone finishes 1.0 later; the makespan is 9.2."""
    steps = {0: [S("F.s0.m0"), S("SEND_F.s0.m0"), S("RECV_B.s0.m0"), S("B.s0.m0")],
             1: [S("RECV_F.s1.m0"), S("F.s1.m0"), S("B.s1.m0"), S("SEND_B.s1.m0")]}
    rt = RuntimeCosts(compute_ms=PerKind(F=0.3, B=0.4), received_ms=PerKind(F=0.5, B=0.6), send_ms=0.05,
                      recv_ms=0.04, wait_ms=0.03, run_ms=1.0)
    result = simulate(steps, {0: 0, 1: 1}, _costs(rt, latency=0.2))
    ends = {(rank, str(step)): end for rank, items in result.timeline.items() for _, end, step in items}
    assert ends[(0, "F.s0.m0")] == pytest.approx(1.3)
    assert ends[(1, "F.s1.m0")] == pytest.approx(3.0)
    assert ends[(1, "B.s1.m0")] == pytest.approx(5.4)
    assert ends[(0, "B.s0.m0")] == pytest.approx(8.2)
    assert result.makespan == pytest.approx(9.2)
    issue = {(r["rank"], r["step"]): (r["start"], r["end"]) for r in result.records if r["kind"] == "p2p-issue"}
    assert issue[(0, "SEND_F.s0.m0")] == pytest.approx((1.3, 1.35))
    assert issue[(1, "SEND_B.s1.m0")] == pytest.approx((5.4, 5.45))


def test_a_wait_on_data_already_there_costs_wait_ms():
    """Stage 0 on rank 0, stages 1 and 2 on rank 1 (F: 1, 1 and 10 ms). Rank 1's first forward
    waits for its input (arrives at 1.25 + 0.1: ends 1.35 + 1 + 9); the input of micro-batch 1
    arrives at 2.6 while rank 1 runs stage 2's long forward (ends 11.35 + 10 + 0.25); its forward
    then costs wait_ms + its compute + compute_ms."""
    steps = {0: [S("F.s0.m0"), S("SEND_F.s0.m0"), S("F.s0.m1"), S("SEND_F.s0.m1")],
             1: [S("RECV_F.s1.m0"), S("RECV_F.s1.m1"), S("F.s1.m0"), S("F.s2.m0"), S("F.s1.m1")]}
    rt = RuntimeCosts(compute_ms=PerKind(F=0.25), received_ms=PerKind(F=9.0), wait_ms=0.125)
    stages = (StageCost(F=1.0), StageCost(F=1.0), StageCost(F=10.0))
    costs = CostModel(stages=stages, p2p_latency_ms=0.1, runtime=rt)
    from hyper_parallel.core.pipeline_parallel.simulation.timed_model import run_timed

    outcome = run_timed(steps, {0: 0, 1: 1, 2: 1}, costs.step_time, costs.message_time, runtime=rt)
    ends = {str(step): end for _, end, step in outcome.compute[1]}
    assert ends["F.s1.m0"] == pytest.approx(11.35)
    assert ends["F.s2.m0"] == pytest.approx(21.6)
    assert ends["F.s1.m1"] == pytest.approx(21.6 + 0.125 + 1.0 + 0.25)


# ---------------------------------------------------------------------- machine files


def test_machine_file_round_trip_and_apply(tmp_path):
    rt = RuntimeCosts(send_ms=0.1, run_ms=2.0)
    machine = Machine(rt, 0.2, 3.0, {"backend": "gloo", "nproc": 2})
    path = tmp_path / "machine.json"
    save_machine(machine, path)
    again = load_machine(path)
    assert again == machine
    applied = again.apply(CostModel(stages=(StageCost(F=1.0),), p2p_latency_ms=9.0))
    assert (applied.p2p_latency_ms, applied.p2p_bandwidth_gb_per_s, applied.runtime) == (0.2, 3.0, rt)


@pytest.mark.parametrize("data,field", [
    ({"p2p": {"latency_ms": 0.1}}, "runtime"),
    ({"runtime": {"send_ms": -1}}, "runtime.send_ms"),
    ({"runtime": {"send_ms": "fast"}}, "runtime.send_ms"),
    ({"runtime": {"compute_ms": {"F": -0.1}}}, "runtime.compute_ms.F"),
    ({"runtime": {"compute_ms": {"X": 1}}}, "runtime.compute_ms: unknown field(s) X"),
    ({"runtime": {"hurry_ms": 1}}, "unknown runtime field(s) hurry_ms"),
    ({"runtime": {}, "p2p": {"latency_ms": float("nan")}}, "p2p.latency_ms"),
    ({"runtime": {}, "p2p": {"bandwidth_gb_per_s": 0}}, "p2p.bandwidth_gb_per_s"),
    ({"runtime": {}, "extra": 1}, "unknown field(s) in the machine file: extra"),
    ([1, 2], "JSON object"),
])
def test_a_bad_machine_file_names_the_file_and_field(tmp_path, data, field):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        load_machine(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_a_missing_or_malformed_machine_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="nope.json: cannot read"):
        load_machine(tmp_path / "nope.json")
    path = tmp_path / "m.json"
    path.write_text("{")
    with pytest.raises(ValueError, match="m.json: not JSON"):
        load_machine(path)


# ---------------------------------------------------------------------- the calibration's analysis


def _rec(rank, step, kind, start_ms, end_ms):
    return {"rank": rank, "step": step, "kind": kind, "start": start_ms / 1e3, "end": end_ms / 1e3}


def test_collect_reads_each_cost_from_the_previous_records_end():
    """Hand-made records of a 2-rank run with F = 4 ms, B = 6 ms sleeps."""
    records = [
        _rec(0, "F.s0.m0", "compute", 0.0, 4.5),
        _rec(0, "SEND_F.s0.m0", "p2p-issue", 4.6, 4.8),           # send 0.3 from 4.5
        _rec(0, "RECV_B.s0.m0", "p2p-issue", 4.8, 5.0),           # receive 0.2
        _rec(0, "F.s0.m1", "compute", 5.0, 9.4),                  # local F 0.4
        _rec(0, "SEND_F.s0.m1", "p2p-issue", 9.5, 9.6),           # send 0.2
        _rec(1, "RECV_F.s1.m0", "p2p-issue", 0.0, 0.1),           # first record: no sample
        _rec(1, "RECV_F.s1.m0", "p2p-wait", 0.2, 5.0),            # waited since before the post at 4.6:
        _rec(1, "F.s1.m0", "compute", 5.0, 9.7),                  # latency 0.4, received F 0.7
        _rec(1, "B.s1.m0", "compute", 9.8, 16.2),                 # local B 0.5
        _rec(1, "RECV_F.s1.m1", "p2p-issue", 16.2, 16.3),         # receive 0.1
        _rec(1, "RECV_F.s1.m1", "p2p-wait", 16.35, 16.4),         # posted at 9.5, long there:
        _rec(1, "F.s1.m1", "compute", 16.4, 20.9),                # wait 0.05, F 20.9 - 16.3 - 4 - 0.05
    ]
    samples = Samples()
    collect(records, sleep_of(4.0, 6.0), samples)
    assert samples.values["send_ms"] == pytest.approx([0.3, 0.2])
    assert samples.values["recv_ms"] == pytest.approx([0.2, 0.1])
    assert samples.values["latency_ms"] == pytest.approx([0.4])
    assert samples.values["received_ms.F"] == pytest.approx([0.7])
    assert samples.values["compute_ms.B"] == pytest.approx([0.5])
    assert samples.values["wait_ms"] == pytest.approx([0.05])
    assert sorted(samples.values["compute_ms.F"]) == pytest.approx([0.4, 0.55])
    rt = runtime_costs(samples, run_ms=-3.0)
    assert rt.run_ms == 0.0 and rt.send_ms == pytest.approx(0.25)
    assert rt.compute_ms.I == pytest.approx((0.475 + 0.5) / 2)  # kinds without samples: the median of the others
    assert rt.received_ms.B == pytest.approx(0.5 + 0.7 - 0.475)  # compute + the others' extra when received


def test_with_runtime_costs_the_first_stages_whole_backward_is_its_weight_step():
    """The runtime's first stage has no input gradient: its I computes nothing, its W everything."""
    plain = sleep_costs(2, 1, 10.0, 20.0)
    assert (plain.stages[0].I, plain.stages[0].W) == (10.0, 10.0)
    steps = {0: [S("F.s0.m0"), S("SEND_F.s0.m0"), S("RECV_B.s0.m0"), S("I.s0.m0"), S("W.s0.m0")],
             1: [S("RECV_F.s1.m0"), S("F.s1.m0"), S("I.s1.m0"), S("SEND_B.s1.m0"), S("W.s1.m0")]}
    for runtime, first_w in ((None, (40.0, 50.0)), (RuntimeCosts(), (30.0, 50.0)),
                             (RuntimeCosts(run_ms=1.0), (30.0, 50.0))):
        costs = CostModel(stages=plain.stages, runtime=runtime)
        result = simulate(steps, {0: 0, 1: 1}, costs)
        spans = {str(step): (start, end) for start, end, step in result.timeline[0]}
        assert spans["W.s0.m0"] == pytest.approx(first_w)
    sleep = sleep_of(4.0, 6.0)
    assert [sleep(S(t)) for t in ("F.s0.m0", "I.s0.m0", "W.s0.m0", "I.s1.m0", "B.s1.m0")] == [4.0, 0.0, 6.0, 3.0, 6.0]


def test_a_metadata_receive_costs_meta_recv_ms_once_its_message_arrived():
    """rank 0: F ends 1 + 0.3; SEND_META posts 1.3-1.8 (its message leaves at 1.3); SEND_F posts at 1.8.
    rank 1: RECV_META waits for 1.3 + 0.2, then 2 more: 3.5; RECV_F posts until 3.6; its data came
    at 2.0, so F.s1 ends 3.6 + 1 + 0.3."""
    steps = {0: [S("F.s0.m0"), S("SEND_META.s0.m0"), S("SEND_F.s0.m0")],
             1: [S("RECV_META.s1.m0"), S("RECV_F.s1.m0"), S("F.s1.m0")]}
    rt = RuntimeCosts(compute_ms=PerKind(F=0.3), received_ms=PerKind(F=0.4), recv_ms=0.1, meta_ms=0.5,
                      meta_recv_ms=2.0)
    costs = CostModel(stages=(StageCost(F=1.0), StageCost(F=1.0)), p2p_latency_ms=0.2, runtime=rt)
    from hyper_parallel.core.pipeline_parallel.simulation.timed_model import run_timed

    outcome = run_timed(steps, {0: 0, 1: 1}, costs.step_time, costs.message_time, runtime=rt)
    assert outcome.compute[1][0][1] == pytest.approx(4.9)
    issue = {(r["rank"], r["step"]): (r["start"], r["end"]) for r in outcome.records if r["kind"] == "p2p-issue"}
    assert issue[(0, "SEND_META.s0.m0")] == pytest.approx((1.3, 1.8))
    assert issue[(1, "RECV_F.s1.m0")] == pytest.approx((3.5, 3.6))


def test_collect_measures_a_metadata_receive_to_the_end_of_the_data_receive_behind_it():
    records = [
        _rec(0, "F.s0.m0", "compute", 0.0, 4.5),
        _rec(0, "SEND_META.s0.m0", "p2p-issue", 4.5, 5.0),
        _rec(1, "RECV_F.s1.m9", "p2p-issue", 0.0, 0.1),
        _rec(1, "RECV_META.s1.m0", "p2p-issue", 0.1, 6.0),   # its message was posted at 4.5
        _rec(1, "RECV_F.s1.m0", "p2p-issue", 6.0, 7.5),      # the data receive behind it ends at 7.5
    ]
    samples = Samples()
    collect(records, sleep_of(4.0, 6.0), samples)
    assert samples.meta_receives == [pytest.approx((0.1, 4.5, 7.5))]
    assert samples.values["meta_ms"] == pytest.approx([0.5])
    rt = runtime_costs(samples, latency_ms=0.5)
    assert rt.meta_recv_ms == pytest.approx(7.5 - (4.5 + 0.5) - rt.recv_ms)


def test_a_metadata_receive_that_is_a_ranks_first_step_counts_from_its_own_start():
    records = [
        _rec(0, "SEND_META.s0.m0", "p2p-issue", 4.5, 5.0),
        _rec(1, "RECV_META.s1.m0", "p2p-issue", 0.2, 6.0),
        _rec(1, "RECV_F.s1.m0", "p2p-issue", 6.0, 7.5),
    ]
    samples = Samples()
    collect(records, sleep_of(4.0, 6.0), samples)
    assert samples.meta_receives == [pytest.approx((0.2, 4.5, 7.5))]
    assert "recv_ms" not in samples.values  # the data receive behind it is the metadata receive's


# ---------------------------------------------------------------------- inputs from another rank


def _arrival_violations(plan, result, costs):
    """Compute steps that start before an input made on another rank can have arrived there
    (made + message time: a send leaves no earlier than the end of the step that made it)."""
    made = {}
    for rank, items in result.timeline.items():
        for _, end, step in items:
            for part in step.parts:
                for key in produces(part):
                    made[key] = (end, rank)
    bad = []
    stages = len(plan.stage_to_rank)
    for rank, items in result.timeline.items():
        for start, _, step in items:
            for part in step.parts:
                for key in consumes(part, stages):
                    end, where = made[key]
                    if where != rank and start < end + costs.message_time(key) - 1e-9:
                        bad.append((rank, str(step), start, end + costs.message_time(key)))
    return bad


_SOME_RUNTIME = RuntimeCosts(compute_ms=PerKind(0.01, 0.02, 0.01, 0.01), received_ms=PerKind(0.3, 0.2, 0.1, 0.1),
                             send_ms=0.05, recv_ms=0.04, wait_ms=0.03, meta_ms=0.2, meta_recv_ms=0.5,
                             batch_ms=0.1, run_ms=1.0)


@pytest.mark.parametrize("name", sorted(available_schedules()))
@pytest.mark.parametrize("lowering", ["compute-only", "plain", "batch"])
def test_a_runtime_cost_never_starts_a_compute_step_before_its_input_arrived(name, lowering):
    """With a message slower than any step (10 ms), every input from another rank gates its
    consumer, lowered or not (finding: on compute-only lists the arrival was dropped)."""
    cls = available_schedules()[name]
    v = default_chunks(cls)
    for runtime in (None, RuntimeCosts(compute_ms=PerKind(0.01, 0.01, 0.01, 0.01)), _SOME_RUNTIME):
        costs = CostModel.per_rank_share(2, v, F=1.0, B=2.0, p2p_latency_ms=10.0, runtime=runtime)
        lowered = lowering != "compute-only"
        plan, result = simulate_schedule(cls, 2, v, 4, costs, lowered=lowered,
                                         transport="batch" if lowering == "batch" else "plain",
                                         **(RUNTIME_LOWERING if lowered else {}))
        assert _arrival_violations(plan, result, costs.for_stages(len(plan.stage_to_rank))) == []
        assert result.makespan > 30.0  # at least three 10 ms hops on every schedule's critical path


@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_tune_with_runtime_costs_lowers_the_searched_orders_like_the_library_schedules(transport):
    """Every candidate of ``tune(..., lowered=True)`` is simulated on the lists run() executes,
    searched orders too (they were simulated unlowered, with no post or metadata cost)."""
    from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, v_placement
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
    from hyper_parallel.core.pipeline_parallel.tools.tune import tune

    layer = StageCost(F=1.0, B=2.0, activation_bytes=100.0, param_bytes=10.0)
    costs = CostModel(stages=(layer,), layers=(layer,) * 8, micro_batch_size=2, p2p_latency_ms=0.5,
                      runtime=_SOME_RUNTIME)
    schedules = {"1f1b": available_schedules()["1f1b"]}
    result = tune(costs, 1000.0, 16, 2, schedules=schedules, chunk_options=(1, 2), micro_batches=(8,),
                  lowered=True, transport=transport, search=True)
    searched = [c for c in result.candidates if c.schedule.startswith("search-") and c.order is not None]
    assert searched
    model = "stream" if transport == "batch" else "eager"
    for cand in searched:
        placement = v_placement(2) if cand.schedule.startswith("search-v") else looped_placement(2, cand.num_chunks)
        stage_costs = costs.for_micro_batch_size(cand.micro_batch_size).for_stages(len(placement))
        steps = lower(cand.order, placement, transport, **RUNTIME_LOWERING)
        assert cand.makespan_ms == simulate(steps, placement, stage_costs, model=model).makespan


# ---------------------------------------------------------------------- monotonic from 0


def _random_runtime(rng):
    def per_kind():
        return PerKind(*(rng.choice([0.0, rng.uniform(0, 2)]) for _ in range(4)))
    return RuntimeCosts(compute_ms=per_kind(), received_ms=per_kind(),
                        **{name: rng.choice([0.0, rng.uniform(0, 2)]) for name in SCALARS})


def _raised(runtime, field, kind, by):
    if kind is None:
        return replace(runtime, **{field: getattr(runtime, field) + by})
    per_kind = getattr(runtime, field)
    return replace(runtime, **{field: replace(per_kind, **{kind: per_kind.get(kind) + by})})


def test_raising_any_runtime_figure_never_shortens_the_prediction():
    """From 0 (the reviewer's case: dualpipev, p = 2, m = 4, batch, 1.7 ms links: 31.6 ms with an
    empty runtime object, 31.1 ms with run_ms = 1e-9) and from a random base, over a seeded
    sample of schedules x chunk counts x transports x lowering."""
    rng = random.Random(25)
    schedules = sorted(available_schedules().items())
    fields = [(name, None) for name in SCALARS] + [(f, k) for f in ("compute_ms", "received_ms") for k in "FBIW"]

    def makespan(cls, p, v, m, runtime, transport, latency, lowered):
        costs = CostModel.per_rank_share(p, v, F=4.0, B=6.0, p2p_latency_ms=latency, runtime=runtime)
        return simulate_schedule(cls, p, v, m, costs, lowered=lowered, transport=transport,
                                 **(RUNTIME_LOWERING if lowered else {}))[1].makespan

    cls = available_schedules()["dualpipev"]
    zero = makespan(cls, 2, 2, 4, RuntimeCosts(), "batch", 1.7, True)
    assert makespan(cls, 2, 2, 4, RuntimeCosts(run_ms=1e-9), "batch", 1.7, True) >= zero
    checked = 0
    for _ in range(60):
        name, cls = rng.choice(schedules)
        low, high = chunk_range(cls)
        v = rng.randint(low, min(high, 3))
        p = rng.choice([2, 3])
        m = rng.choice([2 * p, 2 * p + 1])
        transport, lowered = rng.choice([("plain", True), ("batch", True), ("plain", False)])
        latency = rng.uniform(0, 3)
        field, kind = rng.choice(fields)
        try:
            for base in (RuntimeCosts(), _random_runtime(rng)):
                before = makespan(cls, p, v, m, base, transport, latency, lowered)
                for by in (1e-9, rng.uniform(0.01, 2)):
                    after = makespan(cls, p, v, m, _raised(base, field, kind, by), transport, latency, lowered)
                    assert after >= before - 1e-9, (name, p, v, m, transport, lowered, latency, field, kind, by, base)
        except ValueError:  # a count this schedule does not run
            continue
        checked += 1
    assert checked >= 30


# ---------------------------------------------------------------------- machine-file loader


@pytest.mark.parametrize("extra,field", [
    ({"stages": "x"}, "stages must be a list of objects, got 'x'"),
    ({"layers": 5}, "layers must be a list of objects, got 5"),
    ({"layers": [{"F": -1}]}, "layers[0]: F must be a finite number >= 0"),
    ({"stages": [{"G": 1}]}, "stages[0]: unknown field(s) G"),
    ({"overlap": "zzz"}, "overlap must be one of sum, max, got 'zzz'"),
    ({"micro_batch_size": -3}, "micro_batch_size must be an int >= 1, got -3"),
    ({"micro_batch_size": 2.5}, "micro_batch_size must be an int >= 1, got 2.5"),
    ({"p2p": 0}, "p2p must be an object"),
    ({"p2p": None}, "p2p must be an object"),
    ({"p2p": []}, "p2p must be an object"),
    ({"machine": "vm"}, "machine must be an object, got 'vm'"),
    ({"runtime": None}, "no 'runtime' object"),
])
def test_every_field_of_a_machine_file_is_checked(tmp_path, extra, field):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"format": "hyper-parallel-costs/1", "runtime": {}, **extra}))
    with pytest.raises(ValueError) as info:
        load_machine(path)
    assert str(path) in str(info.value) and field in str(info.value)


@pytest.mark.parametrize("extra,field", [({"p2p": 0}, "p2p must be an object"),
                                         ({"p2p": None}, "p2p must be an object"),
                                         ({"machine": 3}, "machine must be an object")])
def test_a_costs_file_checks_p2p_and_machine_as_objects(tmp_path, extra, field):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"stages": [{"F": 1}], **extra}))
    with pytest.raises(ValueError, match=field):
        load_costs(path)


def test_a_link_figure_the_machine_file_does_not_give_stays_the_costs_files(tmp_path):
    """calibrate writes a null bandwidth when it could not measure one: that is not an
    infinitely fast link; a machine file without p2p leaves the costs file's latency too."""
    costs = CostModel(stages=(StageCost(F=1.0, output_bytes=1e6),), p2p_latency_ms=0.7, p2p_bandwidth_gb_per_s=2.0)
    path = tmp_path / "m.json"
    for p2p, expected in (({"latency_ms": 0.2, "bandwidth_gb_per_s": None}, (0.2, 2.0)),
                          ({"latency_ms": 0.2}, (0.2, 2.0)),
                          (None, (0.7, 2.0)),
                          ({"bandwidth_gb_per_s": 5.0}, (0.7, 5.0)),
                          ({"latency_ms": 0.0, "bandwidth_gb_per_s": 9.0}, (0.0, 9.0))):
        data = {"format": "hyper-parallel-costs/1", "runtime": {"send_ms": 0.1}}
        if p2p is not None:
            data["p2p"] = p2p
        path.write_text(json.dumps(data))
        applied = load_machine(path).apply(costs)
        assert (applied.p2p_latency_ms, applied.p2p_bandwidth_gb_per_s) == expected
        assert applied.runtime == RuntimeCosts(send_ms=0.1)
    machine = Machine(RuntimeCosts(), 0.2, None)
    save_machine(machine, path)
    assert load_machine(path) == machine


def test_a_machine_file_with_stages_is_a_costs_file(tmp_path):
    """The docs call the machine file the costs format: --costs reads one (its machine object is ignored)."""
    machine = Machine(RuntimeCosts(send_ms=0.1), 0.2, 3.0, {"backend": "gloo", "nproc": 2})
    data = machine.to_json()
    data["stages"] = [{"F": 1.0, "B": 2.0}]
    path = tmp_path / "both.json"
    path.write_text(json.dumps(data))
    costs = load_costs(path)
    assert (costs.runtime, costs.p2p_latency_ms, costs.p2p_bandwidth_gb_per_s) == (machine.runtime, 0.2, 3.0)
    assert costs.stages == (StageCost(F=1.0, B=2.0),)
    assert load_machine(path) == machine


@pytest.mark.parametrize("loader", [load_costs, load_machine])
def test_json_nested_too_deeply_is_a_value_error_naming_the_file(tmp_path, loader):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="deep.json: JSON nested too deeply"):
        loader(path)
