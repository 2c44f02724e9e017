"""Where MPipe's overflow preprocesses go, from one timed run of the compute job.

An owner runs the preprocess of an overflow micro-batch ``j`` (``overflow_mode="full"``, ``j >=
NT``) somewhere in its body list; its output must reach stage 0's rank before the stage-0
forward of ``j`` needs it, and the preprocess should fill the owner's idle time rather than
delay its body steps.

`time_job` runs the compute job once (the body's compute lists read by ``lowering/flow.py``,
each step once, woken by the value it waits for), with the MPipe work that does not move:
the first-round preprocesses at the start of their owners' lists, stage 0's rank's own
preprocesses right before the forwards that consume them, its preprocess backwards right after
the stage-0 backwards, and the metadata waits at the earliest place ``prefetch`` can put them.
The overflow outputs count as given (not yet placed). It records, for every rank and compute
step, when the rank reached it, when it started, and the last step of stage 0's rank that the
rank's steps so far follow (a clock entry, as in ``flow.py``); and when stage 0 starts each
forward.

`overflow_places` then takes each owner's overflow micro-batches in ascending order: ``j`` goes
before the owner's compute step that leaves most idle time for it (at most the preprocess's
time; the latest such step on a tie) among those the owner reaches early enough for the output
to arrive in time (``need - preprocess - latency``) and that follow no step of stage 0's rank
from the forward of ``j`` on; before the owner's first step when none does. The time a placed
preprocess does not fill delays the owner's later steps in the reckoning of the later choices;
the idle time it fills is gone for them. Each owner's choices cost O(log n) each (a heap of its
idle gaps, prefix sums of the delays).

Why the choices cannot deadlock the job, whatever the costs: a placed preprocess adds one wait,
stage 0's forward of ``j`` (index ``i`` on its rank) on the owner's steps before the chosen one,
and the clock entry of those steps is below ``i``: none of them follows that forward. Clock
entries are computed in the job without the new waits; adding a wait into step ``i`` of stage
0's rank from steps whose entries are below ``i`` changes no entry (a step of that rank follows
itself). A cycle of waits would have to come back into some such step ``i`` either along a wait
of the job, which would be a cycle there, or along a new wait, whose source then follows step
``i`` and so has an entry of at least ``i``: both impossible. The first-in-first-out rule of a
channel only moves a send earlier (`plan.insert_mpipe_steps`), which removes waits. Sends never
wait on gloo's eager engine and receives are posted without waiting there, so the waits above
are all the job has; the times only choose among safe places.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from heapq import heappop, heappush
from dataclasses import dataclass

from hyper_parallel.core.pipeline_parallel.features.mpipe.plan import MPipePlan, overflow_micros
from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.flow import Flow
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost

_T = MetaStepType
_EPS = 1e-9


@dataclass
class JobTiming:
    """One timed run of the compute job: per rank and compute step, when the rank reached it
    (after its metadata waits), when it started, and the last step of stage 0's rank it follows
    (-1: none) when the rank reaches it; per overflow micro-batch, when stage 0's forward of it
    started and that forward's index in stage 0's rank's compute list."""

    reached: dict[int, list[float]]
    start: dict[int, list[float]]
    after_zero: dict[int, list[int]]
    need: dict[int, float]
    forward_index: dict[int, int]
    follows: dict[int, dict[DataKey, int]]
    """Rank -> per value, the last step of that rank its making follows, for stage 0's rank and the
    rank `time_job` was asked to follow: with the metadata waits at their natural places too
    (``flow.meta_early == flow.meta_gap``), what ``Flow.run(rank)`` returns for the same flow,
    unless a value is made twice (``made_twice``; ``Flow.run`` refuses that)."""
    made_twice: bool


def time_job(flow: Flow, plan: MPipePlan, costs: CostModel, preprocess: StageCost,
             rank: int | None = None) -> JobTiming | None:
    """The timed run described in the module docstring; None when the job cannot finish. It also
    carries the clock entries of ``rank`` (``JobTiming.follows``)."""
    zero = flow.stage_to_rank[0]
    mine = zero if rank is None else rank
    costs = costs.for_stages(len(flow.stage_to_rank))
    latency = costs.p2p_latency_ms
    nt = plan.num_owners
    waits = flow.waits.get("early", {})
    # stage 0's inputs: given for the overflow micro-batches of other owners (not placed yet), after
    # the first-round preprocess (at the start of the owner's list) for the others; made in line on
    # stage 0's rank for its own
    inputs = {j: (preprocess.F + latency if j < nt else 0.0) for j in range(plan.num_microbatches)
              if plan.owner(j) != zero}
    pre_backward = {j: preprocess.B + (preprocess.F if plan.backward == "recompute" and plan.owner(j) != zero else 0.0)
                    for j in range(plan.num_microbatches)
                    if plan.backward is not None and (plan.owner(j) == zero or plan.backward == "recompute")}
    durations = _durations(flow, costs)
    # stage 0's steps: the forward of j waits for its input (or runs its preprocess right before,
    # on stage 0's rank), the backward of j runs the preprocess backward right after
    forward_of: dict[int, int] = {}
    backward_of: dict[int, float] = {}
    for k, step in enumerate(flow.items.get(zero, ())):
        for part in step.parts:
            if part.stage_index == 0 and part.meta_type is _T.FWD:
                forward_of[k] = part.micro_index
            elif part.stage_index == 0 and part.meta_type in (_T.BWD, _T.BWD_INPUT):
                backward_of[k] = pre_backward.get(part.micro_index, 0.0)
    delay: dict[DataKey, float] = {}  # a value made on another rank arrives this much later
    per_stage: dict[tuple, float] = {}
    for key in flow.natural:
        kind_stage = key[:2]
        found = per_stage.get(kind_stage)
        if found is None:
            found = per_stage[kind_stage] = costs.message_time(key)
        delay[key] = found
    # value -> (when a step waiting for it may start, when a metadata receive of it completes, the last
    # step of stage 0's rank its making follows, the same for rank ``mine``): one look-up per input
    made: dict[DataKey, tuple[float, float, int, int]] = {}
    waiting: dict[DataKey, list[int]] = {}
    reached: dict[int, list[float]] = {q: [] for q in flow.items}
    start: dict[int, list[float]] = {q: [] for q in flow.items}
    after_zero: dict[int, list[int]] = {q: [] for q in flow.items}
    need: dict[int, float] = {}
    forward_index = {j: k for k, j in forward_of.items() if j in inputs}
    cursor = dict.fromkeys(flow.items, 0)
    clock = {q: (preprocess.F if q == zero or q < nt and plan.owner(q) == q else 0.0) for q in flow.items}
    entry = dict.fromkeys(flow.items, -1)
    entry_mine = dict.fromkeys(flow.items, -1)
    ready = list(flow.items)
    while ready:
        q = ready.pop()
        k, needs, makes, times, now, last = cursor[q], flow.needs[q], flow.makes[q], durations[q], clock[q], entry[q]
        last_mine, is_mine = entry_mine[q], q == mine
        arrive, begin_at, after = reached[q], start[q], after_zero[q]
        extra = waits.get(q, {})
        stage0 = q == zero
        blocked = None
        end_k = len(needs)
        while k < end_k:
            now_before, last_before, mine_before = now, last, last_mine  # kept if step k must wait: it runs again
            more = extra.get(k)
            if more:
                for key in more:  # a metadata receive waiting in the gap before step k
                    got = made.get(key)
                    if got is None:
                        blocked = key
                        break
                    _, at, entry_zero, entry_own = got
                    if at > now:
                        now = at
                    if entry_zero > last:
                        last = entry_zero
                    if entry_own > last_mine:
                        last_mine = entry_own
                if blocked is not None:
                    now, last, last_mine = now_before, last_before, mine_before
                    break
            preprocess_may_follow = last  # a preprocess put before step k runs after these waits
            begin = now
            for key in needs[k]:
                got = made.get(key)
                if got is None:
                    blocked = key
                    break
                at, _, entry_zero, entry_own = got
                if at > begin:
                    begin = at
                if entry_zero > last:
                    last = entry_zero
                if entry_own > last_mine:
                    last_mine = entry_own
            if blocked is not None:
                now, last, last_mine = now_before, last_before, mine_before
                break
            end_extra = 0.0
            if stage0:
                j = forward_of.get(k)
                if j is not None:
                    if j in inputs:
                        begin = max(begin, inputs[j])
                        need[j] = begin
                    elif j != 0:  # stage 0's rank preprocesses its own micro-batch right before (0: first of all)
                        now += preprocess.F
                        begin = max(begin, now)
                end_extra = backward_of.get(k, 0.0)
            arrive.append(now)
            begin_at.append(begin)
            after.append(preprocess_may_follow)
            end = begin + times[k] + end_extra
            if stage0:
                last = k
            if is_mine:
                last_mine = k
            for key in makes[k]:
                d = delay.get(key)
                made[key] = (end if d is None else end + d, end + (latency if d is None else d), last, last_mine)
                woken = waiting.pop(key, None)
                if woken:
                    ready += woken
            now = end
            k += 1
        if blocked is not None:
            waiting.setdefault(blocked, []).append(q)
        cursor[q], clock[q], entry[q], entry_mine[q] = k, now, last, last_mine
    if any(cursor[q] < len(items) for q, items in flow.items.items()):
        return None
    twice = len(made) != sum(len(keys) for lists in flow.makes.values() for keys in lists)
    follows = {zero: {key: got[2] for key, got in made.items()}}
    if mine != zero:
        follows[mine] = {key: got[3] for key, got in made.items()}
    return JobTiming(reached, start, after_zero, need, forward_index, follows, twice)


def _durations(flow: Flow, costs: CostModel) -> dict[int, list[float]]:
    """Each compute step's time (one cost look-up per step kind and stage)."""
    known: dict[tuple, float] = {}
    out: dict[int, list[float]] = {}
    for q, items in flow.items.items():
        times = []
        for step in items:
            key = (step.meta_type, step.stage_index)
            found = None if step.meta_type.is_overlap else known.get(key)
            if found is None:
                found = costs.step_time(step)
                if not step.meta_type.is_overlap:
                    known[key] = found
            times.append(found)
        out[q] = times
    return out


def overflow_places(timing: JobTiming, plan: MPipePlan, zero: int, preprocess: StageCost, latency: float,
                    owners: set[int] | None = None) -> dict[int, int]:
    """Overflow micro-batch -> index of the owner's compute step its preprocess goes before (-1:
    before the owner's first step), for the owners in ``owners`` (default: all); see the module
    docstring."""
    places: dict[int, int] = {}
    by_owner: dict[int, list[int]] = {}
    for j in overflow_micros(plan, zero):
        by_owner.setdefault(plan.owner(j), []).append(j)
    for owner, micros in by_owner.items():
        if owners is None or owner in owners:
            places.update(_owner_places(timing, owner, micros, preprocess.F, latency))
    return places


def _owner_places(timing: JobTiming, owner: int, micros: list[int], length: float, latency: float
                  ) -> dict[int, int]:
    """`overflow_places` for one owner: its micro-batches in ascending order."""
    reached, start, after_zero = timing.reached[owner], timing.start[owner], timing.after_zero[owner]
    idle = [max(0.0, b - a) for a, b in zip(reached, start)]
    pushed = _Fenwick(len(reached))  # time each placed preprocess pushes the owner's later steps back
    placed_at: dict[int, float] = {}  # step index -> time of the preprocesses placed right before it
    candidates: list[tuple[float, int]] = []  # max-heap of (-idle, -index) of the steps seen so far
    seen = 0
    places: dict[int, int] = {}
    for j in micros:
        latest = timing.need[j] - length - latency
        # the steps the owner reaches in time (with the delays of the preprocesses placed so far),
        # none of them after a step that follows stage 0's forward of j (which would wait on it)
        last = min(bisect_right(reached, latest + _EPS), bisect_left(after_zero, timing.forward_index[j])) - 1
        while last >= 0 and reached[last] + pushed.before(last) + placed_at.get(last, 0.0) > latest + _EPS:
            last -= 1
        if last < 0:
            places[j] = -1
            continue
        while seen <= last:
            if idle[seen] > _EPS:
                heappush(candidates, (-min(idle[seen], length), -seen))
            seen += 1
        best = _best_gap(candidates, last, idle, length) if length > _EPS else last
        filled = min(idle[best], length)
        idle[best] -= filled
        if idle[best] > _EPS:
            heappush(candidates, (-min(idle[best], length), -best))
        pushed.add(best, length - filled)
        placed_at[best] = placed_at.get(best, 0.0) + length
        places[j] = best
    return places


def _best_gap(candidates: list[tuple[float, int]], last: int, idle: list[float], length: float) -> int:
    """The step up to ``last`` with the most idle time before it, counted up to ``length`` (the
    latest of those on a tie; ``last`` when none is idle). ``candidates`` holds ``(-min(idle,
    length), -index)`` of the idle steps seen so far; entries of gaps used since are dropped, the
    chosen one is taken off (the caller puts it back with what is left of it)."""
    beyond: list[tuple[float, int]] = []
    best = last
    while candidates:
        score, index = candidates[0]
        k = -index
        if min(idle[k], length) != -score or idle[k] <= _EPS:  # used since it was put there
            heappop(candidates)
        elif k > last:  # beyond this micro-batch's reach: kept for later ones
            beyond.append(heappop(candidates))
        else:
            best = k
            heappop(candidates)
            break
    for item in beyond:
        heappush(candidates, item)
    return best


class _Fenwick:
    """Prefix sums over step indices: ``add(i, x)``, ``before(i)`` = sum over indices below ``i``."""

    def __init__(self, size: int) -> None:
        self.tree = [0.0] * (size + 1)

    def add(self, index: int, value: float) -> None:
        index += 1
        while index < len(self.tree):
            self.tree[index] += value
            index += index & -index

    def before(self, index: int) -> float:
        total = 0.0
        while index > 0:
            total += self.tree[index]
            index -= index & -index
        return total


def preprocess_costs(plan: MPipePlan, stage_to_rank: dict[int, int], costs: CostModel | None,
                     preprocess: StageCost | None) -> tuple[CostModel, StageCost]:
    """The body's costs (default: one rank's share of the body costs F = 1, B = 2) and the
    preprocess's (default: one rank's share of the body; nothing for the dataload-only mode)."""
    num_stages = len(stage_to_rank)
    if costs is None:
        costs = CostModel.per_rank_share(plan.num_ranks, max(1, num_stages // plan.num_ranks))
    costs = costs.for_stages(num_stages)
    if preprocess is None:
        share = [costs.stage(s) for s, r in stage_to_rank.items() if r == stage_to_rank[0]]
        preprocess = StageCost(F=sum(s.F for s in share), B=sum(s.B for s in share))
    if not plan.compute:
        preprocess = StageCost(F=0.0, B=0.0)
    return costs, preprocess


def overflow_slots(flow: Flow, plan: MPipePlan, costs: CostModel, preprocess: StageCost,
                   body: dict[int, list[MetaStep]], timing: JobTiming | None = None) -> dict[int, int] | None:
    """Overflow micro-batch -> the position in its owner's lowered body list (in ``body``) its
    preprocess goes before, for the owners in ``body``; None when the job cannot finish.
    ``timing``: `time_job`'s run of these arguments, when the caller made it already."""
    if timing is None:
        timing = time_job(flow, plan, costs, preprocess)
    if timing is None:
        return None
    zero = flow.stage_to_rank[0]
    places = overflow_places(timing, plan, zero, preprocess, costs.p2p_latency_ms, set(body))
    positions = {owner: [k for k, step in enumerate(steps) if step.meta_type.is_compute or step.meta_type.is_overlap]
                 for owner, steps in body.items()}
    return {j: 0 if k < 0 else positions[plan.owner(j)][k] for j, k in places.items()}


def metadata_of(lowered: dict[int, list[MetaStep]]) -> str:
    """The metadata option lowered lists were made with: "none" without metadata receives, "all"
    with one for every forward value received, else "first"."""
    meta = data = 0
    for steps in lowered.values():
        for step in steps:
            for part in step.comm_parts:
                if part.meta_type is _T.META_RECV:
                    meta += 1
                elif part.meta_type is _T.FWD_RECV:
                    data += 1
    return "none" if meta == 0 else "all" if meta == data else "first"
