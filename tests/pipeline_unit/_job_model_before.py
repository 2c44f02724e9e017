# ruff: noqa
# The job model (lowering/job_model.py) as of commit d9e2615, before the speed-ups of branch batch-speed,
# kept unchanged as the oracle of test_job_model_speed_equal.py. Do not edit.
"""How every rank of a job executes its step list, all ranks run together without tensors.

Validation asks this model whether a job can finish (deadlock freedom); lowering asks it what
each send depends on (where a receive may be posted early). The rules:

- A rank runs its list in order on one thread. A compute step (F/B/I/W/OVERLAP) runs once its
  inputs exist: a value an earlier step of this rank made, or a value whose receive has
  *completed*. In a compute-only list (``lowered=False``) a value made on another rank exists
  as soon as it was made there.
- A data communication step (send/recv, or a BATCH of them) issues its operations as one group
  and does not wait for them, except that with ``wait_at_post`` (no ``overlap_p2p``) it waits
  for its receives.
- Metadata (SEND_META / RECV_META) travels on a channel of its own, outside the groups: a
  SEND_META completes when issued, and a RECV_META waits until its SEND_META was issued (the
  data receive behind it needs the shapes).
- At the end of its list a rank waits until every operation it issued completed (sends too).

When a data operation completes depends on the engine:

- ``"eager"`` (gloo, LocalCluster; the ``plain`` transport): a send completes when issued
  (its data is buffered) and a receive completes once its send was issued.
- ``"stream"`` (NCCL / HCCL, where the groups of one rank run one after another on one stream;
  the ``batch`` transport): a group is active once it was issued and every earlier group of
  its rank completed; an operation completes when its group and the group holding the
  matching operation are both active; a group completes with its last operation. This is
  stricter than ``"eager"``: a receive posted too early blocks every later group of its rank.

With ``force_posts`` (stream model) the run does not stop at the first deadlock of sends waiting
for receives that are posted too late: such a receive is moved into the first unfinished group
of its rank and the run goes on; ``JobOutcome.forced`` lists these moves, which lowering then
makes in the step lists.

With ``track_clocks`` the model keeps vector clocks: per rank, the index (counting compute
steps only) of the last compute step of that rank an event depends on, through program order,
completed receives and (stream) the order of groups. For every send it reports the clock of
the moment its group became active: a receive of that message can join a group issued after
compute step ``k`` of its rank without ever waiting on itself when ``k`` is at least that
entry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, Schedule, consumer_stage, consumes, message_key, produces

MODELS = ("eager", "stream")
Clock = tuple[int, ...]
"""A vector clock, never changed once made: groups and operations share them (a run of a large job
holds millions, one entry per rank each); only a rank's own running clock is a list."""
_NO_CLOCK: Clock = ()  # groups' clocks when the run does not track them (never read then)


@dataclass(eq=False, slots=True)  # millions made and read per planning
class _Op:
    key: DataKey
    is_send: bool
    step: MetaStep
    group: _Group
    done: bool = False
    done_clock: Clock | None = None


@dataclass(eq=False, slots=True)  # millions made and read per planning
class _Group:
    rank: int
    index: int  # position of the step that issued it
    issue_clock: Clock
    ops: list[_Op] = field(default_factory=list)
    active: bool = False
    remaining: int = 0
    active_clock: Clock | None = None
    done_clock: Clock | None = None


@dataclass
class JobOutcome:
    """What a run of the model found.

    ``stuck`` maps each rank that could not finish to ``(index of the step it is stuck at,
    what it waits for)`` (indices count the steps of the list without idle slots);
    ``pending`` lists, per rank, the operations of active groups that never completed;
    ``heads`` gives the index of the step that issued each rank's first unfinished group;
    ``send_clocks`` maps each message key to the clock of its send's group becoming active
    (``track_clocks`` only; entries in the order of ``ranks``).
    """

    stuck: dict[int, tuple[int, str]]
    pending: dict[int, list[MetaStep]]
    heads: dict[int, int]
    send_clocks: dict[DataKey, tuple[int, ...]]
    ranks: list[int]
    forced: list[tuple[int, MetaStep, int]] = field(default_factory=list)
    """``force_posts`` only: (rank, receive, index of the step whose group it was moved into)."""

    @property
    def finished(self) -> bool:
        return not self.stuck


def _max_into(target: list[int], other: Clock | None) -> None:
    if other is not None:
        target[:] = map(max, target, other)  # in C: a clock has one entry per rank, merged per message


def _joined(clock: Clock, other: Clock | None) -> Clock:
    """The entry-wise maximum, ``clock`` itself when there is nothing to join."""
    return clock if other is None else tuple(map(max, clock, other))


class JobModel:
    """One run of the model over the step lists of all ranks (see the module docstring)."""

    def __init__(
        self,
        schedule: Schedule,
        stage_to_rank: dict[int, int],
        *,
        lowered: bool = True,
        model: str = "eager",
        wait_at_post: bool = False,
        track_clocks: bool = False,
        force_posts: bool = False,
    ) -> None:
        if model not in MODELS:
            raise ValueError(f"unknown communication model {model!r}; valid: {', '.join(MODELS)}")
        self.steps = {rank: [s for s in steps if s is not None] for rank, steps in schedule.items()}
        self.ranks = sorted(self.steps)
        self.position = {rank: k for k, rank in enumerate(self.ranks)}
        self.stage_to_rank = stage_to_rank
        self.num_stages = len(stage_to_rank)
        self.lowered = lowered
        self.stream = model == "stream"
        self.wait_at_post = wait_at_post
        self.track = track_clocks
        self.cursor = dict.fromkeys(self.ranks, 0)
        self.computed = dict.fromkeys(self.ranks, -1)  # index of the last compute step run
        self.clock: dict[int, list[int]] = {rank: [-1] * len(self.ranks) for rank in self.ranks}
        self.snapshot: dict[int, Clock | None] = dict.fromkeys(self.ranks)  # tuple(clock) until it changes
        self.issued: dict[int, int] = {}  # rank -> index of a comm step issued but still waiting
        self.blocking: dict[int, list[_Op]] = {}
        self.queue: dict[int, list[_Group]] = {rank: [] for rank in self.ranks}
        self.head = dict.fromkeys(self.ranks, 0)  # first group of the rank not completed (stream)
        self.sends: dict[DataKey, _Op] = {}
        self.recvs: dict[tuple[int, DataKey], _Op] = {}
        self.made: dict[int, set[DataKey]] = {rank: set() for rank in self.ranks}
        self.made_anywhere: set[DataKey] = set()
        self.waits: dict[int, str | tuple] = {}  # formatted once the run ended (``_wait_text``)
        self.done_upto = dict.fromkeys(self.ranks, 0)  # groups before this index of the queue all completed
        self.force = force_posts and self.stream
        self.forced: list[tuple[int, MetaStep, int]] = []
        self.preposted: set[tuple[int, DataKey]] = set()

    # ------------------------------------------------------------------ driver
    def run(self) -> JobOutcome:
        progress = True
        while progress:
            progress = False
            for rank in self.ranks:
                while self._advance(rank):
                    progress = True
            if not progress and self.force:
                progress = self._force_posts()
        stuck = {}
        for rank in self.ranks:
            if self.cursor[rank] < len(self.steps[rank]) or not self._all_done(rank):
                index = min(self.cursor[rank], len(self.steps[rank]) - 1)
                stuck[rank] = (index, self._wait_text(self.waits.get(rank, "its sends to complete")))
        pending: dict[int, list[MetaStep]] = {}
        heads: dict[int, int] = {}
        for rank in self.ranks:
            ops = [op.step for g in self.queue[rank] if g.active for op in g.ops if not op.done]
            if ops:
                pending[rank] = ops
            unfinished = next((g for g in self.queue[rank] if g.remaining), None)
            if unfinished is not None:
                heads[rank] = unfinished.index
        clocks = {}
        if self.track:
            clocks = {key: op.group.active_clock or op.group.issue_clock for key, op in self.sends.items()}
        for table in (self.sends, self.recvs):  # an operation and its group refer to each other: let them go
            for op in table.values():
                op.group.ops = []
        return JobOutcome(stuck, pending, heads, clocks, list(self.ranks), self.forced)

    def _advance(self, rank: int) -> bool:
        steps = self.steps[rank]
        index = self.cursor[rank]
        if index >= len(steps):
            if not self._all_done(rank):
                self.waits[rank] = "its sends to complete"
            return False
        step = steps[index]
        if step.meta_type.is_comm:
            return self._communicate(rank, index, step)
        if step.meta_type.is_compute:
            return self._compute(rank, step)
        self.cursor[rank] += 1  # steps the model does not know (FSDP, swap...) take no part
        return True

    # ------------------------------------------------------------------ compute
    def _compute(self, rank: int, step: MetaStep) -> bool:
        consumed: list[_Op] = []
        for part in step.parts:
            for key in consumes(part, self.num_stages):
                if not self._available(rank, key, consumed):
                    self.waits[rank] = (rank, key)
                    return False
        for op in consumed:
            self._merge(rank, op)
        for part in step.parts:
            for key in produces(part):
                self.made[rank].add(key)
                self.made_anywhere.add(key)
        self.computed[rank] += 1
        self.clock[rank][self.position[rank]] = self.computed[rank]
        self.snapshot[rank] = None
        self.cursor[rank] += 1
        return True

    def _available(self, rank: int, key: DataKey, consumed: list[_Op]) -> bool:
        owner = self.stage_to_rank[key[1]]
        if owner == rank or not self.lowered:
            return key in (self.made[rank] if owner == rank else self.made_anywhere)
        op = self.recvs.get((rank, key))
        if op is None or not op.done:
            return False
        consumed.append(op)
        return True

    def _wait_text(self, wait: str | tuple) -> str:
        """What a stuck rank waits for, from the final state of the run (the last attempt of every
        stuck rank saw that state: the run ends after a round in which no rank moved)."""
        if isinstance(wait, str):
            return wait
        if len(wait) == 1:
            return self._op_wait(wait[0])
        rank, key = wait
        owner = self.stage_to_rank[key[1]]
        if owner == rank or not self.lowered:
            return f"{producer_text(key)} on rank {owner}"
        state = "a completed" if self.recvs.get((rank, key)) is not None else "a"
        return f"{state} receive of {producer_text(key)} from rank {owner}"

    # ------------------------------------------------------------------ communication
    def _communicate(self, rank: int, index: int, step: MetaStep) -> bool:
        if self.issued.get(rank) != index:
            self._issue(rank, index, step)
            self.issued[rank] = index
        blocking = self.blocking.get(rank, [])
        for op in blocking:
            if not op.done:
                self.waits[rank] = (op,)
                return False
        for op in blocking:
            self._merge(rank, op)
        self.blocking.pop(rank, None)
        del self.issued[rank]
        self.cursor[rank] += 1
        return True

    def _issue(self, rank: int, index: int, step: MetaStep) -> None:
        clock = _NO_CLOCK
        if self.track:
            clock = self.snapshot[rank]
            if clock is None:
                clock = self.snapshot[rank] = tuple(self.clock[rank])
        group = _Group(rank, index, clock)
        for part in step.comm_parts:
            key = message_key(part)
            if key is None:
                raise ValueError(f"{part} carries no message")
            if (rank, key) in self.preposted:
                continue
            op = _Op(key, part.meta_type.is_send, part, group)
            group.ops.append(op)
            if op.is_send:
                self.sends[key] = op
            else:
                self.recvs[(rank, key)] = op
        group.remaining = len(group.ops)
        if step.meta_type.is_meta:  # the metadata channel: eager, outside the groups
            self.blocking[rank] = [op for op in group.ops if not op.is_send]
            self._activate_eager(group)
            return
        self.queue[rank].append(group)
        self.blocking[rank] = [op for op in group.ops if not op.is_send and self.wait_at_post]
        if self.stream:
            self._activate_stream(rank)
        else:
            self._activate_eager(group)

    def _force_posts(self) -> bool:
        """Stuck: move receives that active sends wait for into their rank's first unfinished group."""
        moved = False
        for rank in self.ranks:
            # (stream) groups complete in order and only the first unfinished one is active: the
            # groups before ``head`` completed, and once an unfinished group is inactive so are all
            # after it (also after a post below completed some and activated the next)
            queue = self.queue[rank]
            k = self.head[rank]
            while k < len(queue):
                group = queue[k]
                k += 1
                if not group.remaining:
                    continue
                if not group.active:
                    break
                for op in list(group.ops):
                    if op.is_send and not op.done:
                        moved |= self._prepost(op)
        return moved

    def _prepost(self, send: _Op) -> bool:
        peer = self.stage_to_rank[consumer_stage(send.key)]
        queue = self.queue.get(peer, ())  # a rank may have no list
        k = self.head.get(peer, 0)  # the groups before it completed
        while k < len(queue) and not queue[k].remaining:
            k += 1
        head = queue[k] if k < len(queue) else None
        if head is None or not head.active:
            return False
        recv = self.recvs.get((peer, send.key))
        if recv is None:
            for step in self.steps[peer][self.cursor[peer]:]:
                part = next((p for p in step.comm_parts if message_key(p) == send.key), None)
                if part is not None:
                    break
            else:
                return False
            recv = _Op(send.key, False, part, head)
            self.recvs[(peer, send.key)] = recv
            self.preposted.add((peer, send.key))
        elif recv.group is head or recv.done:
            return False
        else:
            recv.group.ops.remove(recv)
            recv.group.remaining -= 1
            recv.group = head
        head.ops.append(recv)
        head.remaining += 1
        self.forced.append((peer, recv.step, head.index))
        both = _joined(head.active_clock or head.issue_clock, send.group.active_clock) if self.track else None
        for finished in (send, recv):
            if self._complete(finished, both):
                self._activate_stream(finished.group.rank)
        return True

    def _counterpart(self, op: _Op) -> _Op | None:
        if op.is_send:
            return self.recvs.get((self.stage_to_rank[consumer_stage(op.key)], op.key))
        return self.sends.get(op.key)

    def _activate_eager(self, group: _Group) -> None:
        """Eager: sends complete at once; a receive completes once its send was issued."""
        group.active = True
        group.active_clock = group.issue_clock
        for op in group.ops:
            if op.is_send:
                self._complete(op, group.issue_clock)
                recv = self._counterpart(op)
                if recv is not None:
                    self._complete(recv, group.issue_clock)
            else:
                send = self._counterpart(op)
                if send is not None:
                    self._complete(op, send.group.issue_clock)

    def _activate_stream(self, rank: int) -> None:
        """Activate the first unfinished group of ``rank``, cascading to the peers."""
        pending = [rank]
        while pending:
            r = pending.pop()
            queue = self.queue[r]
            previous = None
            while self.head[r] < len(queue) and queue[self.head[r]].remaining == 0:
                previous = queue[self.head[r]]
                self.head[r] += 1
            if self.head[r] >= len(queue) or queue[self.head[r]].active:
                continue
            group = queue[self.head[r]]
            if previous is None and self.head[r] > 0:
                previous = queue[self.head[r] - 1]
            group.active = True
            group.active_clock = group.issue_clock
            if self.track and previous is not None:
                group.active_clock = _joined(group.issue_clock, previous.done_clock)
            for op in group.ops:
                other = self._counterpart(op)
                if other is not None and other.group.active and not op.done:
                    both = _joined(group.active_clock, other.group.active_clock) if self.track else None
                    for finished in (op, other):
                        if self._complete(finished, both):
                            pending.append(finished.group.rank)
            if group.remaining == 0:
                pending.append(r)

    def _complete(self, op: _Op, clock: Clock | None) -> bool:
        """Mark ``op`` done; True when that completed its group."""
        if op.done:
            return False
        op.done = True
        op.done_clock = clock
        group = op.group
        group.remaining -= 1
        if self.track and clock is not None:
            group.done_clock = clock if group.done_clock is None else _joined(group.done_clock, clock)
        return group.remaining == 0

    def _all_done(self, rank: int) -> bool:
        # a completed group stays completed (a receive moved by ``force_posts`` joins an unfinished one)
        queue = self.queue[rank]
        k = self.done_upto[rank]
        while k < len(queue) and queue[k].remaining == 0:
            k += 1
        self.done_upto[rank] = k
        return k == len(queue)

    def _merge(self, rank: int, op: _Op) -> None:
        if self.track:
            if op.done_clock is not None:
                _max_into(self.clock[rank], op.done_clock)
                self.snapshot[rank] = None

    def _op_wait(self, op: _Op) -> str:
        other = self._counterpart(op)
        peer = self.stage_to_rank[op.key[1]]
        if not op.group.active:
            return f"an earlier group of operations on this rank to complete before {op.step}"
        if other is None:
            return f"{_send_text(op.key)} on rank {peer}"
        return f"{_send_text(op.key)} on rank {peer}, which waits behind an earlier group of operations there"


def _send_text(key: DataKey) -> str:
    kind, stage, micro = key
    code = {"F": "SEND_F", "M": "SEND_META", "G": "SEND_B"}[kind]
    return f"{code}.s{stage}.m{micro}"


def producer_text(key: DataKey) -> str:
    """The step(s) that make a value, for messages: ``F.s0.m1`` or ``B.s2.m0 or I.s2.m0``."""
    kind, stage, micro = key
    if kind == "F":
        return f"F.s{stage}.m{micro}"
    if kind == "M":
        return f"the shapes of F.s{stage}.m{micro}"
    return f"B.s{stage}.m{micro} or I.s{stage}.m{micro}"


_PROOFS: list[tuple[dict[int, tuple[MetaStep, ...]], dict[int, int], str]] = []
_PROOFS_KEPT = 2
_PROOFS_LOCK = threading.Lock()


def note_finished(schedule: Schedule, stage_to_rank: dict[int, int], model: str) -> None:
    """Remember that a run of ``model`` over these very lists finished (lowering's last run), so
    that validation of the same lists need not run the job again (see ``known_to_finish``)."""
    entry = ({rank: tuple(steps) for rank, steps in schedule.items()}, dict(stage_to_rank), model)
    with _PROOFS_LOCK:
        _PROOFS.append(entry)
        del _PROOFS[:-_PROOFS_KEPT]


def known_to_finish(schedule: Schedule, stage_to_rank: dict[int, int], model: str) -> bool:
    """Whether a remembered run finished on lists equal to these, in ``model`` or in ``"stream"``.

    The job model is deterministic and reads nothing but the lists and the placement, so equal
    lists give the same outcome. A finished ``"stream"`` run also proves ``"eager"``: every
    condition under which the stream model lets a step proceed or an operation complete (both
    groups active, hence both issued) implies the eager condition (the send issued), and no
    condition is ever withdrawn once it holds, so the eager run gets at least as far."""
    with _PROOFS_LOCK:
        proofs = list(_PROOFS)
    for lists, placement, proven in reversed(proofs):
        if proven not in (model, "stream") or placement != stage_to_rank or lists.keys() != schedule.keys():
            continue
        if all(lists[rank] == tuple(steps) for rank, steps in schedule.items()):  # identical steps: C speed
            return True
    return False


def run_job(
    schedule: Schedule,
    stage_to_rank: dict[int, int],
    *,
    lowered: bool = True,
    model: str = "eager",
    wait_at_post: bool = False,
    track_clocks: bool = False,
    force_posts: bool = False,
) -> JobOutcome:
    """Run the model once (see :class:`JobModel`)."""
    return JobModel(
        schedule, stage_to_rank, lowered=lowered, model=model, wait_at_post=wait_at_post,
        track_clocks=track_clocks, force_posts=force_posts,
    ).run()


