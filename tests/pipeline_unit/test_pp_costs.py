"""Cost model and costs file."""

from __future__ import annotations

import json

import pytest

from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost, load_costs, save_costs
from hyper_parallel.core.pipeline_parallel.ir import MetaStep


def test_backward_defaults():
    assert (StageCost(F=1.0).B, StageCost(F=1.0).I, StageCost(F=1.0).W) == (2.0, 1.0, 1.0)
    s = StageCost(F=1.0, I=1.5, W=0.5)
    assert s.B == 2.0
    s = StageCost(F=1.0, B=3.0, I=2.0)
    assert s.W == 1.0
    with pytest.raises(ValueError, match="I and W must be >= 0"):
        StageCost(F=1.0, B=1.0, I=2.0)
    with pytest.raises(ValueError, match="F must be a finite number >= 0, got -1"):
        StageCost(F=-1)


def test_overlap_pair_rules():
    pair = MetaStep.from_str("OVERLAP_B_F[B.s0.m0+F.s0.m1]")
    stage = StageCost(F=1.0, B=2.0)
    assert CostModel(stages=(stage,)).step_time(pair) == 3.0
    assert CostModel(stages=(stage,), overlap="max").step_time(pair) == 2.0
    given = StageCost(F=1.0, B=2.0, FB=2.5)
    assert CostModel(stages=(given,), overlap="max").step_time(pair) == 2.5
    with pytest.raises(ValueError, match="overlap must be one of sum, max"):
        CostModel(stages=(stage,), overlap="min")


def test_json_round_trip_and_errors(tmp_path):
    costs = CostModel(stages=(StageCost(F=1.0, activation_bytes=10.0, output_bytes=5.0),
                              StageCost(F=2.0, B=3.0)),
                      p2p_latency_ms=0.1, p2p_bandwidth_gb_per_s=10.0, micro_batch_size=4)
    path = tmp_path / "c.json"
    save_costs(costs, path)
    assert load_costs(path) == costs
    data = json.loads(path.read_text())
    data["stages"][0]["X"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"stages\[0\]: unknown field\(s\) X"):
        load_costs(path)
    path.write_text('{"stages": []}')
    with pytest.raises(ValueError, match="needs a non-empty 'stages'"):
        load_costs(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_costs(path)


def test_message_time_uses_the_producer_output():
    a = StageCost(output_bytes=1e6)
    b = StageCost(output_bytes=3e6)
    costs = CostModel(stages=(a, b, StageCost()), p2p_latency_ms=1.0, p2p_bandwidth_gb_per_s=1.0)
    assert costs.message_time(("F", 1, 0)) == pytest.approx(1.0 + 3.0)  # stage 1's output
    assert costs.message_time(("G", 2, 0)) == pytest.approx(1.0 + 3.0)  # gradient of stage 2's input
    assert costs.message_time(("G", 1, 0)) == pytest.approx(1.0 + 1.0)
    assert costs.message_time(("M", 0, 0)) == 1.0


def test_for_stages_and_scaling():
    layers = tuple(StageCost(F=f, B=2 * f, param_bytes=1.0) for f in (1.0, 1.0, 2.0, 4.0))
    costs = CostModel(stages=(StageCost(),), layers=layers, micro_batch_size=4)
    two = costs.for_stages(2)
    assert [s.F for s in two.stages] == [4.0, 4.0]  # [1, 1, 2] | [4]
    assert [s.param_bytes for s in two.stages] == [3.0, 1.0]
    with pytest.raises(ValueError, match="cannot describe 5 stages"):
        costs.for_stages(5)
    even = costs.for_stages(8, allow_even_split=True)
    assert [s.F for s in even.stages] == [1.0] * 8
    with_overhead = CostModel(stages=(StageCost(F=4.0, overhead_ms=2.0),) * 2).for_stages(4, allow_even_split=True)
    assert [(s.F, s.B, s.overhead_ms) for s in with_overhead.stages] == [(2.0, 4.0, 1.0)] * 4
    scaled = CostModel(stages=(StageCost(F=3.0, B=5.0, overhead_ms=1.0, activation_bytes=8.0),),
                       micro_batch_size=4).for_micro_batch_size(2)
    assert (scaled.stages[0].F, scaled.stages[0].B, scaled.stages[0].activation_bytes) == (2.0, 3.0, 4.0)
    assert CostModel.uniform(3).for_stages(3).num_stages == 3
    assert CostModel.uniform(1, F=2.0).for_stages(4).stages == (StageCost(F=2.0),) * 4
