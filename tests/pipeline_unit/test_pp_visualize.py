"""ASCII schedule charts."""

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b, generate_interleaved_1f1b
from hyper_parallel.core.pipeline_parallel.simulate import simulate
from hyper_parallel.core.pipeline_parallel.visualize import ascii_chart, infer_stage_to_rank


def test_1f1b_chart_layout():
    chart = ascii_chart(generate_1f1b(4, 8))
    lines = chart.splitlines()
    assert len(lines) == 6
    assert lines[0].startswith("time   |0 ")
    assert lines[1].startswith("rank 0 |F0 F1 F2 F3 .. .. .. .. .. .. B0--- F4 B1---")
    assert lines[4].startswith("rank 3 |.. .. .. F0 B0--- F1 B1---")
    assert lines[-1] == "makespan 33, bubble 27.3%, peak activations r0=4 r1=3 r2=2 r3=1"
    assert max(len(line) for line in lines) <= 200


def test_chart_of_two_rank_gpipe_by_hand():
    schedule = {
        0: [MetaStep.from_str(t) for t in "F.s0.m0 F.s0.m1 B.s0.m0 B.s0.m1".split()],
        1: [MetaStep.from_str(t) for t in "F.s1.m0 F.s1.m1 B.s1.m0 B.s1.m1".split()],
    }
    chart = ascii_chart(schedule, costs={MetaStepType.FWD: 1.0, MetaStepType.BWD: 1.0})
    assert chart.splitlines()[1:] == [
        "rank 0 |F0 F1 .. .. B0 B1",
        "rank 1 |.. F0 F1 B0 B1 ..",
        "makespan 6, bubble 33.3%, peak activations r0=2 r1=2",
    ]


def test_multi_chunk_labels_and_result_input():
    placement = looped_placement(2, 2)
    result = simulate(generate_interleaved_1f1b(2, 2, 2), placement)
    chart = ascii_chart(result)
    assert "rank 0 |F0.0 F1.0 F0.1 F1.1" in chart
    assert "B1.1" in chart and "B0.0" in chart
    assert chart == ascii_chart(generate_interleaved_1f1b(2, 2, 2), placement)


def test_infer_stage_to_rank():
    assert infer_stage_to_rank(generate_interleaved_1f1b(2, 2, 2)) == looped_placement(2, 2)
    clash = {0: [MetaStep.from_str("F.s0.m0")], 1: [MetaStep.from_str("B.s0.m0")]}
    with pytest.raises(ValueError, match="stage 0 appears on ranks 0 and 1"):
        infer_stage_to_rank(clash)
