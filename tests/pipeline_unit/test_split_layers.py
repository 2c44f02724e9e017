"""split_layers: consecutive groups of a layer list, balanced by parameter count by default."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.core.pipeline_parallel.simulation.partition import balanced_ranges
from hyper_parallel.core.pipeline_parallel.tools.split_layers import layer_parameter_counts, split_layers


def _layers():
    # parameter counts: 8*8+8=72, 0, 4*8+4=36, 36, 72
    return [torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4), torch.nn.Linear(8, 4),
            torch.nn.Linear(8, 8)]


def test_parameter_counts_and_balanced_default():
    layers = _layers()
    assert layer_parameter_counts(layers) == [72, 0, 36, 36, 72]
    stages = split_layers(layers, 3)
    # the costliest stage cannot be cheaper than 72 (one Linear(8, 8)): [L, Tanh] [36, 36] [L]
    assert [len(s) for s in stages] == [2, 2, 1]
    assert [x for s in stages for x in s] == layers


def test_counts_costs_partition_and_ranks():
    layers = _layers()
    assert [len(s) for s in split_layers(layers, [1, 1, 3])] == [1, 1, 3]
    assert [len(s) for s in split_layers(layers, 2, costs=[1, 1, 1, 1, 4])] == [4, 1]
    assert [len(s) for s in split_layers(layers, balanced_ranges([1, 1, 1, 1, 1], 5))] == [1] * 5
    stages = split_layers(layers, 4, num_ranks=2, costs=[1, 1, 1, 1, 1])
    assert sum(len(s) for s in stages) == 5 and all(stages)


def test_errors_name_the_value():
    layers = _layers()
    with pytest.raises(ValueError, match=r"add up to 4, but there are 5 layers"):
        split_layers(layers, [2, 2])
    with pytest.raises(ValueError, match=r"got 2 costs for 5 layers"):
        split_layers(layers, 2, costs=[1, 2])
    with pytest.raises(ValueError, match=r"cannot split 5 layer\(s\) into 6 stages"):
        split_layers(layers, 6)
    with pytest.raises(ValueError, match=r"3 stages do not divide over num_ranks=2"):
        split_layers(layers, 3, num_ranks=2)
    with pytest.raises(TypeError, match="partition must be"):
        split_layers(layers, "2")
