"""Group a model's layer list into pipeline stages: the layers of stage ``s`` are consecutive.

`split_layers(layers, partition)` takes the layer list (any sequence of modules or Cells) and a
partition: a number of stages (balanced by parameter count unless ``costs`` are given), a list of
layer counts per stage, or a `Partition` from `balanced_ranges` / `rank_ranges`. It returns one
list of layers per stage; wrap each in a stage module of your own (see examples/hf_llama_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform import get_platform

from hyper_parallel.core.pipeline_parallel.simulation.partition import Partition, balanced_ranges, rank_ranges


def layer_parameter_counts(layers: Sequence[Any]) -> list[int]:
    """Number of parameter elements of each layer (a parameter shared by two layers counts in both)."""
    platform = get_platform()
    return [sum(platform.numel(p) for _, p in platform.named_parameters(layer)) for layer in layers]


def _ranges_from_counts(counts: Sequence[int], num_layers: int) -> list[tuple[int, int]]:
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"layer counts per stage must be ints >= 1, got {list(counts)!r}")
    if sum(counts) != num_layers:
        raise ValueError(f"layer counts {list(counts)!r} add up to {sum(counts)}, but there are {num_layers} layers")
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def split_layers(
    layers: Sequence[Any],
    partition: int | Sequence[int] | Partition,
    costs: Sequence[float] | None = None,
    num_ranks: int | None = None,
    placement: str = "looped",
) -> list[list[Any]]:
    """Split ``layers`` into consecutive groups, one per pipeline stage.

    Args:
        layers: the model's layers in order.
        partition: the number of stages (balanced: the costliest stage is as cheap as possible),
            a list with the number of layers of each stage, or a `Partition`.
        costs: one cost per layer for a balanced split; default: its parameter count.
        num_ranks: with a number of stages, balance the ranks instead of the stages: stage ``s``
            runs on the rank ``placement`` gives it (``looped``: ``s % num_ranks``; ``v``).
        placement: ``looped`` or ``v`` (only with ``num_ranks``).

    Returns:
        ``stages[s]`` is the list of layers of stage ``s``.
    """
    layers = list(layers)
    if isinstance(partition, Partition):
        ranges = list(partition.ranges)
        if not ranges or ranges[0][0] != 0 or ranges[-1][1] != len(layers) or any(
                a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
            raise ValueError(f"partition ranges {ranges} do not cover the {len(layers)} layers in order")
    elif isinstance(partition, int) and not isinstance(partition, bool):
        weights = layer_parameter_counts(layers) if costs is None else list(costs)
        if len(weights) != len(layers):
            raise ValueError(f"got {len(weights)} costs for {len(layers)} layers")
        if num_ranks is None:
            ranges = list(balanced_ranges(weights, partition).ranges)
        else:
            if partition % num_ranks:
                raise ValueError(f"{partition} stages do not divide over num_ranks={num_ranks}")
            ranges = list(rank_ranges(weights, num_ranks, partition // num_ranks, placement).ranges)
    elif isinstance(partition, (list, tuple)):
        ranges = _ranges_from_counts(partition, len(layers))
    else:
        raise TypeError(f"partition must be a number of stages, a list of layer counts or a Partition, "
                        f"got {partition!r}")
    return [layers[a:b] for a, b in ranges]
