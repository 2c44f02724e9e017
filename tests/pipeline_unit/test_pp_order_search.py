"""Searched step orders: valid, within the memory limit, and as fast as the schedules they rival."""

from __future__ import annotations

import pytest

from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.tools.order_search import greedy_order
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, v_placement
from hyper_parallel.core.pipeline_parallel.ir.schedule_csv import format_schedule_csv, parse_schedule_csv
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_lowered

UNIT = StageCost(F=1.0, I=1.0, W=1.0, activation_bytes=1.0, output_bytes=1.0)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_v_placement_with_1f1b_memory(p, k):
    m = k * p
    placement = v_placement(p)
    costs = CostModel(stages=(UNIT,) * (2 * p))
    order = greedy_order(placement, m, costs, memory_limit=2 * p)  # p micro-batches of the rank's layers
    result = simulate(order, placement, costs)
    assert max(result.peak_activation_bytes.values()) <= 2 * p
    # 1F1B on the same layers (one stage of F = 2, B = 4 per rank) takes 6 (m + p - 1)
    assert result.makespan <= 6 * (m + p - 1)
    if p <= 4:
        assert result.makespan == 6 * m + p - 1  # the ZB-V makespan
    lowered = lower(order, placement, "plain")
    validate_lowered(lowered, placement, m)
    assert simulate(lowered, placement, costs).makespan == result.makespan


@pytest.mark.parametrize(("p", "v", "m"), [(2, 1, 4), (4, 1, 8), (3, 2, 6), (4, 2, 8), (4, 3, 5)])
@pytest.mark.parametrize("split", [False, True])
def test_looped_orders_are_valid_and_within_memory(p, v, m, split):
    placement = looped_placement(p, v)
    costs = CostModel(stages=(StageCost(F=1 / v, I=1 / v, W=1 / v, activation_bytes=1 / v),) * (p * v))
    order = greedy_order(placement, m, costs, memory_limit=float(p), split_backward=split)
    result = simulate(order, placement, costs)
    assert max(result.peak_activation_bytes.values()) <= p + 1e-9
    if split:
        assert result.makespan < 3 * (m + p - 1)  # faster than 1F1B with the same memory
    for transport in ("plain", "batch"):
        validate_lowered(lower(order, placement, transport), placement, m, transport)
    assert parse_schedule_csv(format_schedule_csv(order)) == order


def test_too_little_memory():
    costs = CostModel(stages=(UNIT,) * 2)
    with pytest.raises(ValueError, match="one forward of stage 0 keeps 1 bytes, above the memory limit 0.5"):
        greedy_order(looped_placement(2, 1), 2, costs, memory_limit=0.5)


def test_tune_offers_searched_orders():
    from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules
    from hyper_parallel.core.pipeline_parallel.tools.tune import tune

    layer = StageCost(F=1.0, B=2.0, activation_bytes=100.0, param_bytes=10.0)
    costs = CostModel(stages=(layer,), layers=(layer,) * 8, micro_batch_size=2)
    schedules = {k: available_schedules()[k] for k in ("1f1b", "interleaved-1f1b")}
    plain = tune(costs, 1000.0, 16, 4, schedules=schedules, chunk_options=(1, 2))
    searched = tune(costs, 1000.0, 16, 4, schedules=schedules, chunk_options=(1, 2), search=True)
    assert searched.best.makespan_ms < plain.best.makespan_ms
    assert searched.best.schedule.startswith("search-") and searched.best.order is not None
    assert searched.best.peak_memory_bytes <= 1000.0
    names = {c.schedule for c in searched.candidates}
    assert {"search-looped", "search-looped-zb", "search-v", "search-v-zb"} <= names
