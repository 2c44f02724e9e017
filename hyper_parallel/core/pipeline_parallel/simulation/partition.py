"""Balanced partitioning: which consecutive layers go into which pipeline stage.

Input: one number per layer (a time such as F + B, a parameter count, a profiled cost).
Output: half-open index ranges ``[(start, end), ...]``, one per stage, covering the layers in
order with at least one layer each, so stage ``s`` is built from ``layers[start:end]``.

- `balanced_ranges` minimizes the slowest stage (exact; among the optimal splits it picks the
  one with the smallest sum of squared stage costs, i.e. the most even one);
- `rank_ranges` places several stages on each rank (``looped``: stage ``c * p + r`` on rank
  ``r``; ``v``: stages ``r`` and ``2p - 1 - r``) and minimizes the busiest rank (the sum of
  its stages), then its slowest stage, by branch and bound; ``optimal`` tells whether the
  search finished within its node budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, v_placement


@dataclass(frozen=True)
class Partition:
    """Stage ranges and what they cost. ``rank_loads`` is empty for `balanced_ranges`."""

    ranges: tuple[tuple[int, int], ...]
    stage_costs: tuple[float, ...]
    rank_loads: tuple[float, ...] = ()
    optimal: bool = True

    @property
    def bottleneck(self) -> float:
        """The slowest stage's cost."""
        return max(self.stage_costs, default=0.0)

    @property
    def busiest_rank(self) -> float:
        """The busiest rank's load (the bottleneck when there is one stage per rank)."""
        return max(self.rank_loads, default=self.bottleneck)

    def layer_counts(self) -> list[int]:
        return [b - a for a, b in self.ranges]


def _check(costs: Sequence[float], num_stages: int) -> list[float]:
    values = []
    for k, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"layer {k}: cost must be a finite number >= 0, got {c!r}")
        values.append(float(c))
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if len(values) < num_stages:
        raise ValueError(f"cannot split {len(values)} layer(s) into {num_stages} stages of at least one layer")
    return values


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _fits(prefix: list[float], limit: float) -> int:
    """Fewest stages with every stage <= limit (greedy from the left); a large number if a
    single layer exceeds the limit. Stage costs are prefix differences, as in the candidates."""
    count, start, n = 0, 0, len(prefix) - 1
    while start < n:
        end = start
        while end < n and prefix[end + 1] - prefix[start] <= limit:
            end += 1
        if end == start:
            return n + 1
        count += 1
        start = end
    return count


def balanced_ranges(costs: Sequence[float], num_stages: int) -> Partition:
    """Split the layers into ``num_stages`` consecutive non-empty stages minimizing the
    slowest stage (see the module docstring)."""
    values = _check(costs, num_stages)
    n = len(values)
    prefix = _prefix(values)
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    low, high = 0, len(candidates) - 1
    while low < high:  # smallest candidate with which num_stages (or fewer) stages suffice
        mid = (low + high) // 2
        if _fits(prefix, candidates[mid]) <= num_stages:
            high = mid
        else:
            low = mid + 1
    limit = candidates[low]
    ranges = _most_even(prefix, num_stages, limit)
    return Partition(tuple(ranges), tuple(prefix[b] - prefix[a] for a, b in ranges))


def _most_even(prefix: list[float], num_stages: int, limit: float) -> list[tuple[int, int]]:
    """Among splits with every stage <= limit, the one with the least sum of squares."""
    n = len(prefix) - 1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(j - 1, s - 2, -1):
                seg = prefix[j] - prefix[i]
                if seg > limit:
                    break
                if best[s - 1][i] < inf and best[s - 1][i] + seg * seg < best[s][j]:
                    best[s][j] = best[s - 1][i] + seg * seg
                    choice[s][j] = i
    ranges = []
    j = n
    for s in range(num_stages, 0, -1):
        i = choice[s][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


def stage_owners(num_ranks: int, num_chunks: int, placement: str) -> list[int]:
    """Rank of each stage for a placement name (``looped`` or ``v``)."""
    if placement == "looped":
        table = looped_placement(num_ranks, num_chunks)
    elif placement == "v":
        if num_chunks != 2:
            raise ValueError(f"the v placement holds 2 chunks per rank, got num_chunks={num_chunks}")
        table = v_placement(num_ranks)
    else:
        raise ValueError(f"unknown placement {placement!r}; valid: looped, v")
    return [table[s] for s in range(len(table))]


def rank_ranges(
    costs: Sequence[float], num_ranks: int, num_chunks: int = 1, placement: str = "looped",
    node_limit: int = 20_000,
) -> Partition:
    """Split the layers into ``num_ranks * num_chunks`` stages placed by ``placement``,
    minimizing the busiest rank, then the slowest stage (see the module docstring)."""
    owners = stage_owners(num_ranks, num_chunks, placement)
    num_stages = len(owners)
    values = _check(costs, num_stages)
    prefix = _prefix(values)
    n = len(values)
    start = balanced_ranges(values, num_stages).ranges
    search = _Search(prefix, owners, num_ranks, node_limit)
    search.offer(list(start))
    search.offer(search.improve(list(start)))
    search.run()
    ranges = search.best_ranges
    stage_costs = tuple(prefix[b] - prefix[a] for a, b in ranges)
    loads = [0.0] * num_ranks
    for s, c in enumerate(stage_costs):
        loads[owners[s]] += c
    assert ranges[-1][1] == n
    return Partition(tuple(ranges), stage_costs, tuple(loads), optimal=not search.cut_short)


class _Search:
    """Depth-first branch and bound over stage ends, stage by stage."""

    def __init__(self, prefix: list[float], owners: list[int], num_ranks: int, node_limit: int) -> None:
        self.prefix = prefix
        self.owners = owners
        self.num_ranks = num_ranks
        self.node_limit = node_limit
        self.nodes = 0
        self.cut_short = False
        self.best: tuple[float, float] = (float("inf"), float("inf"))
        self.best_ranges: list[tuple[int, int]] = []
        # for each stage: the ranks that still get a stage after it
        self.later_ranks = [set(owners[s + 1:]) for s in range(len(owners))]

    def score(self, ranges: list[tuple[int, int]]) -> tuple[float, float]:
        loads = [0.0] * self.num_ranks
        worst = 0.0
        for s, (a, b) in enumerate(ranges):
            c = self.prefix[b] - self.prefix[a]
            loads[self.owners[s]] += c
            worst = max(worst, c)
        return max(loads), worst

    def offer(self, ranges: list[tuple[int, int]]) -> None:
        value = self.score(ranges)
        if value < self.best:
            self.best, self.best_ranges = value, list(ranges)

    def improve(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Move single stage boundaries by one layer while that lowers the score."""
        value = self.score(ranges)
        changed = True
        while changed:
            changed = False
            for k in range(len(ranges) - 1):
                for step in (-1, 1):
                    cut = ranges[k][1] + step
                    if not ranges[k][0] < cut < ranges[k + 1][1]:
                        continue
                    trial = list(ranges)
                    trial[k], trial[k + 1] = (ranges[k][0], cut), (cut, ranges[k + 1][1])
                    trial_value = self.score(trial)
                    if trial_value < value:
                        ranges, value, changed = trial, trial_value, True
        return ranges

    def run(self) -> None:
        self._dfs(0, 0, [0.0] * self.num_ranks, 0.0, [])

    def _dfs(self, stage: int, begin: int, loads: list[float], worst: float, ranges: list[tuple[int, int]]) -> None:
        n = len(self.prefix) - 1
        num_stages = len(self.owners)
        if stage == num_stages:
            if begin == n:
                self.offer(ranges)
            return
        self.nodes += 1
        if self.nodes > self.node_limit:
            self.cut_short = True
            return
        owner = self.owners[stage]
        last_end = n - (num_stages - stage - 1)
        for end in range(begin + 1, last_end + 1):
            seg = self.prefix[end] - self.prefix[begin]
            load = loads[owner] + seg
            if load > self.best[0]:
                break  # longer stages only cost more
            stage_worst = max(worst, seg)
            if load == self.best[0] and stage_worst >= self.best[1] and max(loads) <= load:
                break
            if not self._room_left(stage, end, loads, owner, load):
                continue
            loads[owner] = load
            ranges.append((begin, end))
            self._dfs(stage + 1, end, loads, stage_worst, ranges)
            ranges.pop()
            loads[owner] = load - seg
            if self.cut_short:
                return

    def _room_left(self, stage: int, end: int, loads: list[float], owner: int, load: float) -> bool:
        """Whether the layers after ``end`` can still fit under the best busiest rank."""
        remaining = self.prefix[-1] - self.prefix[end]
        room = 0.0
        for rank in self.later_ranks[stage]:
            current = load if rank == owner else loads[rank]
            room += max(0.0, self.best[0] - current)
        return remaining <= room + 1e-12 * max(1.0, self.prefix[-1])
