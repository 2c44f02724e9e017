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
from bisect import bisect_left
from dataclasses import dataclass, field

from hyper_parallel.core.pipeline_parallel.ir.steps import (
    DataKey,
    MetaStep,
    MetaStepType,
    Schedule,
    consumer_stage,
    consumes,
    message_key,
    produces,
)

MODELS = ("eager", "stream")
Clock = tuple[int, ...]
"""A vector clock, never changed once made: groups and operations share them (a run of a large job
holds millions, one entry per rank each); only a rank's own running clock is a list."""
_NO_CLOCK: Clock = ()  # groups' clocks when the run does not track them (never read then)
_NO_OPS: list = []  # a communication step that waits for none of its operations (never changed)
# step kinds as sets hashed in C: the model reads a step's kind several times per step, millions in all
_COMM_KINDS = frozenset(kind for kind in MetaStepType if kind.is_comm)
_COMPUTE_KINDS = frozenset(kind for kind in MetaStepType if kind.is_compute)
_SINGLE_PARTS = frozenset(kind for kind in _COMPUTE_KINDS if not kind.is_overlap)  # a step that is its only part
_SEND_KINDS = frozenset(kind for kind in MetaStepType if kind.is_send)
_META_KINDS = frozenset(kind for kind in MetaStepType if kind.is_meta)


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
        self.carriers: dict[int, dict[DataKey, tuple[list[int], list[MetaStep]]]] = {}  # see _next_carrier

    # ------------------------------------------------------------------ driver
    def run(self) -> JobOutcome:
        progress = True
        while progress:
            progress = False
            for rank in self.ranks:
                if self._advance(rank):
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
        """Run ``rank``'s steps until one cannot go on (noting what it waits for); True when it moved."""
        steps = self.steps[rank]
        end = len(steps)
        start = index = self.cursor[rank]
        while index < end:
            step = steps[index]
            kind = step.meta_type
            if kind in _COMM_KINDS:
                if not self._communicate(rank, index, step):
                    break
            elif kind in _COMPUTE_KINDS:
                if not self._compute(rank, step):
                    break
            index += 1  # steps the model does not know (FSDP, swap...) take no part
        else:
            if not self._all_done(rank):
                self.waits[rank] = "its sends to complete"
        self.cursor[rank] = index
        return index > start

    # ------------------------------------------------------------------ compute
    def _compute(self, rank: int, step: MetaStep) -> bool:
        """Run a compute step whose inputs all exist; else note the first missing one."""
        parts = (step,) if step.meta_type in _SINGLE_PARTS else step.parts
        consumed: list[_Op] = []
        made = self.made[rank]
        for part in parts:
            for key in consumes(part, self.num_stages):
                # an input exists: made on this rank (anywhere, in a compute-only list), else its receive
                # completed; in line, not a method call: two to three inputs per step, millions of steps
                owner = self.stage_to_rank[key[1]]
                if owner == rank or not self.lowered:
                    ready = key in (made if owner == rank else self.made_anywhere)
                else:
                    op = self.recvs.get((rank, key))
                    ready = op is not None and op.done
                    if ready:
                        consumed.append(op)
                if not ready:
                    self.waits[rank] = (rank, key)
                    return False
        made_anywhere = None if self.lowered else self.made_anywhere  # read only for compute-only lists
        for part in parts:
            for key in produces(part):
                made.add(key)
                if made_anywhere is not None:
                    made_anywhere.add(key)
        if self.track:
            clock = self.clock[rank]
            for op in consumed:
                if op.done_clock is not None:
                    _max_into(clock, op.done_clock)
            self.computed[rank] += 1
            clock[self.position[rank]] = self.computed[rank]
            self.snapshot[rank] = None
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
        """Issue the step's operations (once) and wait for those it blocks on; True when done waiting."""
        if self.issued.get(rank) == index:
            blocking = self.blocking[rank]
        else:
            blocking = self._issue(rank, index, step)
            if not blocking:
                return True
            self.issued[rank] = index
            self.blocking[rank] = blocking
        for op in blocking:
            if not op.done:
                self.waits[rank] = (op,)
                return False
        for op in blocking:
            self._merge(rank, op)
        del self.blocking[rank], self.issued[rank]
        return True

    def _issue(self, rank: int, index: int, step: MetaStep) -> list[_Op]:
        """Issue the operations of a communication step as one group; the receives it waits for."""
        clock = _NO_CLOCK
        if self.track:
            clock = self.snapshot[rank]
            if clock is None:
                clock = self.snapshot[rank] = tuple(self.clock[rank])
        group = _Group(rank, index, clock)
        ops = group.ops
        sends, recvs, preposted = self.sends, self.recvs, self.preposted
        for part in step.comm_parts:
            key = message_key(part)
            if key is None:
                raise ValueError(f"{part} carries no message")
            if preposted and (rank, key) in preposted:
                continue
            is_send = part.meta_type in _SEND_KINDS
            op = _Op(key, is_send, part, group)
            ops.append(op)
            if is_send:
                sends[key] = op
            else:
                recvs[(rank, key)] = op
        group.remaining = len(ops)
        if step.meta_type in _META_KINDS:  # the metadata channel: eager, outside the groups
            blocking = [op for op in ops if not op.is_send]
            self._activate_eager(group)
            return blocking
        self.queue[rank].append(group)
        blocking = [op for op in ops if not op.is_send] if self.wait_at_post else _NO_OPS
        if self.stream:
            self._activate_stream(rank)
        else:
            self._activate_eager(group)
        return blocking

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
            part = self._next_carrier(peer, send.key)
            if part is None:
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

    def _next_carrier(self, rank: int, key: DataKey) -> MetaStep | None:
        """The first operation carrying ``key`` in the steps of ``rank`` from its cursor on (the first
        such step, its first such operation), found by bisection in an index of the rank's list made
        on the first question about that rank (a scan per forced post would be quadratic)."""
        index = self.carriers.get(rank)
        if index is None:
            index = self.carriers[rank] = _carriers(self.steps[rank])
        places = index.get(key)
        if places is None:
            return None
        positions, parts = places
        k = bisect_left(positions, self.cursor[rank])
        return parts[k] if k < len(positions) else None

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
        queues, heads, track = self.queue, self.head, self.track
        while pending:
            r = pending.pop()
            queue = queues[r]
            end = len(queue)
            h = heads[r]
            previous = None
            while h < end and queue[h].remaining == 0:
                previous = queue[h]
                h += 1
            heads[r] = h
            if h >= end or queue[h].active:
                continue
            group = queue[h]
            if previous is None and h > 0:
                previous = queue[h - 1]
            group.active = True
            group.active_clock = group.issue_clock
            if track and previous is not None:
                group.active_clock = _joined(group.issue_clock, previous.done_clock)
            for op in group.ops:
                # _counterpart, written out (the activation of every group of the job runs this)
                if op.is_send:
                    other = self.recvs.get((self.stage_to_rank[consumer_stage(op.key)], op.key))
                else:
                    other = self.sends.get(op.key)
                if other is not None and other.group.active and not op.done:
                    both = _joined(group.active_clock, other.group.active_clock) if track else None
                    if self._complete(op, both):
                        pending.append(op.group.rank)
                    if self._complete(other, both):
                        pending.append(other.group.rank)
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


def _carriers(steps: list[MetaStep]) -> dict[DataKey, tuple[list[int], list[MetaStep]]]:
    """message key -> (the indices of the steps with an operation carrying it, in order; the first
    such operation of each of these steps)."""
    index: dict[DataKey, tuple[list[int], list[MetaStep]]] = {}
    for position, step in enumerate(steps):
        for part in step.comm_parts:
            key = message_key(part)
            if key is None:
                continue
            places = index.get(key)
            if places is None:
                index[key] = ([position], [part])
            elif places[0][-1] != position:  # the first operation of a step counts
                places[0].append(position)
                places[1].append(part)
    return index


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


