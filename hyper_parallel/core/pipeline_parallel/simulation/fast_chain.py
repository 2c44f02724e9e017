"""The timed model of ``timed_model.py`` as chains of *nodes*: the same floats as the general fast
run (``fast_timed.py``), with fewer steps visited.

A rank's clock only moves at compute steps and at the communication steps that wait for their
receives (metadata, or ``wait_at_post``); every duration and message time is >= 0, so the clock
never goes back. These are the nodes of the rank's chain. A communication step that does not wait
is issued at the clock, which is the end of the last node before it (0.0 before the first), and
its rank does not stop there, so it needs no visit. Each node ends at ``max(clock, inputs) +
duration`` (0.0 for a waiting communication step: ``x + 0.0`` is ``x``), the inputs being
``time(cell) + add``:

- eager model (and metadata in both models): a receive completes at ``max(posted, s + t)``, ``s``
  the sender's clock when it issued the send, ``t`` the message time; a step that consumes it
  starts at ``max(clock, max(posted, s + t))`` = ``max(clock, s + t)`` since the receive was
  posted earlier on the same rank (posted <= clock): the input is the node before the send,
  plus ``t``;
- stream model: a data group ``g`` becomes active at ``A(g) = max(issued(g), C(previous group of
  its rank))``, an operation completes at ``max(A(g), A(other group)) + t`` = ``max(A(g) + t,
  A(other) + t)`` (rounding is monotone), and the group completes at ``C(g)``, the largest of
  those: ``max(A(g) + T(g), A(other) + t, ...)`` with ``T(g)`` its largest message time. So
  ``A(g)`` is the maximum of ``issued(g)`` and the operands of ``C(previous)``: a node whose
  inputs are ``A(previous) + T(previous)`` and ``A(other) + t`` for each operation of the previous
  group (``C`` needs no node). A step that consumes a receive takes ``A(g) + t`` and ``A(other) +
  t`` as inputs.

Two runs give the nodes their times, with the same floats:

- node by node (``fast_nodes.py``), one chain per rank, visited until it waits for another: there
  ``A(g)`` sits in its rank's chain at the group's place (``issued(g)`` is the clock there) and
  leaves the clock as it was (a *side* node). A step after ``g`` on its rank so runs after
  ``A(g)``, which the exact model does not ask for: where that makes the chains wait for each
  other (a rank's data reaches its partner only through its stream, behind ``C(previous)``, so
  only metadata, sent outside the streams, could make such a wait) the run does not finish and
  the general run takes over;
- for a large job over many ranks, every chain at once with numpy (``fast_lanes.py``), one node
  of each *lane* per round: a rank's clocked nodes form a lane, and its ``A(g)`` a second one,
  ``issued(g)`` an input (that lane's clock, the previous ``A``, is below its input ``A(previous)
  + T(previous)`` and changes no maximum). Where the lanes move too few nodes a round (ranks that
  wait on each other in turn) the run goes on node by node from there.

Every time is so computed by the same additions and maxima of the same operands as in the
exact model. The times of the operations (for the trace records and finish times) follow from
the node times with numpy, and so do the timelines (a compute step starts at its maximum above)
and the busy times. `run_chain` returns None where that reasoning does not hold (a negative or
non-finite duration or message time, a receive posted after the step that consumes it, more
inputs to one node than a run takes) or where the run does not finish: the caller then uses the
general fast run, which says so in its own way.
"""

from __future__ import annotations

from operator import sub

import numpy as np

from hyper_parallel.core.pipeline_parallel.simulation.fast_general import FastRun
from hyper_parallel.core.pipeline_parallel.simulation.fast_job import CompiledJob
from hyper_parallel.core.pipeline_parallel.simulation.fast_lanes import run_lanes
from hyper_parallel.core.pipeline_parallel.simulation.fast_nodes import run_nodes
from hyper_parallel.core.pipeline_parallel.simulation.lazy_records import RecordSource
from hyper_parallel.core.pipeline_parallel.simulation.timed_model import TimedOutcome

_SLOTS = 6  # inputs per node (written out in `fast_nodes.run_nodes`)
_LANE_SLOTS = 16  # inputs per node in `fast_lanes.run_lanes` (a column each)
LANES_MIN_NODES = 20_000
"""`run_chain` runs the lanes together (`fast_lanes.py`) from this many nodes on, and where the nodes
are at least `LANES_MIN_WIDTH` times as many as the longest lane has (a round then does the work of
that many node visits); it goes on node by node where the lanes move fewer than `LANES_MIN_RATE`
nodes a round."""
LANES_MIN_WIDTH = 32
LANES_MIN_RATE = 20
_FEW_LEFT = 8  # going on node by node with fewer than 1/8 of the nodes left: lists filled item by item


def run_chain(job: CompiledJob, num_stages: int, wait_at_post: bool, stream: bool = False,
              timelines: bool = True, lanes: bool | None = None) -> TimedOutcome | None:
    """The timed run of a compiled job (see the module docstring), or None. The outcome's ``busy``
    (rank -> the sum of its steps' lengths, in order, as `simulate` adds them) says what the
    timelines sum to; without ``timelines`` the ``compute`` lists stay empty and records cannot be
    made. ``lanes``: run all chains together with numpy (``fast_lanes.py``); None: where that is
    cheaper (many ranks)."""
    plan = _Plan.make(job, wait_at_post, stream, lanes)
    if plan is None:
        return None
    ran = plan.run()
    if ran is None:
        return None  # stuck: the general run (and then the exact model) will say where
    time, starts, clock_of = ran
    compute, busy = {}, {}
    count = len(job.steps)
    ends, steps = time[:count], job.steps
    if isinstance(ends, np.ndarray):
        ends = ends.tolist()
    bounds = _rank_bounds(job, job.arrays["rank"]).tolist()  # compute steps are numbered rank by rank, in order
    for k, rank in enumerate(job.ranks):
        lo, hi = bounds[k], bounds[k + 1]
        compute[rank] = list(zip(starts[lo:hi], ends[lo:hi], steps[lo:hi])) if timelines else []
        busy[rank] = sum(map(sub, ends[lo:hi], starts[lo:hi]))  # as `simulate` sums a timeline: the same floats
    finish = plan.finish(time, dict(zip(job.ranks, clock_of)))
    if not timelines:
        outcome = TimedOutcome(compute, [], finish, {})
    else:
        kept = {rank: list(steps) for rank, steps in compute.items()}  # the caller may change the lists it gets
        source = RecordSource(lambda: plan.records(num_stages, np.asarray(time, dtype=np.float64), kept))
        outcome = TimedOutcome(compute, source, finish, {})  # type: ignore[arg-type]
    outcome.busy = busy
    return outcome


class _Slots:
    """The inputs ``(cell, add)`` of every node, a row each (a node's next input takes its next free
    slot, a column), then a row for the cell of 0.0 and one for a node that never runs (the lanes'
    ends); no input: the cell ``none``, adding 0.0."""

    def __init__(self, nodes: int, limit: int, none: int, width: int) -> None:
        self.nodes, self.limit, self.none = nodes, limit, none
        self.width = 0  # the slots used
        self.cell = np.full((nodes + 2, min(width, limit)), none, dtype=np.int64)
        self.add = np.zeros(self.cell.shape, dtype=np.float64)
        self.filled = np.zeros(nodes, dtype=np.int64)  # per node: the slots taken

    def put(self, node: np.ndarray, cell: np.ndarray, add: np.ndarray, runs: bool = False) -> None:
        """One more input for each of ``node``; ``runs``: a node may come again, but only right after
        itself (then each time in the next slot), else every node comes once."""
        if node.size == 0:
            return
        slot = self.filled[node]
        if runs:
            start = np.flatnonzero(np.concatenate([[True], node[1:] != node[:-1]]))
            length = np.diff(np.append(start, node.size))
            slot = slot + (np.arange(node.size) - np.repeat(start, length))
            self.filled[node[start]] += length
        else:
            self.filled[node] += 1
        lowest, highest = int(slot.min()), min(int(slot.max()), self.limit - 1)
        if highest >= self.cell.shape[1]:  # wider: a copy (rare, the first width fits most jobs)
            width = min(max(highest + 1, 2 * self.cell.shape[1]), self.limit)
            cells, adds = np.full((self.nodes + 2, width), self.none, dtype=np.int64), np.zeros((self.nodes + 2, width))
            cells[:, :self.cell.shape[1]], adds[:, :self.add.shape[1]] = self.cell, self.add
            self.cell, self.add = cells, adds
        self.width = max(self.width, highest + 1)
        for j in range(lowest, highest + 1):
            at = slice(None) if lowest == highest else slot == j
            self.cell[node[at], j] = cell[at]
            self.add[node[at], j] = add[at]

    def fits(self) -> bool:
        """No node has more inputs than the run has slots."""
        return not self.filled.size or int(self.filled.max()) <= self.limit

    def lists(self) -> tuple[list[list[int]], list[list[float]]]:
        """The slots as the lists the node-by-node run reads: a slot few nodes use is filled in item
        by item."""
        nodes = self.nodes
        none, zeros = [-1] * nodes, [0.0] * nodes  # the slots no node uses: read, never written
        deps, adds = [], []
        for j in range(self.width):
            dep, add = self.cell[:nodes, j], self.add[:nodes, j]
            used = np.flatnonzero(dep >= 0)
            if used.size * 16 < nodes:
                dep_list, add_list = list(none), list(zeros)
                for k, cell, value in zip(used.tolist(), dep[used].tolist(), add[used].tolist()):
                    dep_list[k], add_list[k] = cell, value
                deps.append(dep_list)
                adds.append(add_list)
            else:
                deps.append(dep.tolist())
                adds.append(add.tolist())
        deps += [none] * (_SLOTS - len(deps))
        adds += [zeros] * (_SLOTS - len(adds))
        return deps, adds

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The slots used as the lanes read them (`fast_lanes.run_lanes`)."""
        width = max(self.width, 1)
        cell, add = self.cell[:, :width], self.add[:, :width]
        cell[self.nodes], cell[self.nodes + 1] = self.nodes, self.nodes + 1
        return np.ascontiguousarray(cell), np.ascontiguousarray(add)


def _columns(array: np.ndarray, fill: float, rows: np.ndarray | None) -> list[list]:
    """Each column of a 2-d array as a list; with ``rows``, only those rows are filled in (``fill``
    elsewhere: cheaper where they are few)."""
    if rows is None:
        return [array[:, j].tolist() for j in range(array.shape[1])]
    at = rows.tolist()
    columns = []
    for j in range(array.shape[1]):
        column = [fill] * array.shape[0]
        for k, value in zip(at, array[rows, j].tolist()):
            column[k] = value
        columns.append(column)
    return columns


def _rank_bounds(job: CompiledJob, ranks_of: np.ndarray) -> np.ndarray:
    """Where each rank's part begins (and the last one ends) in an array ordered rank by rank."""
    return np.searchsorted(ranks_of, job.ranks + [job.ranks[-1] + 1] if job.ranks else [])


class _Plan:
    """The nodes, their inputs and the chains of a compiled job."""

    def __init__(self, job: CompiledJob, wait_at_post: bool, stream: bool, lanes: bool | None) -> None:
        self.job = job
        self.wait_at_post = wait_at_post
        self.stream = stream
        self.lanes = lanes  # None: chosen in `_build`
        self.too_wide = False  # a node has more inputs than the run takes

    @classmethod
    def make(cls, job: CompiledJob, wait_at_post: bool, stream: bool, lanes: bool | None = None) -> _Plan | None:
        plan = cls(job, wait_at_post, stream, lanes)
        if plan._build(wait_at_post):
            return plan
        if plan.lanes and plan.too_wide and lanes is None:  # still worth a try node by node
            return cls.make(job, wait_at_post, stream, False)
        return None

    def _build(self, wait_at_post: bool) -> bool:
        job, a, stream = self.job, self.job.arrays, self.stream
        count = len(job.steps)
        op_time = a["op_time"]
        for values in (a["durations"], op_time, a["adds"]):
            if not (np.all(np.isfinite(values)) and np.all(values >= 0)):
                return False
        op_send, op_group, group_meta = a["op_send"], a["op_group"], a["group_meta"]
        groups = len(job.group_steps)
        receives = np.bincount(op_group[~op_send], minlength=groups)
        waits = (group_meta | wait_at_post) & (receives > 0)
        waiting_groups = np.flatnonzero(waits)
        data_groups = np.flatnonzero(~group_meta) if stream else np.zeros(0, dtype=np.int64)
        n_wait, n_data = waiting_groups.size, data_groups.size
        side = count + n_wait  # nodes from here on (A(g)) leave their chain's clock as it was
        nodes = side + n_data
        zero = nodes  # the cell of time 0.0
        group_node = np.full(groups, -1, dtype=np.int64)
        group_node[waiting_groups] = count + np.arange(n_wait)
        active = np.full(groups, -1, dtype=np.int64)  # the node of A(g)
        active[data_groups] = side + np.arange(n_data)

        entries, entry_rank = a["entries"], a["entry_rank"]
        node_of_entry = entries.copy()
        comm = entries < 0
        node_of_entry[comm] = group_node[-1 - entries[comm]]
        size = entries.size
        last = np.maximum.accumulate(np.where(node_of_entry >= 0, np.arange(size), -1)) if size else entries
        before = np.concatenate([[-1], last[:-1]]) if size else entries
        rank_start = _rank_bounds(job, entry_rank)  # entries are rank by rank
        first_of_rank = np.repeat(rank_start[:-1], np.diff(rank_start))
        prev_node = np.where(before >= first_of_rank, node_of_entry[np.maximum(before, 0)], zero)
        issued = prev_node[a["group_entry"]]  # per group: the node whose end is its issue time
        data_op = ~group_meta[op_group] if stream else np.zeros(op_group.size, dtype=bool)

        if self.lanes is None:  # the longest lane: a rank's clocked nodes, or its A(g) (counted apart)
            longest = max(np.diff(_rank_bounds(job, entry_rank[node_of_entry >= 0])).max(initial=0),
                          np.diff(_rank_bounds(job, a["group_rank"][data_groups])).max(initial=0))
            self.lanes = nodes >= LANES_MIN_NODES and nodes >= LANES_MIN_WIDTH * longest
        self.lanes = self.lanes and bool(job.ranks)
        compiled = a["deps"].shape[0]
        slots = _Slots(nodes, _LANE_SLOTS if self.lanes else _SLOTS, zero if self.lanes else -1,
                       compiled if groups == 0 else _SLOTS)
        if groups == 0:  # compute steps only: their inputs are the compiled ones
            number = np.arange(count, dtype=np.int64)
            for slot in range(compiled):
                cells = a["deps"][slot]
                has = cells >= 0
                slots.put(number[has], cells[has] - job.num_ops, a["adds"][slot][has])
        elif not self._inputs(slots, count, waits, group_node, active, issued, data_op, data_groups, n_data, groups):
            return False
        if not slots.fits():
            self.too_wide = True
            return False

        self.nodes, self.side = nodes, side
        self.durations_array = np.concatenate([a["durations"], np.zeros(n_wait + n_data + 2)])  # + the lanes' 2 rows
        self.prev_node, self.node_of_entry, self.issued, self.active = prev_node, node_of_entry, issued, active
        self.data_op, self.n_data, self.data_groups = data_op, n_data, data_groups
        if self.lanes:  # each rank's clocked nodes, then each rank's A(g): lanes of their own
            self.dep, self.add = slots.arrays()
            clocked = node_of_entry >= 0
            self.lane_nodes = np.concatenate([node_of_entry[clocked], active[data_groups]])
            self.lane_start = _rank_bounds(job, entry_rank[clocked])
            if n_data:
                self.lane_start = np.concatenate([self.lane_start, self.lane_start[-1] +
                                                  _rank_bounds(job, a["group_rank"][data_groups])[1:]])
            return True
        if n_data:  # a data group's A(g) sits at the group's place, before its wait (if it waits)
            table = np.full((size, 2), -1, dtype=np.int64)
            table[a["group_entry"][data_groups], 0] = active[data_groups]
            table[:, 1] = node_of_entry
            flat, flat_rank = table.reshape(-1), np.repeat(entry_rank, 2)
        else:
            flat, flat_rank = node_of_entry, entry_rank
        kept = flat >= 0
        flat, flat_rank = flat[kept], flat_rank[kept]
        bounds = _rank_bounds(job, flat_rank)
        self.programs = [flat[bounds[k]:bounds[k + 1]].tolist() for k in range(len(job.ranks))]
        self.deps, self.adds = slots.lists()
        self.durations = job.durations + [0.0] * (n_wait + n_data)
        return True

    def _inputs(self, slots: _Slots, count: int, waits: np.ndarray, group_node: np.ndarray, active: np.ndarray,
                issued: np.ndarray, data_op: np.ndarray, data_groups: np.ndarray, n_data: int, groups: int) -> bool:
        """Every node's inputs ``(cell, add)`` into ``slots`` (see the module docstring); False: not exact here."""
        job, a = self.job, self.job.arrays
        op_time, op_send, op_group, op_other = a["op_time"], a["op_send"], a["op_group"], a["op_other"]
        put = slots.put

        def receive_inputs(node: np.ndarray, recv: np.ndarray, runs: bool = False) -> None:
            """What a receive gives the node that waits for it (see the module docstring); ``runs``: as
            in `_Slots.put` (the receives of one waiting group)."""
            data = data_op[recv]
            if not np.all(data):
                eager_node, eager_recv = node[~data], recv[~data]
                put(eager_node, issued[op_group[op_other[eager_recv]]], op_time[eager_recv], runs)
            if np.any(data):
                node, recv = node[data], recv[data]
                put(node, active[op_group[recv]], op_time[recv], runs)
                put(node, active[op_group[op_other[recv]]], op_time[recv], runs)

        number = np.arange(count, dtype=np.int64)
        base = job.num_ops
        compute_entry = a["compute_entry"]
        for slot in range(a["deps"].shape[0]):
            cells, got = a["deps"][slot], a["received"][slot]
            local = (cells >= 0) & ~got
            put(number[local], cells[local] - base, a["adds"][slot][local])
            if np.any(got):
                recv = cells[got]
                if np.any(a["group_entry"][op_group[recv]] > compute_entry[got]):
                    return False  # posted after the step that needs it: the exact model waits forever
                receive_inputs(number[got], recv)
        waiting_recvs = np.flatnonzero(~op_send & waits[op_group])
        receive_inputs(group_node[op_group[waiting_recvs]], waiting_recvs, runs=True)  # a group's side by side
        if n_data:
            # A(g) = max(issued(g) (the clock), C(previous)); C(previous) = max(A(previous) + T(previous),
            # A(other) + t for each of its operations): its operands become A(g)'s inputs
            start = a["group_start"]
            largest = np.zeros(groups)
            has_ops = start[1:] > start[:-1]
            if op_time.size:
                largest[has_ops] = np.maximum.reduceat(op_time, start[:-1][has_ops])
            rank_of = a["group_rank"][data_groups]
            after = np.full(groups, -1, dtype=np.int64)  # the next data group of the same rank
            same = rank_of[1:] == rank_of[:-1]
            after[data_groups[:-1][same]] = data_groups[1:][same]
            previous = data_groups[:-1][same]
            if self.lanes:  # A(g) in a lane of its own: issued(g) is an input, not its clock
                put(active[data_groups], issued[data_groups], np.zeros(n_data))
            put(active[after[previous]], active[previous], largest[previous])
            data_ops = np.flatnonzero(data_op & (after[op_group] >= 0))  # a group's operations side by side
            put(active[after[op_group[data_ops]]], active[op_group[op_other[data_ops]]], op_time[data_ops],
                runs=True)
        return True

    # ------------------------------------------------------------------ the run
    def run(self) -> tuple[list | np.ndarray, list, list] | None:
        """Every node's time (then the 0.0 cell), every compute step's start, each rank's clock at
        its end; None where a chain waits for what never comes."""
        job = self.job
        count, ranks = len(job.steps), len(job.ranks)
        if not self.lanes:
            time: list = [None] * (self.nodes + 1)
            time[self.nodes] = 0.0
            starts, clock_of = [0.0] * count, [0.0] * ranks
            done = run_nodes(self.programs, self.deps, self.adds, self.durations, self.side, count, time, starts,
                             [0] * ranks, clock_of)
            return (time, starts, clock_of) if done else None
        ran = run_lanes(self.dep, self.add, self.durations_array, self.lane_nodes, self.lane_start, LANES_MIN_RATE)
        if ran is None:
            return None
        times, start, clock, cursor = ran
        if cursor is None:
            return times, start[:count].tolist(), clock[:ranks].tolist()
        if self.dep.shape[1] > _SLOTS:  # too many inputs to go on node by node: start again that way,
            plan = _Plan.make(job, self.wait_at_post, self.stream, False)  # the nodes numbered alike
            if plan is not None:
                return plan.run()
            ran = run_lanes(self.dep, self.add, self.durations_array, self.lane_nodes, self.lane_start, 0.0, ran)
            return None if ran is None else (ran[0], ran[1][:count].tolist(), ran[2][:ranks].tolist())  # or all in lanes
        # the lanes stopped moving together: on node by node from where they are, every node moving its lane's clock
        nodes, slots = self.nodes, self.dep.shape[1]
        left = np.flatnonzero(np.isinf(times[:nodes]))  # the nodes not run yet
        time = times.tolist()
        for k in left.tolist():
            time[k] = None
        rows = left if left.size * _FEW_LEFT < nodes else None  # few left: the lists hold only theirs
        deps = _columns(self.dep[:nodes], -1, rows) + [[-1] * nodes] * (_SLOTS - slots)  # the 0.0 cell
        adds = _columns(self.add[:nodes], 0.0, rows) + [[0.0] * nodes] * (_SLOTS - slots)  # where none: harmless
        durations = _columns(self.durations_array[:nodes, None], 0.0, rows)[0]
        first, end = (self.lane_start[:-1] + cursor).tolist(), self.lane_start[1:].tolist()
        programs = [self.lane_nodes[a:b].tolist() for a, b in zip(first, end)]  # what is left of each lane
        starts, clock_of = start[:count].tolist(), clock.tolist()
        if not run_nodes(programs, deps, adds, durations, nodes, count, time, starts, [0] * cursor.size, clock_of):
            return None
        return time, starts, clock_of[:ranks]

    # ------------------------------------------------------------------ after the run
    def _op_times(self, times: np.ndarray) -> np.ndarray:
        """The completion time of every operation, as the general run sets it."""
        a = self.job.arrays
        op_group, op_other, op_time = a["op_group"], a["op_other"], a["op_time"]
        issued = times[self.issued][op_group]
        ops = np.where(a["op_send"], issued, np.maximum(issued, issued[op_other] + op_time))
        if self.n_data:
            at = times[self.active[op_group]]
            data = self.data_op
            ops[data] = np.maximum(at, at[op_other])[data] + op_time[data]
        return ops

    def finish(self, time: list[float], clock_of: dict) -> dict:
        """When each rank is done: its clock, or the last of its data operations to complete."""
        job, a = self.job, self.job.arrays
        op_group, op_other = a["op_group"], a["op_other"]
        data = np.flatnonzero(~a["group_meta"][op_group])
        if self.n_data:  # the stream model: as in `_op_times`, from the A(g) times alone
            side = self.side
            active = np.asarray(time[side:side + self.n_data], dtype=np.float64)
            mine, theirs = active[self.active[op_group[data]] - side], active[self.active[op_group[op_other[data]]] - side]
            ends = np.maximum(mine, theirs) + a["op_time"][data]
        else:
            ends = self._op_times(np.asarray(time, dtype=np.float64))[data]
        bounds = _rank_bounds(job, a["op_rank"][data])
        finish = {}
        for k, rank in enumerate(job.ranks):
            mine = ends[bounds[k]:bounds[k + 1]]
            last = clock_of[rank]
            if mine.size:
                latest = float(mine.max())
                last = latest if latest > last else last
            finish[rank] = last + 0.0
        return finish

    def records(self, num_stages: int, times: np.ndarray, compute: dict) -> list:
        """The trace records of the general fast run, from its state rebuilt out of the node times."""
        job, a = self.job, self.job.arrays
        run = FastRun(job, num_stages, self.stream)
        run.compute = run.kept = compute
        issued = times[self.issued]
        run.issued = issued.tolist()
        active = issued.copy()
        active[self.data_groups] = times[self.active[self.data_groups]]
        run.active = active.tolist()
        run.time = self._op_times(times).tolist() + times[:len(job.steps)].tolist()
        node = self.node_of_entry
        after = np.where(node >= 0, times[np.maximum(node, 0)], times[self.prev_node])
        bounds = _rank_bounds(job, a["entry_rank"])
        run.marks = {rank: after[bounds[k]:bounds[k + 1]].tolist() for k, rank in enumerate(job.ranks)}
        return run._records()
