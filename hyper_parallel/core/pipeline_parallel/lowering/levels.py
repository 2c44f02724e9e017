"""Batch lowering by levels: free of deadlock on NCCL/HCCL's stream engine by construction.

*Levels* number the compute steps of the job so that they grow along each rank's list by at
least one, and from a step to a step of another rank that consumes what it made by at least two
(``Flow.run(levels=True)``: the smallest such numbers, linear in the job). A value consumed on
another rank by a step of level ``c`` travels at *boundary* ``c - 1``, which lies above its
maker's level: the sender's send and the receiver's receive both go into a ``BATCH`` of that
boundary. A rank's boundaries come in order, each before the rank's first compute step of its
level or higher and after the others (so a receive comes before its consumer, a send after its
maker, and where the rank computes at level ``c - 1`` the receive is posted before that step:
it overlaps it). The boundaries between two compute steps of a rank share one batch, except that
a batch starts at a boundary whose receives wait for shapes: for a forward value whose shapes
travel first, the sender's ``SEND_META`` goes at the value's boundary ahead of the rank's waits
for shapes of that boundary, and the receiver's ``RECV_META`` right before the batch.

Why no rank can hang on the stream engine (a rank's batches run in order; a send completes
when its receive is posted; a ``RECV_META`` waits for its ``SEND_META``), and so on the eager one:
by induction on the boundary ``t``. Suppose every compute step of a level below ``t`` ran,
every batch whose boundaries all lie below ``t`` completed and every batch whose first boundary
is below ``t`` is active. A rank's list before its batch holding boundary ``t`` holds compute
steps of levels below ``t``, batches (which do not hold the rank up) and waits for shapes of
boundaries up to ``t``, whose ``SEND_META``s come before any wait of their rank at that boundary:
so every rank issues its ``SEND_META``s of ``t``, passes its waits and posts its batch holding
``t``, which is active (the batches before it completed). Every operation of boundary ``t`` meets
its counterpart, in the peer's batch holding ``t``: they all complete, and so do the batches
whose last boundary is ``t``. Every compute step of level ``t`` then has its inputs (received at
boundaries up to ``t - 1``) and runs. Each rank checks that its own list has this shape
(``rank_checks.check_levels_list``); together the ranks' checks cover the job.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from itertools import chain, compress, islice, repeat, starmap
from operator import add, eq, itemgetter, mul, ne, or_, sub

from hyper_parallel.core.pipeline_parallel.ir.steps import (
    DataKey,
    MetaStep,
    MetaStepType,
    Schedule,
    consumer_stage,
    unchecked_step,
)
from hyper_parallel.core.pipeline_parallel.lowering.flow import Flow, flow_of

_T = MetaStepType
_BATCH = _T.BATCH_SEND_RECV
_KIND, _STAGE = itemgetter(0), itemgetter(1)  # of a value
_FIRST = itemgetter(0)  # of what a step makes: its first value, whose level is the step's


def lower_by_levels(compute: Schedule, stage_to_rank: dict[int, int], metadata: str) -> dict[int, list[MetaStep]] | None:
    """Every rank's batch lists, or None where the compute lists hold something
    the flow does not model or cannot finish (lowering them the old way lets validation say what)."""
    micros = [step.micro_index for steps in compute.values() for step in steps if step is not None]
    num_micro = max((i for i in micros if type(i) is int), default=-1) + 1
    flow = flow_of(compute, stage_to_rank, num_micro, "none", False)
    if flow is None:
        return None
    numbers: dict[int, list[int]] = {}
    level = flow.run(None, levels=True, numbers=numbers)
    if level is None:
        return None
    bounds = Boundaries(flow, level, numbers)  # each channel's boundaries once, for both its ends
    return {rank: rank_list(flow, rank, level, metadata, bounds) for rank in sorted(flow.items)}


class Boundaries:
    """When the values of each channel travel, worked out once per channel when first asked for (by
    the levels of the steps that consume them: a value travels at the boundary one below), and the
    values of a channel whose shapes travel ahead of them with ``"first"``."""

    def __init__(self, flow: Flow, level: dict[DataKey, int], numbers: dict[int, list[int]] | None = None) -> None:
        """``numbers``: what ``flow.run`` put there in the run that returned ``level``, where known."""
        self.flow, self.level = flow, level
        self._levels: dict[int, list[int]] = dict(numbers or {})
        self._due: dict[tuple[int, int], list[int]] = {}
        self._first: dict[tuple[int, int], list[int]] = {}
        self._plain: dict[tuple[int, int], bool] = {}

    def levels(self, rank: int) -> list[int]:
        """The levels of ``rank``'s compute steps, in its order."""
        out = self._levels.get(rank)
        if out is None:
            out = self._levels[rank] = list(map(self.level.__getitem__, map(_FIRST, self.flow.makes[rank])))
        return out

    def due(self, channel: tuple[int, int]) -> list[int]:
        """For each value of ``flow.channels[channel]``, in its order, the level of the step of the
        receiver that consumes it: the value's ``boundary`` plus one."""
        out = self._due.get(channel)
        if out is None:
            consumer = self.levels(channel[1]).__getitem__
            out = self._due[channel] = list(map(consumer, map(self.flow.natural.__getitem__, self.flow.channels[channel])))
        return out

    def plain(self, channel: tuple[int, int]) -> bool:
        """Whether the stage of every value of the channel is a plain int (micro-batches always are,
        ``flow.read_flow``): then the steps that carry them need none of MetaStep's checks."""
        out = self._plain.get(channel)
        if out is None:
            out = self._plain[channel] = set(map(type, map(_STAGE, self.flow.channels[channel]))) <= {int}
        return out

    def first(self, channel: tuple[int, int]) -> list[int]:
        """The places in the channel of the forward values that travel first of their stage (the
        first sent of those), in order."""
        out = self._first.get(channel)
        if out is None:
            keys, due = self.flow.channels[channel], self.due(channel)
            places = list(compress(range(len(keys)), map(eq, map(_KIND, keys), repeat("F"))))
            # by due, the latest first, and among equal dues the last sent first: for each stage, the
            # place written last is the first sent of those that travel first
            places = sorted(reversed(places), key=due.__getitem__, reverse=True)
            out = self._first[channel] = sorted(dict(zip(map(_STAGE, map(keys.__getitem__, places)), places)).values())
        return out


def _channels_of(flow: Flow, rank: int) -> list[tuple[int, int]]:
    return [channel for channel in flow.channels if rank in channel]


def carried(flow: Flow, level: dict[DataKey, int], metadata: str, rank: int) -> set[DataKey]:
    """Forward values to or from ``rank`` whose shapes travel ahead of them: the first *sent* of each
    stage boundary (``"first"``: the receiver makes every later buffer of that boundary from those
    shapes, so no data receive of it may come before them) or every one (``"all"``)."""
    out: set[DataKey] = set()
    if metadata == "none":
        return out
    if metadata == "all":
        for channel in _channels_of(flow, rank):
            out.update(key for key in flow.channels[channel] if key[0] == "F")
        return out
    bounds = Boundaries(flow, level)
    for channel in _channels_of(flow, rank):
        out.update(map(flow.channels[channel].__getitem__, bounds.first(channel)))
    return out


def send_step(key: DataKey) -> MetaStep:
    kind, stage, micro = key
    return MetaStep(micro, _T.FWD_SEND if kind == "F" else _T.BWD_SEND, stage)


def recv_step(key: DataKey) -> MetaStep:
    kind, stage, micro = key
    return MetaStep(micro, _T.FWD_RECV, stage + 1) if kind == "F" else MetaStep(micro, _T.BWD_RECV, stage - 1)


def consumer_rank(flow: Flow, key: DataKey) -> int | None:
    """The rank that consumes a value (None for a stage's own weight-gradient mark, or past the ends)."""
    return flow.stage_to_rank.get(consumer_stage(key)) if key[0] in ("F", "G") else None


def boundary(flow: Flow, level: dict[DataKey, int], key: DataKey) -> int:
    """The boundary a value travels at: one level before the step that consumes it (levels put
    that step at least two above the value's maker, so the boundary lies after the making)."""
    consumer = consumer_rank(flow, key)
    return level[flow.makes[consumer][flow.natural[key]][0]] - 1


def rank_list(flow: Flow, rank: int, level: dict[DataKey, int], metadata: str,
              bounds: Boundaries | None = None) -> list[MetaStep]:
    """``rank``'s lowered list (see the module docstring); ``bounds``: the job's, shared by the ranks.

    Written for speed (a large job lowers millions of operations): boundaries are handled as the
    levels of the consuming steps (``Boundaries.due``, one above), and the steps are made and ordered
    by whole lists at a time rather than one by one."""
    bounds = bounds or Boundaries(flow, level)
    mine = _channels_of(flow, rank)
    if not all(map(bounds.plain, mine)):
        return _checked_rank_list(flow, rank, level, metadata)  # the steps need MetaStep's checks
    items, channels = flow.items[rank], flow.channels
    # the data operations: the sends in making order, then the receives by sender and FIFO place
    when: dict[DataKey, int] = {}  # value sent -> its due
    for channel in mine:
        if channel[0] == rank:
            when.update(zip(channels[channel], bounds.due(channel)))
    sent = list(filter(when.__contains__, chain.from_iterable(flow.makes[rank])))
    dues = list(map(when.__getitem__, sent))
    ops = list(starmap(_send, sent))
    incoming = sorted(channel for channel in mine if channel[1] == rank)
    for channel in incoming:
        ops += starmap(_recv, channels[channel])
        dues += bounds.due(channel)
    # by boundary (a stable sort: within one, sends first, in the order above)
    ops = tuple(map(ops.__getitem__, sorted(range(len(dues)), key=dues.__getitem__)))
    dues.sort()
    # each boundary's first operation, and the gap it goes to: before the rank's first step of its level or higher
    firsts = [0, *compress(range(1, len(dues)), map(ne, islice(dues, 1, None), dues))] if dues else []
    bound = list(map(dues.__getitem__, firsts))
    gaps = list(map(bisect_left, repeat(bounds.levels(rank)), map(sub, bound, repeat(1))))
    metas, waited = _metas(flow, rank, metadata, bounds, mine, incoming, sent, when)
    # the boundaries of one gap share a batch, but for shapes to wait for: a boundary whose shapes
    # this rank waits for starts a batch
    changes = map(ne, gaps, [None, *gaps])
    starts = list(compress(range(len(bound)), map(or_, changes, map(waited.__contains__, bound)) if waited else changes))
    begins = list(map(firsts.__getitem__, starts))
    batches = list(map(unchecked_step, repeat(None), repeat(_BATCH), repeat(None),
                       map(ops.__getitem__, map(slice, begins, [*islice(begins, 1, None), len(ops)]))))
    # each gap before its step, the batches of a gap in order, each after the shapes of its boundaries
    # (SEND_METAs first): a stable sort with step k at (2k + 1) * n, batch b of gap g at 2gn + 2b + 1
    # and its shapes at 2gn + 2b
    n = 2 * len(batches) + 2
    where = list(map(mul, map(gaps.__getitem__, starts), repeat(2 * n)))
    steps = [*items, *batches]
    keys = [*range(n, (2 * len(items) + 1) * n, 2 * n), *map(add, where, range(1, 2 * len(batches), 2))]
    for t, step in metas:
        batch = bisect_right(starts, bisect_left(bound, t)) - 1
        steps.append(step)
        keys.append(where[batch] + 2 * batch)
    return list(map(steps.__getitem__, sorted(range(len(steps)), key=keys.__getitem__)))


def _send(kind: str, stage: int, micro: int) -> MetaStep:
    """``send_step((kind, stage, micro))`` without MetaStep's checks (plain ints)."""
    return unchecked_step(micro, _T.FWD_SEND if kind == "F" else _T.BWD_SEND, stage)


def _recv(kind: str, stage: int, micro: int) -> MetaStep:
    """``recv_step((kind, stage, micro))`` without MetaStep's checks (plain ints)."""
    if kind == "F":
        return unchecked_step(micro, _T.FWD_RECV, stage + 1)
    return unchecked_step(micro, _T.BWD_RECV, stage - 1)


def _metas(flow: Flow, rank: int, metadata: str, bounds: Boundaries, mine: list[tuple[int, int]],
           incoming: list[tuple[int, int]], sent: list[DataKey], when: dict[DataKey, int]
           ) -> tuple[list[tuple[int, MetaStep]], set[int]]:
    """The rank's SEND_METAs and RECV_METAs with their dues, by due (within one, the sends in making
    order, then the receives by sender and FIFO place), and the dues of the receives."""
    if metadata == "none":
        return [], set()
    if metadata == "all":
        shaped = list(compress(sent, map(eq, map(_KIND, sent), repeat("F"))))
    else:
        first = {flow.channels[channel][place] for channel in mine for place in bounds.first(channel)}
        shaped = list(filter(first.__contains__, sent))
    metas = [(when[key], 0, MetaStep(key[2], _T.META_SEND, key[1])) for key in shaped]
    waited: set[int] = set()
    for channel in incoming:
        keys, due = flow.channels[channel], bounds.due(channel)
        if metadata == "all":
            places = compress(range(len(keys)), map(eq, map(_KIND, keys), repeat("F")))
        else:
            places = bounds.first(channel)
        for p in places:
            metas.append((due[p], 1, MetaStep(keys[p][2], _T.META_RECV, keys[p][1] + 1)))
            waited.add(due[p])
    metas.sort(key=itemgetter(0, 1))
    return [(t, step) for t, _, step in metas], waited


def _checked_rank_list(flow: Flow, rank: int, level: dict[DataKey, int], metadata: str) -> list[MetaStep]:
    """``rank_list`` as it was first written (lowering/levels.py at cd39060), for values whose stage
    is not a plain int: its steps go through MetaStep's checks, in the same order, so that what they
    refuse raises the same error."""
    items = flow.items[rank]
    shapes = carried(flow, level, metadata, rank)
    levels = [level[flow.makes[rank][k][0]] for k in range(len(items))]
    sends: dict[int, list[MetaStep]] = defaultdict(list)  # boundary -> data sends
    meta_sends: dict[int, list[MetaStep]] = defaultdict(list)  # boundary -> SEND_METAs
    for k, makes in enumerate(flow.makes[rank]):
        for key in makes:
            peer = consumer_rank(flow, key)
            if peer is None or peer == rank:
                continue
            t = boundary(flow, level, key)
            if key in shapes:
                meta_sends[t].append(MetaStep(key[2], _T.META_SEND, key[1]))
            sends[t].append(send_step(key))
    recvs: dict[int, list[tuple[int, int, DataKey]]] = defaultdict(list)  # boundary -> (peer, FIFO place, value)
    for peer in sorted({flow.stage_to_rank[s] for s in flow.stage_to_rank} - {rank}):
        for place, key in enumerate(flow.channels.get((peer, rank), ())):
            recvs[boundary(flow, level, key)].append((peer, place, key))
    # the boundaries of each gap (gap g lies before step g): those above the level of step g - 1
    gaps: list[list[int]] = [[] for _ in range(len(items) + 1)]
    g = 0
    for t in sorted(set(sends) | set(recvs)):
        while g < len(items) and levels[g] < t:
            g += 1
        gaps[g].append(t)
    out: list[MetaStep] = []
    for g in range(len(items) + 1):
        ops: list[MetaStep] = []  # the boundaries of one gap share a batch, but for shapes to wait for
        for t in gaps[g]:
            incoming = sorted(recvs.get(t, ()))
            metas = [MetaStep(key[2], _T.META_RECV, key[1] + 1) for _, _, key in incoming if key in shapes]
            if metas and ops:
                out.append(MetaStep(None, _T.BATCH_SEND_RECV, None, ops))
                ops = []
            out += meta_sends.get(t, [])  # shapes go out before this rank waits for any of this boundary
            out += metas
            ops += [*sends.get(t, ()), *(recv_step(key) for _, _, key in incoming)]
        if ops:
            out.append(MetaStep(None, _T.BATCH_SEND_RECV, None, ops))
        if g < len(items):
            out.append(items[g])
    return out
