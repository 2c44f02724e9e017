"""The job model of ``job_model.py`` with time: when each step of each rank starts and ends.

All ranks run their step lists together under the same rules as `job_model.JobModel` (read
its docstring first); this module adds a clock per rank and a duration per step:

- a compute step starts when its rank is free and its inputs exist, and lasts
  ``compute_time(step)``; the thread waits (a ``p2p-wait``) for a receive it consumes;
- a data communication step issues its operations at the rank's time and takes no time of
  the rank's thread (``p2p-issue``, zero length), except that with ``wait_at_post`` it waits
  for its receives;
- a message takes ``message_time(key)`` once both sides are ready for it:

  - ``"eager"`` (gloo): a receive completes at ``max(posted, send issued + message time)``;
    a send completes when issued (buffered);
  - ``"stream"`` (NCCL / HCCL): a group becomes active at ``max(issued, previous group of
    its rank completed)``; a send/receive pair completes at ``max(both groups active) +
    message time``; a group completes with its last operation;

- metadata (SEND_META / RECV_META) travels outside the groups: a RECV_META waits until its
  SEND_META was issued plus the message time of the metadata;
- in a compute-only list (``lowered=False``) a value made on another rank exists
  ``message_time`` after it was made;
- a rank finishes when its list is done and everything it issued has completed.

With ``runtime`` costs (``runtime_costs.py``, measured by ``hyper-parallel calibrate``) the
runtime's own work is charged too: posting a communication step takes the rank's time (its
messages leave when the post begins), a compute step costs its ``compute_ms`` beyond its compute,
a wait on received data that is already there ``wait_ms``, a hand-over of data that just arrived
``received_ms`` from its arrival (in a compute-only list every input made on another rank
counts as received, arriving ``message_time`` after it was made), a metadata receive ``meta_recv_ms`` once its message arrived, and every rank ends ``run_ms`` later. Without them, or with
every figure 0, the times are exactly those above.

Links are independent (no contention between messages). Because every time is a maximum of
earlier times plus durations, the result does not depend on the order in which ranks are
advanced. A rank that can never go on is reported in ``stuck``, as in the job model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType, Schedule, consumer_stage, consumes, message_key, produces
from hyper_parallel.core.pipeline_parallel.lowering.job_model import MODELS, producer_text
from hyper_parallel.core.pipeline_parallel.simulation.lazy_records import lazy_records
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import RuntimeCosts

Record = dict
"""One trace record: ``{"rank", "step", "kind", "start", "end"}`` (see ``trace.py``)."""


@dataclass(eq=False)
class _Op:
    key: DataKey
    is_send: bool
    step: MetaStep
    group: _Group
    done: float | None = None  # completion time


@dataclass(eq=False)
class _Group:
    rank: int
    issued: float
    ops: list[_Op] = field(default_factory=list)
    active: float | None = None
    completed: float | None = None


@lazy_records
@dataclass
class TimedOutcome:
    """What a timed run found. ``compute[rank]`` lists ``(start, end, step)`` of the compute
    steps; ``records`` the trace records of all ranks (compute, p2p-issue, p2p-wait on the
    ranks' threads, and ``p2p`` for each message in flight; sorted by rank, start and end; the
    fast run of ``fast_timed.py`` makes them on first use); ``finish[rank]`` is when the rank
    was done; ``stuck`` as in ``job_model.JobOutcome``."""

    compute: dict[int, list[tuple[float, float, MetaStep]]]
    records: list[Record]
    finish: dict[int, float]
    stuck: dict[int, tuple[int, str]]

    @property
    def finished(self) -> bool:
        return not self.stuck


class TimedJobModel:
    """One timed run over the step lists of all ranks (see the module docstring)."""

    def __init__(
        self,
        schedule: Schedule,
        stage_to_rank: dict[int, int],
        compute_time: Callable[[MetaStep], float],
        message_time: Callable[[DataKey], float],
        *,
        lowered: bool = True,
        model: str = "eager",
        wait_at_post: bool = False,
        runtime: RuntimeCosts | None = None,
    ) -> None:
        if model not in MODELS:
            raise ValueError(f"unknown communication model {model!r}; valid: {', '.join(MODELS)}")
        self.steps = {rank: [s for s in steps if s is not None] for rank, steps in schedule.items()}
        self.ranks = sorted(self.steps)
        self.stage_to_rank = stage_to_rank
        self.num_stages = len(stage_to_rank)
        self.compute_time = compute_time
        self.message_time = message_time
        self.lowered = lowered
        self.stream = model == "stream"
        self.wait_at_post = wait_at_post
        self.runtime = runtime
        self.cursor = dict.fromkeys(self.ranks, 0)
        self.clock = dict.fromkeys(self.ranks, 0.0)
        self.made: dict[DataKey, tuple[float, int]] = {}  # value -> (time made, rank)
        self.sends: dict[DataKey, _Op] = {}
        self.recvs: dict[tuple[int, DataKey], _Op] = {}
        self.meta_sent: dict[DataKey, float] = {}
        self.queue: dict[int, list[_Group]] = {rank: [] for rank in self.ranks}
        self.head = dict.fromkeys(self.ranks, 0)
        self.issued_at: dict[int, int] = {}  # rank -> index of a comm step issued, still waiting
        self.waits: dict[int, str | tuple] = {}  # the text is made only for the ranks that stay stuck
        self.compute: dict[int, list[tuple[float, float, MetaStep]]] = {rank: [] for rank in self.ranks}
        self.records: list[Record] = []

    # ------------------------------------------------------------------ driver
    def run(self) -> TimedOutcome:
        progress = True
        while progress:
            progress = False
            for rank in self.ranks:
                while self._advance(rank):
                    progress = True
        stuck: dict[int, tuple[int, str]] = {}
        finish: dict[int, float] = {}
        for rank in self.ranks:
            ends = [op.done for g in self.queue[rank] for op in g.ops]
            if self.cursor[rank] < len(self.steps[rank]) or None in ends:
                index = min(self.cursor[rank], max(len(self.steps[rank]) - 1, 0))
                stuck[rank] = (index, _wait_text(self.waits.get(rank, "its sends to complete")))
            else:
                finish[rank] = max([self.clock[rank], *ends]) + (self.runtime.run_ms if self.runtime else 0.0)
        for op in self.sends.values():
            recv = self._counterpart(op)
            if recv is not None and recv.done is not None:  # in flight from the moment both sides allow it
                start = max(op.group.active, recv.group.active) if self.stream else op.group.issued
                self.records.append(_record(op.group.rank, op.step, "p2p", start, recv.done))
        self.records.sort(key=lambda r: (r["rank"], r["start"], r["end"]))
        return TimedOutcome(self.compute, self.records, finish, stuck)

    def _advance(self, rank: int) -> bool:
        steps = self.steps[rank]
        index = self.cursor[rank]
        if index >= len(steps):
            return False
        step = steps[index]
        if step.meta_type.is_comm:
            return self._communicate(rank, index, step)
        if step.meta_type.is_compute:
            return self._run_compute(rank, step)
        self.cursor[rank] += 1  # steps the model does not know (FSDP, swap...) take no time
        return True

    # ------------------------------------------------------------------ compute
    def _run_compute(self, rank: int, step: MetaStep) -> bool:
        ready = self.clock[rank]
        waited_for: MetaStep | None = None
        received, arrival = 0, 0.0  # inputs that came over a link; when the last of them arrived
        for part in step.parts:
            for key in consumes(part, self.num_stages):
                at, what = self._available(rank, key)
                if at is None:
                    self.waits[rank] = what
                    return False
                if isinstance(what, MetaStep) or (not self.lowered and self.stage_to_rank[key[1]] != rank):
                    received, arrival = received + 1, max(arrival, at)  # came over a link (lowered or not)
                if at > ready:
                    ready, waited_for = at, what
        duration = self.compute_time(step)
        if self.runtime is not None:  # see the module docstring: the runtime's own work around the compute
            rt = self.runtime
            end = self.clock[rank] + received * rt.wait_ms + duration + rt.compute_cost(step)
            if received:
                end = max(end, arrival + duration + rt.compute_cost(step, received=True))
            ready = max(ready, end - duration)  # never before an input is there
            duration = end - ready
        if waited_for is not None and ready > self.clock[rank]:
            label = producer_text(waited_for) if isinstance(waited_for, tuple) else waited_for
            self.records.append(_record(rank, label, "p2p-wait", self.clock[rank], ready))
        end = ready + duration
        self.compute[rank].append((ready, end, step))
        self.records.append(_record(rank, step, "compute", ready, end))
        for part in step.parts:
            for key in produces(part):
                self.made[key] = (end, rank)
        self.clock[rank] = end
        self.cursor[rank] += 1
        return True

    def _available(self, rank: int, key: DataKey) -> tuple[float | None, tuple | MetaStep]:
        """When ``key`` can be used on ``rank`` (None: not yet known) and what it waits for: the
        receive step, the value's key (its producer, for a compute-only list), or while unknown a
        wait for ``_wait_text`` (texts are made only where needed: a large job asks millions of times)."""
        owner = self.stage_to_rank[key[1]]
        if owner == rank or not self.lowered:
            found = self.made.get(key)
            if found is None:
                return None, ("made", key, owner)
            made, where = found
            return (made if where == rank else made + self.message_time(key)), key
        op = self.recvs.get((rank, key))
        if op is None or op.done is None:
            return None, ("received", key, owner, op is not None)
        return op.done, op.step

    # ------------------------------------------------------------------ communication
    def _communicate(self, rank: int, index: int, step: MetaStep) -> bool:
        if self.issued_at.get(rank) != index:
            self._issue(rank, step)
            self.issued_at[rank] = index
        blocking = self._blocking(rank, step)
        if any(op.done is None for op in blocking):
            pending = next(op for op in blocking if op.done is None)
            self.waits[rank] = ("sent", pending.key, self.stage_to_rank[pending.key[1]])
            return False
        if blocking:
            ready = max(op.done for op in blocking)
            if ready > self.clock[rank]:
                self.records.append(_record(rank, step, "p2p-wait", self.clock[rank], ready))
                self.clock[rank] = ready
        if self.runtime is not None and step.meta_type is MetaStepType.META_RECV:
            self.clock[rank] += self.runtime.meta_recv_ms  # after its message arrived
        del self.issued_at[rank]
        self.cursor[rank] += 1
        return True

    def _blocking(self, rank: int, step: MetaStep) -> list[_Op]:
        ops = [self.recvs.get((rank, message_key(p))) for p in step.comm_parts if p.meta_type.is_recv]
        if step.meta_type.is_meta:
            return [op for op in ops if op is not None]
        return [op for op in ops if op is not None] if self.wait_at_post else []

    def _issue(self, rank: int, step: MetaStep) -> None:
        now = self.clock[rank]  # its messages leave now; the post takes the rank's time (runtime costs)
        if self.runtime is not None:
            self.clock[rank] += self.runtime.post_cost(step)
        self.records.append(_record(rank, step, "p2p-issue", now, self.clock[rank]))
        group = _Group(rank, now)
        for part in step.comm_parts:
            key = message_key(part)
            if key is None:
                raise ValueError(f"{part} carries no message")
            op = _Op(key, part.meta_type.is_send, part, group)
            group.ops.append(op)
            if op.is_send:
                self.sends[key] = op
            else:
                self.recvs[(rank, key)] = op
        if step.meta_type.is_meta:  # the metadata channel: outside the groups
            group.active = now
            for op in group.ops:
                if op.is_send:
                    op.done = now
                    self.meta_sent[op.key] = now
                    self._meta_arrival(self.recvs.get((self._consumer_rank(op.key), op.key)))
                else:
                    self._meta_arrival(op)
            return
        self.queue[rank].append(group)
        if self.stream:
            self._activate_stream(rank)
        else:
            self._activate_eager(group)

    def _meta_arrival(self, op: _Op | None) -> None:
        if op is not None and op.done is None and op.key in self.meta_sent:
            op.done = max(op.group.issued, self.meta_sent[op.key] + self.message_time(op.key))

    def _consumer_rank(self, key: DataKey) -> int:
        return self.stage_to_rank[consumer_stage(key)]

    def _counterpart(self, op: _Op) -> _Op | None:
        if op.is_send:
            return self.recvs.get((self._consumer_rank(op.key), op.key))
        return self.sends.get(op.key)

    def _activate_eager(self, group: _Group) -> None:
        group.active = group.issued
        for op in group.ops:
            if op.is_send:
                op.done = group.issued
                recv = self._counterpart(op)
                if recv is not None and recv.done is None:
                    recv.done = max(recv.group.issued, group.issued + self.message_time(op.key))
            else:
                send = self._counterpart(op)
                if send is not None:
                    op.done = max(group.issued, send.group.issued + self.message_time(op.key))

    def _activate_stream(self, rank: int) -> None:
        pending = [rank]
        while pending:
            r = pending.pop()
            queue = self.queue[r]
            while self.head[r] < len(queue) and queue[self.head[r]].completed is not None:
                self.head[r] += 1
            if self.head[r] >= len(queue) or queue[self.head[r]].active is not None:
                continue
            group = queue[self.head[r]]
            previous = queue[self.head[r] - 1].completed if self.head[r] > 0 else None
            group.active = max(group.issued, previous if previous is not None else group.issued)
            for op in group.ops:
                other = self._counterpart(op)
                if op.done is None and other is not None and other.group.active is not None:
                    done = max(group.active, other.group.active) + self.message_time(op.key)
                    op.done = other.done = done
                    if _finish_group(other.group):
                        pending.append(other.group.rank)
            if _finish_group(group):
                pending.append(r)


def _finish_group(group: _Group) -> bool:
    """Set the group's completion time once every operation is done; True when it just completed."""
    if group.completed is not None or any(op.done is None for op in group.ops):
        return False
    group.completed = max((op.done for op in group.ops), default=group.active)
    return True


def _record(rank: int, step: MetaStep | str, kind: str, start: float, end: float) -> Record:
    return {"rank": rank, "step": str(step), "kind": kind, "start": start, "end": end}


def _wait_text(wait: str | tuple) -> str:
    """The text of a wait noted by ``_available`` or ``_communicate`` (as it stood then)."""
    if isinstance(wait, str):
        return wait
    if wait[0] == "made":
        return f"{producer_text(wait[1])} on rank {wait[2]}"
    if wait[0] == "received":
        state = "a completed" if wait[3] else "a"
        return f"{state} receive of {producer_text(wait[1])} from rank {wait[2]}"
    return f"{_send_text(wait[1])} on rank {wait[2]}"


def _send_text(key: DataKey) -> str:
    kind, stage, micro = key
    code = {"F": "SEND_F", "M": "SEND_META", "G": "SEND_B"}[kind]
    return f"{code}.s{stage}.m{micro}"


def run_timed(
    schedule: Schedule,
    stage_to_rank: dict[int, int],
    compute_time: Callable[[MetaStep], float],
    message_time: Callable[[DataKey], float],
    *,
    lowered: bool = True,
    model: str = "eager",
    wait_at_post: bool = False,
    runtime: RuntimeCosts | None = None,
) -> TimedOutcome:
    """One timed run (see :class:`TimedJobModel`)."""
    return TimedJobModel(schedule, stage_to_rank, compute_time, message_time, lowered=lowered, model=model,
                         wait_at_post=wait_at_post, runtime=runtime).run()
