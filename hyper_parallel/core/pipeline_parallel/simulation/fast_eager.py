"""The eager model (and compute-only lists) of ``timed_model.py`` as one chain of steps per rank.

In the eager model a communication step takes none of its rank's time unless it waits for its
receives (metadata, or ``wait_at_post``), a send completes when it is issued, and a receive
completes at ``max(posted, send issued + message time)``. A step is issued at its rank's clock,
which only moves at compute steps and at the communication steps that wait (every duration is
>= 0, so the clock never goes back). So, with ``s`` the sender's clock when it issued the send:

- a compute step that consumes a receive starts at ``max(clock, max(posted, s + t))``, which is
  ``max(clock, s + t)`` because the receive was posted earlier on the same rank (posted <= clock);
- a step that waits for receives ends at ``max(clock, s + t, ...)`` the same way;
- ``s`` is the end of the last such *node* (compute step or waiting communication step) before
  the send on the sender's rank, 0.0 before the first.

`run_chain` runs only these nodes, each as ``max(clock, inputs) + duration`` (0.0 for a waiting
communication step: ``x + 0.0`` is ``x``), with the same operands as the exact model, so every
time is the same float. The communication steps that do not wait are not visited at all; the
times of their operations (needed only for the trace records and the finish times) follow from
the node times with numpy, by the same additions and maxima.

It returns None where that reasoning does not hold (a negative or non-finite duration or
message time, a receive posted after the step that consumes it, a wait for more than three
receives): the caller then uses the general fast run.
"""

from __future__ import annotations

import numpy as np

from hyper_parallel.core.pipeline_parallel.simulation.fast_job import CompiledJob
from hyper_parallel.core.pipeline_parallel.simulation.lazy_records import RecordSource
from hyper_parallel.core.pipeline_parallel.simulation.timed_model import TimedOutcome

_SLOTS = 3


def run_chain(job: CompiledJob, num_stages: int, wait_at_post: bool) -> TimedOutcome | None:
    """The eager timed run of a compiled job (see the module docstring), or None."""
    plan = _plan(job, wait_at_post)
    if plan is None:
        return None
    programs, deps, adds, durations, prev_node, node_of_entry, recv_node, recv_time = plan
    count = len(job.steps)
    nodes = len(durations)
    time: list[float | None] = [None] * (nodes + 1)
    time[nodes] = 0.0  # the clock before a rank's first node
    steps = job.steps
    compute = {rank: [] for rank in job.ranks}
    clock_of = dict.fromkeys(job.ranks, 0.0)
    cursor = dict.fromkeys(job.ranks, 0)
    waiting: dict[int, list[int]] = {}
    ready_ranks = list(reversed(job.ranks))
    dep_a, dep_b, dep_c = deps
    add_a, add_b, add_c = adds
    while ready_ranks:
        rank = ready_ranks.pop()
        program = programs[rank]
        timeline = compute[rank]
        index, clock = cursor[rank], clock_of[rank]
        total = len(program)
        wait = -1
        while index < total:
            k = program[index]
            ready = clock
            cell = dep_a[k]
            if cell >= 0:
                at = time[cell]
                if at is None:
                    wait = cell
                    break
                at += add_a[k]
                if at > ready:
                    ready = at
                cell = dep_b[k]
                if cell >= 0:
                    at = time[cell]
                    if at is None:
                        wait = cell
                        break
                    at += add_b[k]
                    if at > ready:
                        ready = at
                    cell = dep_c[k]
                    if cell >= 0:
                        at = time[cell]
                        if at is None:
                            wait = cell
                            break
                        at += add_c[k]
                        if at > ready:
                            ready = at
            end = ready + durations[k]
            time[k] = end
            if waiting:
                woken = waiting.pop(k, None)
                if woken:
                    ready_ranks.extend(woken)
            if k < count:
                timeline.append((ready, end, steps[k]))
            clock = end
            index += 1
        cursor[rank], clock_of[rank] = index, clock
        if wait >= 0:
            waiting.setdefault(wait, []).append(rank)
    if any(cursor[rank] < len(programs[rank]) for rank in job.ranks):
        return None  # stuck: the general run (and then the exact model) will say where
    times = np.asarray(time, dtype=np.float64)
    arrival = times[recv_node] + recv_time  # the non-metadata receives, rank by rank
    bounds = np.searchsorted(job.arrays["op_rank"][_data_receives(job)], job.ranks + [job.ranks[-1] + 1]
                             if job.ranks else [])
    finish = {}
    for k, rank in enumerate(job.ranks):
        mine = arrival[bounds[k]:bounds[k + 1]]
        last = clock_of[rank]
        if mine.size:
            latest = float(mine.max())
            last = latest if latest > last else last
        finish[rank] = last + 0.0
    source = RecordSource(lambda: _records(job, num_stages, times, compute, prev_node, node_of_entry))
    return TimedOutcome(compute, source, finish, {})  # type: ignore[arg-type]


def _data_receives(job: CompiledJob) -> np.ndarray:
    a = job.arrays
    return np.flatnonzero(~a["op_send"] & ~a["group_meta"][a["op_group"]])


def _plan(job: CompiledJob, wait_at_post: bool) -> tuple | None:
    """Programs of nodes, their inputs ``(node, add)`` by slot, durations; None when not exact."""
    a = job.arrays
    count = len(job.steps)
    durations = np.asarray(job.durations, dtype=np.float64)
    op_time = a["op_time"]
    if not (np.all(np.isfinite(durations)) and np.all(durations >= 0) and np.all(np.isfinite(op_time))
            and np.all(op_time >= 0) and np.all(np.isfinite(a["adds"]))):
        return None
    op_send, op_group, op_other = a["op_send"], a["op_group"], a["op_other"]
    groups = len(job.group_steps)
    receives = np.bincount(op_group[~op_send], minlength=groups)
    waits = (a["group_meta"] | wait_at_post) & (receives > 0)
    if np.any(receives[waits] > _SLOTS):
        return None
    waiting_groups = np.flatnonzero(waits)
    nodes = count + waiting_groups.size
    zero = nodes  # the cell of time 0.0
    group_node = np.full(groups, -1, dtype=np.int64)
    group_node[waiting_groups] = count + np.arange(waiting_groups.size)

    entries, entry_rank = a["entries"], a["entry_rank"]
    node_of_entry = entries.copy()
    comm = entries < 0
    node_of_entry[comm] = group_node[-1 - entries[comm]]
    size = entries.size
    last = np.maximum.accumulate(np.where(node_of_entry >= 0, np.arange(size), -1)) if size else entries
    before = np.concatenate([[-1], last[:-1]]) if size else entries
    first_of_rank = np.searchsorted(entry_rank, entry_rank)  # entries are rank by rank
    prev_node = np.where(before >= first_of_rank, node_of_entry[np.maximum(before, 0)], zero)

    send_clock = prev_node[a["group_entry"][op_group]]  # per op: its group's issue clock (node)
    dep = np.full((_SLOTS, nodes), -1, dtype=np.int64)
    add = np.zeros((_SLOTS, nodes), dtype=np.float64)
    deps, adds, received = a["deps"], a["adds"], a["received"]
    compute_entry = a["compute_entry"]
    base = job.num_ops
    for slot in range(_SLOTS):
        cells, got = deps[slot], received[slot]
        local = (cells >= 0) & ~got
        dep[slot, :count][local] = cells[local] - base
        add[slot, :count][local] = adds[slot][local]
        if np.any(got):
            recv = cells[got]
            if np.any(a["group_entry"][op_group[recv]] > compute_entry[got]):
                return None  # posted after the step that needs it: the exact model waits forever
            dep[slot, :count][got] = send_clock[op_other[recv]]
            add[slot, :count][got] = op_time[recv]
    waiting_recvs = np.flatnonzero(~op_send & waits[op_group])
    if waiting_recvs.size:
        node = group_node[op_group[waiting_recvs]]
        first = np.searchsorted(node, node)  # receives of a group are consecutive
        slot = np.arange(waiting_recvs.size) - first
        dep[slot, node] = send_clock[op_other[waiting_recvs]]
        add[slot, node] = op_time[waiting_recvs]

    bounds = np.searchsorted(entry_rank, job.ranks + [job.ranks[-1] + 1] if job.ranks else [])
    node_programs = {}
    for k, rank in enumerate(job.ranks):
        mine = node_of_entry[bounds[k]:bounds[k + 1]]
        node_programs[rank] = mine[mine >= 0].tolist()
    data = _data_receives(job)
    all_durations = np.concatenate([durations, np.zeros(waiting_groups.size)]).tolist()
    return (node_programs, dep.tolist(), add.tolist(), all_durations, prev_node, node_of_entry,
            send_clock[op_other[data]], op_time[data])


def _records(job: CompiledJob, num_stages: int, times: np.ndarray, compute: dict, prev_node: np.ndarray,
             node_of_entry: np.ndarray) -> list:
    """The trace records of the general fast run, from its state rebuilt out of the node times."""
    from hyper_parallel.core.pipeline_parallel.simulation.fast_timed import _FastRun

    a = job.arrays
    run = _FastRun(job, num_stages, False)
    run.compute = compute
    issued = times[prev_node[a["group_entry"]]]
    run.issued = issued.tolist()
    run.active = run.issued
    op_issued = issued[a["op_group"]]
    other_issued = op_issued[a["op_other"]] + a["op_time"]
    ops = np.where(a["op_send"], op_issued, np.maximum(op_issued, other_issued))
    run.time = ops.tolist() + times[:len(job.steps)].tolist()
    after = np.where(node_of_entry >= 0, times[np.maximum(node_of_entry, 0)], times[prev_node])
    bounds = np.searchsorted(a["entry_rank"], job.ranks + [job.ranks[-1] + 1] if job.ranks else [])
    run.marks = {rank: after[bounds[k]:bounds[k + 1]].tolist() for k, rank in enumerate(job.ranks)}
    return run._records()
