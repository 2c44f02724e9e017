"""Balanced partitioning against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from hyper_parallel.core.pipeline_parallel.simulation.partition import balanced_ranges, rank_ranges, stage_owners


def splits(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [(bounds[i], bounds[i + 1]) for i in range(k)]


def brute_stage(costs, k):
    return min(max(sum(costs[a:b]) for a, b in r) for r in splits(len(costs), k))


def brute_rank(costs, p, v, placement):
    owners = stage_owners(p, v, placement)

    def score(r):
        loads = [0.0] * p
        for s, (a, b) in enumerate(r):
            loads[owners[s]] += sum(costs[a:b])
        return max(loads), max(sum(costs[a:b]) for a, b in r)

    return min(score(r) for r in splits(len(costs), p * v))


CASES = [([float(c) for c in random.Random(seed).choices([0, 0.5, 1, 2, 3, 5, 8], k=n)], seed)
         for seed, n in enumerate([1, 2, 3, 5, 7, 8, 9, 10, 10, 11])]


@pytest.mark.parametrize(("costs", "seed"), CASES)
def test_slowest_stage_is_the_brute_force_optimum(costs, seed):
    for k in range(1, len(costs) + 1):
        part = balanced_ranges(costs, k)
        assert part.bottleneck == pytest.approx(brute_stage(costs, k))
        assert part.ranges[0][0] == 0 and part.ranges[-1][1] == len(costs)
        assert all(a < b for a, b in part.ranges)
        assert all(part.ranges[i][1] == part.ranges[i + 1][0] for i in range(k - 1))


@pytest.mark.parametrize(("costs", "p", "v", "placement"), [
    (costs, p, v, placement) for costs, _ in CASES[3:]
    for p, v, placement in [(2, 2, "looped"), (2, 2, "v"), (3, 2, "v"), (2, 3, "looped"), (4, 1, "looped")]
    if len(costs) >= p * v
])
def test_busiest_rank_is_the_brute_force_optimum(costs, p, v, placement):
    part = rank_ranges(costs, p, v, placement)
    assert part.optimal
    best = brute_rank(costs, p, v, placement)
    assert (part.busiest_rank, part.bottleneck) == pytest.approx(best)


def test_most_even_split_among_optima_and_errors():
    assert balanced_ranges([1, 1, 1, 1], 2).ranges == ((0, 2), (2, 4))
    assert balanced_ranges([4, 1, 1, 1, 1], 2).ranges == ((0, 1), (1, 5))
    with pytest.raises(ValueError, match="cannot split 2 layer"):
        balanced_ranges([1, 1], 3)
    with pytest.raises(ValueError, match="layer 1: cost must be a finite number >= 0"):
        balanced_ranges([1, -1], 1)
    with pytest.raises(ValueError, match="the v placement holds 2 chunks"):
        rank_ranges([1] * 8, 2, 3, "v")


def test_v_pairs_heavy_ends_with_light_middles():
    # rank 0 holds the first and the last stage: a heavy embedding and head pair with light middles
    part = rank_ranges([6, 1, 1, 1, 1, 1, 1, 6], 2, 2, "v")
    assert part.busiest_rank == pytest.approx(brute_rank([6, 1, 1, 1, 1, 1, 1, 6], 2, 2, "v")[0])
    assert sum(part.rank_loads) == 18
