"""The fast timed run (``fast_timed.py``) against the exact model (``timed_model.py``): every
compute (start, end, step), every record, finish times, and what `simulate` makes of them
(makespan, bubbles, peaks) must be equal, for every library schedule, compute-only and lowered,
eager and stream, with and without metadata and prefetch, uniform and uneven costs."""

from __future__ import annotations

import pytest

import hyper_parallel.core.pipeline_parallel as pp
from hyper_parallel.core.pipeline_parallel.ir import MetaStep
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError
from hyper_parallel.core.pipeline_parallel.simulation import simulate as simulate_module
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost
from hyper_parallel.core.pipeline_parallel.simulation.fast_timed import run_timed_fast
from hyper_parallel.core.pipeline_parallel.simulation.simulate import (
    SimulationResult, peak_activation_bytes, peak_activations, simulate,
)
from hyper_parallel.core.pipeline_parallel.simulation.timed_model import run_timed

_T = MetaStepType
CLASSES = [pp.ScheduleGPipe, pp.Schedule1F1B, pp.ScheduleInterleaved1F1B, pp.ScheduleLoopedBFS,
           pp.ScheduleInterleavedZeroBubble, pp.ScheduleZBVZeroBubble, pp.ScheduleDualPipeV]
SHAPES = [(2, 1, 3), (3, 2, 5), (4, 2, 8)]


def uneven(num_stages: int) -> CostModel:
    """Different times per stage (not binary fractions), FB pair times on some stages, bytes per
    message so that F, G and metadata messages take different times."""
    return CostModel(
        stages=tuple(StageCost(F=1.0 + 0.1 * (k % 3), B=2.0 + 0.07 * k, I=1.1 + 0.03 * k, FB=2.5 if k % 2 else None,
                               activation_bytes=1.0 + k, activation_bytes_after_input=0.5 * k + 1.3,
                               output_bytes=1000.0 * (k + 1)) for k in range(num_stages)),
        p2p_latency_ms=0.13, p2p_bandwidth_gb_per_s=0.01)


def jobs():
    """(id, steps, placement, costs, lowered, model) for every case compared."""
    for cls in CLASSES:
        for p, v, m in SHAPES:
            try:
                placement = dict(cls.stage_placement(p, v))
                compute = cls.generate(p, v, m)
            except ValueError:
                continue  # the schedule does not run these counts
            n = len(placement)
            for cost_name, costs in (("uniform", CostModel.per_rank_share(p, n // p).for_stages(n)),
                                     ("uneven", uneven(n))):
                name = f"{cls.__name__}-{p}-{v}-{m}-{cost_name}"
                yield f"{name}-compute", compute, placement, costs, False, "eager"
                for transport, model in (("plain", "eager"), ("batch", "stream"), ("batch", "eager"),
                                         ("plain", "stream")):
                    for metadata in ("none", "first", "all"):
                        for prefetch in (False, True):
                            steps = lower(compute, placement, transport, metadata=metadata, prefetch=prefetch)
                            yield (f"{name}-{transport}-{model}-{metadata}-{prefetch}", steps, placement, costs,
                                   True, model)


JOBS = list(jobs())


def _link(costs: CostModel):
    return lambda kind, stage: costs.message_time((kind, stage, 0))


@pytest.mark.parametrize("wait_at_post", [False, True])
@pytest.mark.parametrize("case", JOBS, ids=[j[0] for j in JOBS])
def test_fast_run_equals_the_exact_model(case, wait_at_post):
    _, steps, placement, costs, lowered, model = case
    exact = run_timed(steps, placement, costs.step_time, costs.message_time, lowered=lowered, model=model,
                      wait_at_post=wait_at_post)
    fast = run_timed_fast(steps, placement, costs.step_time, _link(costs), lowered=lowered, model=model,
                          wait_at_post=wait_at_post)
    if not exact.finished:
        assert fast is None  # the caller runs the exact model, which reports the stuck ranks
        return
    assert fast is not None, "the fast run declined a job the exact model finishes"
    assert fast.finished
    assert fast.finish == exact.finish
    assert fast.compute == exact.compute
    for rank, timeline in exact.compute.items():  # the very step objects, not only equal ones
        assert all(a[2] is b[2] for a, b in zip(timeline, fast.compute[rank]))
    assert fast.records == exact.records


def _exact_only(monkeypatch):
    monkeypatch.setattr(simulate_module, "run_timed_fast", lambda *a, **k: None)


def _same_result(a: SimulationResult, b: SimulationResult) -> None:
    assert a.makespan == b.makespan
    assert a.bubble_fraction == b.bubble_fraction
    assert a.bubble_per_rank == b.bubble_per_rank
    assert a.busy == b.busy
    assert a.peak_activations == b.peak_activations
    assert a.peak_activation_bytes == b.peak_activation_bytes
    assert a.timeline == b.timeline
    assert a.records == b.records
    assert a.summary() == b.summary()


@pytest.mark.parametrize("case", JOBS[::7], ids=[j[0] for j in JOBS[::7]])
def test_simulate_gives_the_exact_result(case, monkeypatch):
    _, steps, placement, costs, _, model = case
    outcomes = []
    for exact_only in (False, True):
        if exact_only:
            _exact_only(monkeypatch)
        try:
            outcomes.append(simulate(steps, placement, costs, model=model))
        except ScheduleError as exc:  # a plain list under the stream model may deadlock
            outcomes.append(str(exc))
    if isinstance(outcomes[1], str):
        assert outcomes[0] == outcomes[1]
    else:
        _same_result(*outcomes)


def test_stuck_lists_raise_the_same_error(monkeypatch):
    placement = dict(pp.Schedule1F1B.stage_placement(3, 1))
    compute = pp.Schedule1F1B.generate(3, 1, 4)
    broken = {rank: list(steps) for rank, steps in lower(compute, placement, "plain").items()}
    broken[1] = broken[1][::-1]  # receives after the steps that need them
    costs = CostModel.per_rank_share(3, 1).for_stages(3)
    texts = []
    for exact_only in (False, True):
        if exact_only:
            _exact_only(monkeypatch)
        with pytest.raises(ScheduleError) as caught:
            simulate(broken, placement, costs)
        texts.append(str(caught.value))
    assert texts[0] == texts[1]
    assert "wait forever" in texts[0]


def test_odd_lists_fall_back_to_the_exact_model():
    placement = {0: 0, 1: 1}
    f0, f1 = MetaStep(0, _T.FWD, 0), MetaStep(0, _T.FWD, 1)
    twice = {0: [f0, f0], 1: [f1]}  # a value made twice: the exact model's answer depends on the order
    assert run_timed_fast(twice, placement, lambda s: 1.0, lambda k, s: 0.5, lowered=False) is None
    exact = run_timed(twice, placement, lambda s: 1.0, lambda k: 0.5, lowered=False)
    assert exact.finished
    unmade = {0: [], 1: [f1]}  # waits for a forward nobody runs
    assert run_timed_fast(unmade, placement, lambda s: 1.0, lambda k, s: 0.5, lowered=False) is None


def test_records_are_made_on_first_use_and_stay_a_list():
    placement = dict(pp.Schedule1F1B.stage_placement(2, 1))
    result = simulate(pp.Schedule1F1B.generate(2, 1, 2), placement)
    assert "_records_or_source" in vars(result) and not isinstance(vars(result)["_records_or_source"], list)
    records = result.records
    assert isinstance(records, list) and records and result.records is records
    assert {r["kind"] for r in records} >= {"compute", "p2p-wait"}
    result.records = []
    assert result.records == []
    plain = SimulationResult(1.0, 0.0, {}, {}, records=[{"rank": 0}])
    assert plain.records == [{"rank": 0}]


def _reference_peaks(steps, costs):
    """`peak_activations` and `peak_activation_bytes` as they were written first (part by part)."""
    live = peak = 0
    for step in steps:
        if step is None:
            continue
        kinds = [part.meta_type for part in step.parts]
        live += kinds.count(_T.FWD)
        peak = max(peak, live)
        live -= kinds.count(_T.BWD) + kinds.count(_T.BWD_WEIGHT)
    count = peak
    live = peak = 0.0
    for step in steps:
        if step is None:
            continue
        for part in step.parts:
            if part.meta_type is _T.FWD:
                live += costs.stage(part.stage_index).activation_bytes
        peak = max(peak, live)
        for part in step.parts:
            stage = costs.stage(part.stage_index)
            if part.meta_type is _T.BWD:
                live -= stage.activation_bytes
            elif part.meta_type is _T.BWD_INPUT:
                live -= stage.activation_bytes - stage.activation_bytes_after_input
            elif part.meta_type is _T.BWD_WEIGHT:
                live -= stage.activation_bytes_after_input
    return count, peak


@pytest.mark.parametrize("case", JOBS[::3], ids=[j[0] for j in JOBS[::3]])
def test_peaks_equal_the_part_by_part_count(case):
    _, steps, _, costs, _, _ = case
    for rank_steps in steps.values():
        assert (peak_activations(rank_steps), peak_activation_bytes(rank_steps, costs)) == \
            _reference_peaks(rank_steps, costs)


# ---------------------------------------------------------------------- round 2: chain run, numpy peaks


def _compiled(case, wait_at_post):
    from hyper_parallel.core.pipeline_parallel.simulation.fast_job import compile_job

    _, steps, placement, costs, lowered, _ = case
    return compile_job(steps, placement, costs.step_time, _link(costs), lowered=lowered, wait_at_post=wait_at_post)


@pytest.mark.parametrize("wait_at_post", [False, True])
@pytest.mark.parametrize("case", JOBS, ids=[j[0] for j in JOBS])
def test_chain_run_is_taken_and_equals_the_exact_model(case, wait_at_post):
    """The chain run itself (not a fallback behind it) gives the exact model's outcome wherever it
    finishes, eager and stream, and declines only where the exact model does not finish or (with
    OVERLAP steps) a node would have more than six inputs."""
    from hyper_parallel.core.pipeline_parallel.simulation.fast_chain import _Plan, run_chain

    _, steps, placement, costs, lowered, model = case
    exact = run_timed(steps, placement, costs.step_time, costs.message_time, lowered=lowered, model=model,
                      wait_at_post=wait_at_post)
    job = _compiled(case, wait_at_post)
    assert job is not None
    chain = run_chain(job, len(placement), wait_at_post, model == "stream")
    if chain is None:
        if _Plan.make(job, wait_at_post, model == "stream") is None:
            assert any(s is not None and s.meta_type.is_overlap for ss in steps.values() for s in ss)
        else:
            assert not exact.finished
        return
    assert exact.finished
    assert chain.finish == exact.finish
    assert chain.compute == exact.compute
    for rank, timeline in exact.compute.items():
        assert all(x[2] is y[2] for x, y in zip(timeline, chain.compute[rank]))
    assert chain.records == exact.records


@pytest.mark.parametrize("case", JOBS[::2], ids=[j[0] for j in JOBS[::2]])
def test_general_run_still_equals_the_exact_model(case, monkeypatch):
    """The general fast run, behind the chain run, stays exact."""
    from hyper_parallel.core.pipeline_parallel.simulation import fast_timed

    monkeypatch.setattr(fast_timed, "run_chain", lambda *a: None)
    _, steps, placement, costs, lowered, model = case
    exact = run_timed(steps, placement, costs.step_time, costs.message_time, lowered=lowered, model=model)
    fast = run_timed_fast(steps, placement, costs.step_time, _link(costs), lowered=lowered, model=model)
    if not exact.finished:
        assert fast is None
        return
    assert fast.finish == exact.finish and fast.compute == exact.compute and fast.records == exact.records


@pytest.mark.parametrize("case", JOBS, ids=[j[0] for j in JOBS])
def test_numpy_peaks_equal_the_loops(case):
    from hyper_parallel.core.pipeline_parallel.simulation.fast_summary import fast_peaks

    _, steps, _, costs, _, _ = case
    job = _compiled(case, False)
    found = fast_peaks(steps, job, costs)
    if found is None:  # OVERLAP steps: counted by the loops
        assert any(s is not None and s.meta_type.is_overlap for ss in steps.values() for s in ss)
        return
    peaks, peak_bytes = found
    assert list(peaks) == list(steps) and list(peak_bytes) == list(steps)
    for rank, rank_steps in steps.items():
        assert peaks[rank] == peak_activations(rank_steps)
        assert type(peak_bytes[rank]) is float
        assert peak_bytes[rank] == peak_activation_bytes(rank_steps, costs)


def test_numpy_peaks_follow_the_order_of_additions():
    """Bytes whose sum depends on the order (0.1 + 0.2 - 0.1 is not 0.2): still the loop's floats."""
    from hyper_parallel.core.pipeline_parallel.simulation.fast_job import compile_job
    from hyper_parallel.core.pipeline_parallel.simulation.fast_summary import fast_peaks

    costs = CostModel(stages=tuple(StageCost(F=1.0, B=2.0, activation_bytes=b, activation_bytes_after_input=b / 3)
                                   for b in (0.1, 0.2, 0.7, 1e16)))
    placement = {0: 0, 1: 0, 2: 0, 3: 0}
    order = [MetaStep(0, _T.FWD, 0), MetaStep(0, _T.FWD, 1), MetaStep(0, _T.FWD, 3), MetaStep(0, _T.BWD_INPUT, 3),
             MetaStep(0, _T.FWD, 2), MetaStep(0, _T.BWD_WEIGHT, 3), MetaStep(0, _T.BWD, 2), MetaStep(0, _T.BWD, 1),
             MetaStep(0, _T.BWD, 0)]
    steps = {0: order}
    job = compile_job(steps, placement, costs.step_time, _link(costs), lowered=False, wait_at_post=False)
    peaks, peak_bytes = fast_peaks(steps, job, costs)
    assert peaks == {0: peak_activations(order)}
    assert peak_bytes == {0: peak_activation_bytes(order, costs)}


@pytest.mark.parametrize("model", ["eager", "stream"])
def test_a_receive_nobody_consumes_still_ends_its_rank(model):
    """A rank is done when its last message completed, even when no step of it consumes the value."""
    from hyper_parallel.core.pipeline_parallel.simulation.fast_chain import run_chain

    placement = {0: 0, 1: 1}
    steps = {0: [MetaStep(0, _T.FWD, 0), MetaStep(0, _T.FWD_SEND, 0)], 1: [MetaStep(0, _T.FWD_RECV, 1)]}
    costs = CostModel.per_rank_share(2, 1).for_stages(2)
    costs = CostModel(stages=costs.stages, p2p_latency_ms=0.25)
    exact = run_timed(steps, placement, costs.step_time, costs.message_time, model=model)
    job = _compiled(("", steps, placement, costs, True, model), False)
    chain = run_chain(job, 2, False, model == "stream")
    assert chain is not None and exact.finish[1] > 0.0 and exact.finish[0] > 0.0
    assert chain.finish == exact.finish and chain.records == exact.records


def test_busy_and_lowered_detection_as_written_before():
    """`simulate`'s busy time (sum of step lengths in order) and its test for a lowered list, now made in C,
    against the loops they replace."""
    import random

    from hyper_parallel.core.pipeline_parallel.simulation.simulate import _busy, _has_communication

    rng = random.Random(7)
    step = MetaStep(0, _T.FWD, 0)
    for size in (0, 1, 5, 1000):
        points = sorted(rng.uniform(0, 1e6) * rng.choice((1e-9, 1.0, 3.7)) for _ in range(2 * size))
        timeline = [(points[2 * k], points[2 * k + 1], step) for k in range(size)]
        assert repr(_busy(timeline)) == repr(sum(end - start for start, end, _ in timeline))
    for _, steps, *_ in JOBS[::5]:
        holes = {rank: [None, *ss, None] for rank, ss in steps.items()}
        expected = any(s is not None and s.meta_type.is_comm for ss in holes.values() for s in ss)
        assert _has_communication(holes) == expected


@pytest.mark.parametrize("wait_at_post", [False, True])
@pytest.mark.parametrize("case", JOBS[::2], ids=[j[0] for j in JOBS[::2]])
def test_numbers_only_equal_the_full_result(case, wait_at_post):
    """`simulate(..., timelines=False)` (what the tuner asks for) gives every number of the full run."""
    _, steps, placement, costs, _, model = case
    try:
        full = simulate(steps, placement, costs, model=model, wait_at_post=wait_at_post)
    except ScheduleError as exc:
        with pytest.raises(ScheduleError) as caught:
            simulate(steps, placement, costs, model=model, wait_at_post=wait_at_post, timelines=False)
        assert str(caught.value) == str(exc)
        return
    numbers = simulate(steps, placement, costs, model=model, wait_at_post=wait_at_post, timelines=False)
    assert numbers.summary() == full.summary()
    assert numbers.busy == full.busy and numbers.bubble_per_rank == full.bubble_per_rank
    assert numbers.peak_activations == full.peak_activations
    assert numbers.peak_activation_bytes == full.peak_activation_bytes
    assert (numbers.makespan, numbers.bubble_fraction) == (full.makespan, full.bubble_fraction)


@pytest.mark.parametrize("case", JOBS[1::2], ids=[j[0] for j in JOBS[1::2]])
def test_lowered_read_off_the_lists(case):
    """``lowered=None`` (what `simulate` passes): the same run as with the flag `simulate` used to compute."""
    _, steps, placement, costs, lowered, model = case
    given = run_timed_fast(steps, placement, costs.step_time, _link(costs), lowered=lowered, model=model)
    found = run_timed_fast(steps, placement, costs.step_time, _link(costs), lowered=None, model=model)
    if given is None:
        assert found is None
        return
    assert found.compute == given.compute and found.finish == given.finish and found.records == given.records


# ---------------------------------------------------------------------- review findings


def _small_job():
    return pp.Schedule1F1B.generate(2, 1, 2), dict(pp.Schedule1F1B.stage_placement(2, 1))


@pytest.mark.parametrize("lowered", [False, True])
def test_a_result_pickles_before_its_records_are_read(lowered):
    """Review: the records' recipe held a local function, so a fresh result did not pickle."""
    import pickle

    steps, placement = _small_job()
    if lowered:
        steps = lower(steps, placement, "plain")
    result = simulate(steps, placement)
    again = pickle.loads(pickle.dumps(result))
    assert again.records == result.records and again.makespan == result.makespan


@pytest.mark.parametrize("edit", [lambda tl: tl.clear(), lambda tl: tl.sort(key=lambda e: -e[1]),
                                  lambda tl: tl.__setitem__(0, (tl[0][0] + 10, tl[0][1] + 10, tl[0][2]))])
def test_changing_a_timeline_before_reading_the_records_changes_no_record(edit, monkeypatch):
    """Review: the records were built later from the very lists handed to the caller."""
    steps, placement = _small_job()
    fast = simulate(steps, placement)
    edit(fast.timeline[1])
    _exact_only(monkeypatch)
    assert fast.records == simulate(steps, placement).records


def test_rank_ids_an_int_array_would_change_give_the_exact_result(monkeypatch):
    """Review: ranks 0.2, 0.4, 0.6 all became 0 in the compiled arrays (makespan 0)."""
    steps, placement = pp.Schedule1F1B.generate(3, 1, 3), dict(pp.Schedule1F1B.stage_placement(3, 1))
    ids = {0: 0.2, 1: 0.4, 2: 0.6}
    odd_steps = {ids[r]: s for r, s in steps.items()}
    odd_placement = {s: ids[r] for s, r in placement.items()}
    fast = simulate(odd_steps, odd_placement)
    _exact_only(monkeypatch)
    _same_result(fast, simulate(odd_steps, odd_placement))
    assert fast.makespan > 0
