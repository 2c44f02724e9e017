"""The lists the tools simulate for a transport (`runtime_costs.run_lowering`)."""

from __future__ import annotations

import random

import pytest

from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import (
    RUNTIME_LOWERING, RuntimeCosts, run_lowering,
)
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule
from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, chunk_range
from hyper_parallel.core.pipeline_parallel.tools.tune import evaluate, tune


def test_the_options_of_run():
    assert run_lowering("batch", False) == RUNTIME_LOWERING == run_lowering("plain", True)
    assert run_lowering("batch", True, overlap_p2p=False) == {"prefetch": False, "metadata": "first"}
    assert run_lowering("batch", False, overlap_p2p=False) == {"prefetch": False, "metadata": "first"}
    assert run_lowering("plain", False) == run_lowering("plain", False, overlap_p2p=False) == {}


def _cases():
    rng = random.Random(7)
    for name, cls in sorted(available_schedules().items()):
        low, high = chunk_range(cls)
        for p in (1, 2, 3, 4):
            for v in range(low, min(high, 3) + 1):
                for m in sorted({1, p, 2 * p + 1}):
                    yield pytest.param(cls, p, v, m, rng.randrange(1 << 30), id=f"{name}-p{p}-v{v}-m{m}")


@pytest.mark.parametrize(("cls", "p", "v", "m", "seed"), list(_cases()))
def test_plain_lists_without_prefetch_time_like_those_of_run(cls, p, v, m, seed):
    """Without runtime costs, the plain lists without prefetch or metadata (what the tools
    lower) give every compute step the times of the lists run() executes, under random costs
    and links (the claim of run_lowering)."""
    rng = random.Random(seed)
    try:
        stages = len(cls.stage_placement(p, v))
    except ValueError:
        pytest.skip("placement refused")
    entries = tuple(StageCost(F=rng.choice([0.0, 0.5, 1.0, 3.0]), B=rng.choice([0.0, 1.0, 2.0, 5.0]),
                              output_bytes=rng.choice([0.0, 1e6, 1e8]), activation_bytes=rng.random())
                    for _ in range(stages))
    link = rng.choice([{}, {"p2p_latency_ms": 0.3}, {"p2p_latency_ms": 0.1, "p2p_bandwidth_gb_per_s": 1.0}])
    costs = CostModel(stages=entries, **link)
    outcomes = []
    for options in (run_lowering("plain", False), RUNTIME_LOWERING, {"prefetch": False, "metadata": "first"}):
        try:
            _, result = simulate_schedule(cls, p, v, m, costs, transport="plain", **options)
        except ValueError as exc:
            outcomes.append(type(exc))
            continue
        outcomes.append((result.makespan, result.timeline, result.busy, result.peak_activation_bytes))
    assert outcomes[0] == outcomes[1] == outcomes[2]


LAYER = StageCost(F=1.0, B=2.0, activation_bytes=100.0, output_bytes=1e6, param_bytes=10.0)
COSTS = CostModel(stages=(LAYER,), layers=(LAYER,) * 8, micro_batch_size=1, p2p_latency_ms=0.2)


@pytest.mark.parametrize("runtime", [None, RuntimeCosts(send_ms=0.05, recv_ms=0.04, batch_ms=0.1, meta_ms=0.2)])
@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("overlap", [True, False])
def test_tune_lowers_each_candidate_as_run_does(runtime, transport, overlap):
    from dataclasses import replace

    costs = replace(COSTS, runtime=runtime)
    schedules = {k: v for k, v in available_schedules().items() if k in ("1f1b", "interleaved-1f1b")}
    result = tune(costs, 1e12, 8, 4, schedules=schedules, chunk_options=(1, 2), micro_batches=[8], lowered=True,
                  transport=transport, overlap_p2p=overlap)
    assert len(result.candidates) == 2
    for cand in result.candidates:
        cls = schedules[cand.schedule]
        stage_costs = costs.for_stages(len(cls.stage_placement(4, cand.num_chunks)), allow_even_split=True)
        _, expected = simulate_schedule(cls, 4, cand.num_chunks, 8, stage_costs, transport=transport,
                                        prefetch=overlap, metadata="first")
        assert cand.makespan_ms == expected.makespan
    alone = evaluate(schedules["interleaved-1f1b"], "interleaved-1f1b", costs, 4, 2, 8, 8, 1e12, lowered=True,
                     transport=transport, overlap_p2p=overlap)
    assert alone == next(c for c in result.candidates if c.num_chunks == 2)


def test_tune_refuses_a_non_bool_overlap():
    with pytest.raises(TypeError, match="overlap_p2p must be a bool, got 1"):
        tune(COSTS, 1e12, 8, 4, overlap_p2p=1)


@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("overlap", [True, False])
def test_tune_lowers_searched_orders_as_run_does(transport, overlap):
    from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, v_placement
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate

    result = tune(COSTS, 1e12, 8, 4, schedules={}, chunk_options=(1, 2), micro_batches=[8], lowered=True,
                  transport=transport, overlap_p2p=overlap, search=True)
    searched = [c for c in result.candidates if c.order is not None]
    assert len(searched) == 6
    for cand in searched:
        placement = v_placement(4) if cand.schedule.startswith("search-v") else looped_placement(4, cand.num_chunks)
        stage_costs = COSTS.for_stages(len(placement), allow_even_split=True)
        lists = lower(cand.order, placement, transport, prefetch=overlap, metadata="first")
        expected = simulate(lists, placement, stage_costs, model="stream" if transport == "batch" else "eager")
        assert cand.makespan_ms == expected.makespan
