"""The chain run's node-by-node and lane (numpy) runs against the exact model (``timed_model.py``),
for what the stream-speed work changed: ``batch`` lists lowered with prefetch and metadata
"first"/"all" for every catalog schedule, random per-stage costs (latency, bandwidth, FB pairs,
bytes), ``wait_at_post`` both ways, timelines on and off; and plain lists (eager, and the stream
model where they may deadlock) and compute-only lists in the lane run. Each run is forced: node by
node, in lanes to the end, and in lanes that stop after a round or two and go on node by node.
Every field of `simulate`'s result is compared as text (the same floats, not only equal ones),
records included, and the errors of jobs that cannot finish."""

from __future__ import annotations

import random

import pytest

from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError
from hyper_parallel.core.pipeline_parallel.simulation import fast_chain, fast_lanes
from hyper_parallel.core.pipeline_parallel.simulation import simulate as simulate_module
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost
from hyper_parallel.core.pipeline_parallel.simulation.fast_job import compile_job
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import PerKind, RuntimeCosts
from hyper_parallel.core.pipeline_parallel.simulation.simulate import SimulationResult, simulate
from hyper_parallel.core.pipeline_parallel.simulation.timed_model import run_timed
from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules

MODES = {  # module constants that force one run
    "nodes": {"LANES_MIN_NODES": 10 ** 18},
    "lanes": {"LANES_MIN_NODES": 0, "LANES_MIN_WIDTH": 0, "LANES_MIN_RATE": 0},
    "switch1": {"LANES_MIN_NODES": 0, "LANES_MIN_WIDTH": 0, "LANES_MIN_RATE": 10 ** 9, "_WINDOW": 1},
    "switch2": {"LANES_MIN_NODES": 0, "LANES_MIN_WIDTH": 0, "LANES_MIN_RATE": 10 ** 9, "_WINDOW": 2,
                "_FEW_LEFT": 0},  # and the lists of what is left filled item by item
}


def _force(monkeypatch, mode: str) -> None:
    for name, value in MODES[mode].items():
        monkeypatch.setattr(fast_lanes if name == "_WINDOW" else fast_chain, name, value)


def _shapes():
    """(name, class, p, v, m): a few shapes of every catalog schedule, p <= 6, v <= 4, several m."""
    rng = random.Random(20240611)
    for name, cls in available_schedules().items():
        valid = []
        for p in (2, 3, 4, 5, 6):
            for v in (1, 2, 3, 4):
                for m in (1, p, p + 1, 2 * p + 3):
                    try:
                        placement = dict(cls.stage_placement(p, v))
                        cls.generate(p, v, m)
                    except ValueError:
                        continue
                    valid.append((p, v, m, placement))
        picked = rng.sample(valid, min(5, len(valid)))
        largest = max(valid, key=lambda s: (s[0] * len(s[3]), s[2]))  # p = 6 with the most stages
        for p, v, m, placement in sorted({(s[0], s[1], s[2]): s for s in [*picked, largest]}.values(),
                                         key=lambda s: s[:3]):
            yield name, cls, p, v, m, placement


def _random_costs(seed: int, ranks: int, stages: int) -> CostModel:
    """Per-stage times (some equal, so that ties happen), FB pair times, bytes, latency, bandwidth."""
    rng = random.Random(seed)
    if seed % 4 == 0:  # uniform shares: many equal times
        return CostModel.per_rank_share(ranks, stages // ranks, activation_bytes=1.0).for_stages(stages)

    def time() -> float:
        return rng.choice((0.5, 1.0, 1.25, round(rng.uniform(0.1, 3.0), 3), rng.uniform(0.01, 2.0)))

    entries = []
    for _ in range(stages):
        i, w = time(), time()
        full = rng.uniform(1.0, 1e6)
        entries.append(StageCost(F=time(), B=rng.choice((i + w, time())), I=i, W=w,
                                 FB=rng.choice((None, time() * 2)), activation_bytes=full,
                                 activation_bytes_after_input=full * rng.uniform(0.0, 1.0),
                                 output_bytes=rng.choice((0.0, rng.uniform(1.0, 1e7)))))
    return CostModel(stages=tuple(entries), p2p_latency_ms=rng.choice((0.0, rng.uniform(0.0, 0.5))),
                     p2p_bandwidth_gb_per_s=rng.choice((None, rng.uniform(0.5, 50.0))))


def _jobs():
    """(id, steps, placement, costs, model) of every case."""
    for number, (name, cls, p, v, m, placement) in enumerate(_shapes()):
        compute = cls.generate(p, v, m)
        costs = _random_costs(number, p, len(placement))
        base = f"{name}-{p}-{v}-{m}"
        for metadata in ("first", "all"):
            steps = lower(compute, placement, "batch", metadata=metadata, prefetch=True)
            yield f"{base}-batch-prefetch-{metadata}", steps, placement, costs, "stream"
        if number % 2 == 0:
            yield f"{base}-compute", compute, placement, costs, "eager"
            yield f"{base}-plain-eager", lower(compute, placement, "plain"), placement, costs, "eager"
        else:
            yield f"{base}-plain-stream", lower(compute, placement, "plain", metadata="first"), placement, costs, \
                "stream"  # may deadlock: the same error
            yield f"{base}-batch-eager", lower(compute, placement, "batch", prefetch=True), placement, costs, "eager"


JOBS = list(_jobs())


def _exact(monkeypatch, steps, placement, costs, model, wait_at_post):
    with monkeypatch.context() as patch:
        patch.setattr(simulate_module, "run_timed_fast", lambda *a, **k: None)
        try:
            return simulate(steps, placement, costs, model=model, wait_at_post=wait_at_post)
        except ScheduleError as exc:
            return str(exc)


def _numbers(result: SimulationResult) -> str:
    return repr((result.makespan, result.bubble_fraction, result.bubble_per_rank, result.busy,
                 result.peak_activations, result.peak_activation_bytes, result.summary()))


@pytest.mark.parametrize("wait_at_post", [False, True])
@pytest.mark.parametrize("case", JOBS, ids=[j[0] for j in JOBS])
def test_every_run_gives_the_exact_result(case, wait_at_post, monkeypatch):
    _, steps, placement, costs, model = case
    exact = _exact(monkeypatch, steps, placement, costs, model, wait_at_post)
    for mode in MODES:
        with monkeypatch.context() as patch:
            _force(patch, mode)
            for timelines in (True, False):
                try:
                    fast = simulate(steps, placement, costs, model=model, wait_at_post=wait_at_post,
                                    timelines=timelines)
                except ScheduleError as exc:
                    assert str(exc) == exact, mode
                    continue
                assert not isinstance(exact, str), f"{mode}: finished where the exact model reports {exact}"
                assert _numbers(fast) == _numbers(exact), mode
                if timelines:
                    assert repr(fast.timeline) == repr(exact.timeline), mode
                    for rank, timeline in exact.timeline.items():  # the very step objects
                        assert all(x[2] is y[2] for x, y in zip(timeline, fast.timeline[rank]))
                    assert repr(fast.records) == repr(exact.records), mode
                elif any(fast.timeline.values()):  # "may be left empty": the general run (OVERLAP steps) fills them
                    assert repr(fast.timeline) == repr(exact.timeline), mode


@pytest.mark.parametrize("case", JOBS[::3], ids=[j[0] for j in JOBS[::3]])
def test_the_forced_run_is_the_one_taken(case, monkeypatch):
    """Each mode really runs (a job the exact model finishes is not handed to the general run),
    and the lane plan is the one chosen where the mode asks for it."""
    _, steps, placement, costs, model = case
    link = lambda kind, stage: costs.message_time((kind, stage, 0))  # noqa: E731
    job = compile_job(steps, placement, costs.step_time, link, lowered=None, wait_at_post=False)
    exact = run_timed(steps, placement, costs.step_time, costs.message_time,
                      lowered=any(s is not None and s.meta_type.is_comm for ss in steps.values() for s in ss),
                      model=model)
    overlap = any(s is not None and s.meta_type.is_overlap for ss in steps.values() for s in ss)
    for mode in MODES:
        with monkeypatch.context() as patch:
            _force(patch, mode)
            plan = fast_chain._Plan.make(job, False, model == "stream")
            outcome = fast_chain.run_chain(job, len(placement), False, model == "stream")
        assert plan is not None or overlap
        if plan is not None:
            assert plan.lanes == (mode != "nodes") or (overlap and not plan.lanes)
        if exact.finished and plan is not None:
            assert outcome is not None, mode
            assert outcome.finish == exact.finish and outcome.compute == exact.compute, mode
        else:
            assert outcome is None


def test_runtime_costs_still_take_the_exact_model(monkeypatch):
    """A machine file's runtime costs: the fast runs decline them (the exact model charges them)."""
    name, cls, p, v, m, placement = next(s for s in _shapes() if s[0] == "interleaved-1f1b" and s[2] > 1)
    steps = lower(cls.generate(p, v, m), placement, "batch", metadata="first", prefetch=True)
    base = _random_costs(3, p, len(placement))
    runtime = RuntimeCosts(compute_ms=PerKind(0.01, 0.02, 0.015, 0.005), received_ms=PerKind(0.03, 0.01, 0.0, 0.0),
                           batch_ms=0.004, meta_ms=0.002, meta_recv_ms=0.001, wait_ms=0.003, run_ms=0.5)
    costs = CostModel(stages=base.stages, p2p_latency_ms=base.p2p_latency_ms,
                      p2p_bandwidth_gb_per_s=base.p2p_bandwidth_gb_per_s, runtime=runtime)
    for mode in ("nodes", "lanes"):
        with monkeypatch.context() as patch:
            _force(patch, mode)
            fast = simulate(steps, placement, costs, model="stream")
        exact = _exact(monkeypatch, steps, placement, costs, "stream", False)
        assert _numbers(fast) == _numbers(exact)
        assert repr(fast.records) == repr(exact.records)


def test_a_large_job_runs_in_lanes_by_default_and_exactly(monkeypatch):
    """Interleaved 1F1B over 32 ranks (41 000 nodes, 64 lanes): the default thresholds pick the lanes."""
    cls = available_schedules()["interleaved-1f1b"]
    p, v, m = 32, 2, 160
    placement = dict(cls.stage_placement(p, v))
    steps = lower(cls.generate(p, v, m), placement, "batch", metadata="first", prefetch=True)
    costs = _random_costs(5, p, len(placement))
    link = lambda kind, stage: costs.message_time((kind, stage, 0))  # noqa: E731
    job = compile_job(steps, placement, costs.step_time, link, lowered=None, wait_at_post=False)
    assert fast_chain._Plan.make(job, False, True).lanes
    fast = simulate(steps, placement, costs, model="stream")
    exact = _exact(monkeypatch, steps, placement, costs, "stream", False)
    assert _numbers(fast) == _numbers(exact)
    assert repr(fast.timeline) == repr(exact.timeline)
    assert repr(fast.records[::97]) == repr(exact.records[::97])


@pytest.mark.parametrize("shift", [2 ** 52 - 8, 2 ** 52, 2 ** 60, 2 ** 64])
def test_huge_micro_batch_indices_give_the_exact_result(shift, monkeypatch):
    """Indices the int64 keys cannot hold (read straight into int64 now): declined, and the exact
    model's result comes out (below 2**52: run fast, and equal)."""
    from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep

    cls = available_schedules()["1f1b"]
    placement = dict(cls.stage_placement(3, 1))

    def moved(step):
        subs = None if step.sub_steps is None else tuple(moved(s) for s in step.sub_steps)
        micro = None if step.micro_index is None else step.micro_index + shift
        return MetaStep(micro, step.meta_type, step.stage_index, subs)

    for transport in ("plain", "batch"):
        steps = {rank: [moved(s) for s in ss] for rank, ss in lower(cls.generate(3, 1, 4), placement, transport,
                                                                     metadata="first").items()}
        costs, model = _random_costs(7, 3, 3), "stream" if transport == "batch" else "eager"
        link = lambda kind, stage: costs.message_time((kind, stage, 0))  # noqa: E731
        compiled = compile_job(steps, placement, costs.step_time, link, lowered=None, wait_at_post=False)
        assert (compiled is None) == (shift + 4 >= 2 ** 52)  # declined from 2**52 on, as the float path did
        for mode in ("nodes", "lanes"):
            with monkeypatch.context() as patch:
                _force(patch, mode)
                fast = simulate(steps, placement, costs, model=model)
            exact = _exact(monkeypatch, steps, placement, costs, model, False)
            assert _numbers(fast) == _numbers(exact)
            assert repr(fast.records) == repr(exact.records)
