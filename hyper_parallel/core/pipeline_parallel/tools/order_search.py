"""Search for a custom step order that fits a memory limit (list scheduling on the cost model).

`greedy_order` builds a compute-only schedule for any placement by simulating the ranks
together and, whenever a rank is free, starting the most urgent step that is ready:

1. a backward (``I`` when ``split_backward``, else ``B``): the oldest micro-batch first, and of
   the same micro-batch the latest stage (it unblocks the rank before it);
2. a forward, when the rank's activation bytes stay within ``memory_limit`` after it: the
   latest stage first (depth first through the rank's chunks), then the oldest micro-batch;
3. a weight backward ``W`` (oldest first): it fills time nothing else can use, or frees the
   memory a forward waits for.

Forwards of one stage go in micro-batch order, as do its backwards, so every message between
two ranks is received in the order it was sent. The result is checked with
`validate.validate_compute`. The order follows the costs it was built with: simulated with the
same costs it runs as planned; the tuner offers it as one more candidate.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_compute

_T = MetaStepType


@dataclass
class _Stage:
    index: int
    rank: int
    next_f: int = 0
    next_b: int = 0


def greedy_order(
    stage_to_rank: dict[int, int], num_microbatches: int, costs: CostModel, memory_limit: float,
    split_backward: bool = True,
) -> dict[int, list[MetaStep | None]]:
    """A compute-only schedule for ``stage_to_rank`` whose per-rank activation bytes (from the
    costs) never exceed ``memory_limit``; ValueError when no order can (one forward alone is
    too large)."""
    m = num_microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"num_microbatches must be an int >= 1, got {m!r}")
    num_stages = len(stage_to_rank)
    costs = costs.for_stages(num_stages)
    for s in range(num_stages):
        need = costs.stage(s).activation_bytes
        if need > memory_limit:
            raise ValueError(f"one forward of stage {s} keeps {need:g} bytes, above the memory limit {memory_limit:g}")
    stages = [_Stage(s, stage_to_rank[s]) for s in range(num_stages)]
    ranks = sorted(set(stage_to_rank.values()))
    mine = {r: [st for st in stages if st.rank == r] for r in ranks}
    made: dict[tuple[str, int, int], float] = {}  # ("F"|"G"|"I", stage, micro) -> time it exists on its rank
    pending_w: dict[int, list[tuple[int, int]]] = {r: [] for r in ranks}  # (micro, stage) waiting for W
    live = dict.fromkeys(ranks, 0.0)
    free = dict.fromkeys(ranks, 0.0)
    order: dict[int, list[MetaStep | None]] = {r: [] for r in ranks}
    total = num_stages * m * (3 if split_backward else 2)
    done = 0
    events = [(0.0, r) for r in ranks]
    heapq.heapify(events)

    def arrival(key: tuple[str, int, int], rank: int) -> float | None:
        if key not in made:
            return None
        kind, stage, _ = key
        owner = stage_to_rank[stage]
        if owner == rank or kind == "I":
            return made[key]
        return made[key] + costs.message_time(("F" if kind == "F" else "G", stage, key[2]))

    def ready_at(step: MetaStep, rank: int) -> float | None:
        s, i, kind = step.stage_index, step.micro_index, step.meta_type
        needs: list[tuple[str, int, int]] = []
        if kind is _T.FWD and s > 0:
            needs.append(("F", s - 1, i))
        elif kind in (_T.BWD, _T.BWD_INPUT):
            needs.append(("F", s, i))
            if s < num_stages - 1:
                needs.append(("G", s + 1, i))
        elif kind is _T.BWD_WEIGHT:
            needs.append(("I", s, i))
        times = [arrival(k, rank) for k in needs]
        if any(t is None for t in times):
            return None
        return max(times, default=0.0)

    while done < total:
        if not events:
            raise ValueError(f"no order fits the memory limit {memory_limit:g}: every rank waits for memory")
        now, rank = heapq.heappop(events)
        if now < free[rank]:
            continue
        step, later = _choose(rank, now, mine[rank], pending_w[rank], m, split_backward, costs, live[rank],
                              memory_limit, ready_at)
        if step is None:
            if later is not None:
                heapq.heappush(events, (later, rank))
            continue
        end = now + costs.step_time(step)
        s, i = step.stage_index, step.micro_index
        stage_cost = costs.stage(s)
        if step.meta_type is _T.FWD:
            stages[s].next_f += 1
            live[rank] += stage_cost.activation_bytes
            made[("F", s, i)] = end
        elif step.meta_type is _T.BWD:
            stages[s].next_b += 1
            live[rank] -= stage_cost.activation_bytes
            made[("G", s, i)] = end
        elif step.meta_type is _T.BWD_INPUT:
            stages[s].next_b += 1
            live[rank] -= stage_cost.activation_bytes - stage_cost.activation_bytes_after_input
            made[("G", s, i)] = made[("I", s, i)] = end
            pending_w[rank].append((i, s))
        else:
            pending_w[rank].remove((i, s))
            live[rank] -= stage_cost.activation_bytes_after_input
        order[rank].append(step)
        free[rank] = end
        done += 1
        for r in ranks:  # a finished step may make something ready anywhere
            heapq.heappush(events, (max(end, free[r]), r))
    validate_compute(order, stage_to_rank, m)
    return order


def _choose(rank, now, stages, pending_w, m, split, costs, live, limit, ready_at):  # noqa: ANN001, ANN202
    """The step to start on ``rank`` at ``now`` (or None) and, if none, when to look again."""
    later = None
    candidates = []
    kind = _T.BWD_INPUT if split else _T.BWD
    for st in stages:  # backwards: oldest micro-batch, then the latest stage
        if st.next_b < st.next_f:
            step = MetaStep(st.next_b, kind, st.index)
            at = ready_at(step, rank)
            if at is not None and at <= now:
                candidates.append(((0, st.next_b, -st.index), step))
            elif at is not None:
                later = at if later is None else min(later, at)
    for st in stages:  # forwards: the latest stage first, within the memory limit
        if st.next_f < m and live + costs.stage(st.index).activation_bytes <= limit:
            step = MetaStep(st.next_f, _T.FWD, st.index)
            at = ready_at(step, rank)
            if at is not None and at <= now:
                candidates.append(((1, -st.index, st.next_f), step))
            elif at is not None:
                later = at if later is None else min(later, at)
    if split and pending_w:
        i, s = min(pending_w)
        candidates.append(((2, i, s), MetaStep(i, _T.BWD_WEIGHT, s)))
    if not candidates:
        return None, later
    return min(candidates, key=lambda c: c[0])[1], None
