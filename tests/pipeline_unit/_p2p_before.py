# ruff: noqa
# The whole-job lowering (p2p.py) as of commit b9d3fc2, before the lowering speed-ups of branch
# lower-speed, kept unchanged as the oracle of test_lowering_speed_equal.py. Do not edit.
"""Lowering: insert the point-to-point steps a compute-only schedule needs.

Conventions (the runtime relies on them):

- ``SEND_F.s<s>.m<i>``: stage s sends its forward output of micro i to stage s + 1;
- ``RECV_F.s<s>.m<i>``: stage s receives its forward input of micro i from stage s - 1;
- ``SEND_META.s<s>.m<i>`` / ``RECV_META.s<s>.m<i>``: the same two stages exchange the shapes,
  dtypes and requires-grad flags of that forward output on the metadata channel (a FIFO channel
  of its own, which never waits for the receiver; see ``Communicator.isend_meta``);
- ``SEND_B.s<s>.m<i>``: stage s sends the gradient of its input of micro i to stage s - 1;
- ``RECV_B.s<s>.m<i>``: stage s receives the gradient of its output of micro i from stage s + 1.

Nothing is inserted between adjacent stages on the same rank. A send goes right after the
compute that produced its data (F for SEND_F, B or I for SEND_B). A receive goes right before
the compute that consumes it (its *natural* place), or, with ``prefetch``, one compute step
earlier wherever the matching send does not depend on that compute step or anything later on
the receiving rank, so the transfer overlaps a compute step. Metadata is exchanged for every
forward message (``metadata="all"``, for ``dyn_shape``), for the first forward message of every
stage boundary (``"first"``: the first run with static shapes) or never (``"none"``); a data
receive that needs its metadata stays at its natural place, since its buffer can only be made
once the shapes arrived.

On every receiving rank the receives from one peer are kept in that peer's send order on each
channel (FIFO matching, as NCCL, HCCL and gloo do): a receive is moved up to the earliest place
of any later receive from the same peer.

Within one gap between two compute steps: metadata sends first; then the data sends, unless a
metadata receive of this gap depends on them, in which case they go before the metadata
receives; then the metadata receives (the runtime waits for them); then the data receives.
With ``transport="batch"`` the data sends and receives issued together form one ``BATCH[...]``
step. NCCL/HCCL run the groups of one rank one after another on one stream and a send there
completes only when its receive is posted, so a receive posted too early can block a later
group its own send needs. With ``prefetch`` (``overlap_p2p``, the default) the batch lists are
made by ``levels.py`` instead of the rules above: each message travels at a boundary both ranks
derive from the same numbering of the compute steps, which proves them free of deadlock and
posts a receive before the compute step ahead of its consumer where the dependences allow.
Without it, lowering checks the result in the job model (``job_model.py``, ``"stream"``) and
posts receives earlier until it finishes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType, Schedule, consumer_stage, consumes, message_key, produces
from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc
from hyper_parallel.core.pipeline_parallel.lowering.job_model import note_finished, run_job
from hyper_parallel.core.pipeline_parallel.lowering.levels import lower_by_levels

TRANSPORTS = ("plain", "batch")
METADATA = ("none", "first", "all")

_T = MetaStepType


def peer_rank(op: MetaStep, stage_to_rank: dict[int, int]) -> int:
    """Rank on the other side of a send/recv step, from the conventions above."""
    if op.stage_index is None or not (op.meta_type.is_send or op.meta_type.is_recv):
        raise ValueError(f"{op} is not a send/recv step with a stage")
    peer_stage = op.stage_index + (1 if op.meta_type.towards_next else -1)
    if peer_stage not in stage_to_rank:
        raise ValueError(f"{op} has no peer: stage {peer_stage} does not exist")
    return stage_to_rank[peer_stage]


_PAIRS = {
    _T.FWD_SEND: (_T.FWD_RECV, 1),
    _T.FWD_RECV: (_T.FWD_SEND, -1),
    _T.META_SEND: (_T.META_RECV, 1),
    _T.META_RECV: (_T.META_SEND, -1),
    _T.BWD_SEND: (_T.BWD_RECV, -1),
    _T.BWD_RECV: (_T.BWD_SEND, 1),
}


def counterpart(op: MetaStep) -> MetaStep:
    """The step on the peer that matches a send/recv: SEND_F.s<s> <-> RECV_F.s<s+1>,
    SEND_META.s<s> <-> RECV_META.s<s+1>, SEND_B.s<s> <-> RECV_B.s<s-1> (same micro-batch)."""
    if op.stage_index is None:
        raise ValueError(f"{op} has no stage")
    if op.meta_type not in _PAIRS:
        raise ValueError(f"{op} is not a send/recv step")
    kind, shift = _PAIRS[op.meta_type]
    return MetaStep(op.micro_index, kind, op.stage_index + shift)


@dataclass(eq=False, slots=True)
class _Recv:
    peer: int
    natural_gap: int
    step: MetaStep
    needs_meta: bool = False  # a data receive whose shapes come in a RECV_META of this run
    wanted_gap: int = -1  # natural_gap, or earlier when prefetched or repaired
    depends_on: int = -2  # last compute step of this rank its send depends on (-2: unknown, assume its gap)
    before_meta: bool = False  # posted before the metadata receives of its gap
    fifo_index: float = float("inf")
    gap: int = -1


@dataclass
class _FifoPlan:
    """A rank's receives by FIFO channel (peer, data or metadata), each in its sender's order, and
    its data / metadata receives with the data message each belongs to."""

    data_channels: list[list[_Recv]]
    meta_channels: list[list[_Recv]]
    data_recvs: list[tuple[DataKey, _Recv]]
    meta_recvs: list[tuple[DataKey, _Recv]]


@dataclass
class _RankPlan:
    items: list[MetaStep]
    sends: dict[int, list[tuple[int, MetaStep]]] = field(default_factory=lambda: defaultdict(list))
    recvs: list[_Recv] = field(default_factory=list)
    sends_first: set[int] = field(default_factory=set)  # gaps whose data sends precede their RECV_METAs
    eager: bool = False  # sends never wait for their receive (the plain transport): always first
    fifo: _FifoPlan | None = None  # set once by _number_fifo
    # gap -> (what its steps depend on, the steps) from the last assembly: lowering assembles a
    # rank many times and moves few receives in between
    assembled: dict[int, tuple[tuple, list[MetaStep]]] = field(default_factory=dict)


def lower(
    compute: Schedule,
    stage_to_rank: dict[int, int],
    transport: str = "plain",
    *,
    metadata: str = "none",
    prefetch: bool = False,
) -> dict[int, list[MetaStep]]:
    """Insert the send/recv steps (see the module docstring); idle slots are dropped."""
    with paused_gc():
        return _lower(compute, stage_to_rank, transport, metadata, prefetch)


def _lower(compute: Schedule, stage_to_rank: dict[int, int], transport: str, metadata: str,
           prefetch: bool) -> dict[int, list[MetaStep]]:
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; valid transports: {', '.join(TRANSPORTS)}")
    if metadata not in METADATA:
        raise ValueError(f"unknown metadata mode {metadata!r}; valid: {', '.join(METADATA)}")
    if transport == "batch" and prefetch:  # boundaries by levels, free of deadlock by construction (levels.py)
        by_levels = lower_by_levels(compute, stage_to_rank, metadata)
        if by_levels is not None:
            return by_levels
        prefetch = False  # lists that cannot run: lowered without prefetch, for validation to say why
    plans = {r: _plan_rank(r, steps, stage_to_rank) for r, steps in sorted(compute.items())}
    for plan in plans.values():
        plan.eager = transport == "plain"
    _add_metadata(plans, metadata)
    _number_fifo(plans)
    for plan in plans.values():
        for recv in plan.recvs:
            recv.wanted_gap = recv.natural_gap
    if prefetch or metadata != "none":  # what each send depends on, sends never waiting
        _use_dependencies(plans, stage_to_rank, _emit_plain, "eager", prefetch and transport == "plain")
    if transport == "plain":
        return _assemble_all(plans, _emit_plain)
    _uncross(plans)
    finished = _repair(plans, stage_to_rank)
    lowered = _assemble_all(plans, _emit_batch)
    if finished:  # the last run of the repairs ran these lists: validation need not run them again
        note_finished(lowered, stage_to_rank, "stream")
    return lowered


def _repair(plans: dict[int, _RankPlan], stage_to_rank: dict[int, int]) -> bool:
    """Repair for the stream model, fast (the model posts late receives itself) and, where that
    does not finish, one stuck state at a time from the same start. True when the lists as they
    stand were seen to finish in the stream model."""
    start = _placement(plans)
    # a forced run that moved nothing is a plain run of the same lists: its "finished" is the check
    if _repair_for_stream(plans, stage_to_rank, _emit_batch, force=True):
        return True
    if run_job(_assemble_all(plans, _emit_batch), stage_to_rank, model="stream").finished:
        return True
    _restore_placement(plans, start)
    return _repair_for_stream(plans, stage_to_rank, _emit_batch, force=False)


def _placement(plans: dict[int, _RankPlan]) -> list:
    return [([(r.wanted_gap, r.before_meta) for r in plan.recvs], set(plan.sends_first)) for plan in plans.values()]


def _restore_placement(plans: dict[int, _RankPlan], saved: list) -> None:
    for plan, (recvs, sends_first) in zip(plans.values(), saved, strict=True):
        for recv, (gap, before) in zip(plan.recvs, recvs, strict=True):
            recv.wanted_gap, recv.before_meta = gap, before
        plan.sends_first = set(sends_first)


def _check_stage(step: MetaStep, stage_to_rank: dict[int, int]) -> None:
    if step.stage_index not in stage_to_rank:
        raise ValueError(f"step {step}: stage {step.stage_index} is not in stage_to_rank")


def _plan_rank(rank: int, steps: list[MetaStep | None], stage_to_rank: dict[int, int]) -> _RankPlan:
    """Natural places: gap g sits before item g; sends of item g go to gap g + 1."""
    num_stages = len(stage_to_rank)
    plan = _RankPlan(items=[step for step in steps if step is not None])
    for index, step in enumerate(plan.items):
        if step.meta_type.is_comm:
            raise ValueError(f"rank {rank}: {step} is already a communication step; lower compute-only lists")
        for part in step.parts:
            _check_stage(part, stage_to_rank)
            for key in consumes(part, num_stages):
                if stage_to_rank.get(key[1], rank) != rank:
                    kind = _T.FWD_RECV if key[0] == "F" else _T.BWD_RECV
                    recv = MetaStep(part.micro_index, kind, part.stage_index)
                    plan.recvs.append(_Recv(peer_rank(recv, stage_to_rank), index, recv))
            for key in produces(part):
                peer = _consumer_rank(key, stage_to_rank)
                if peer is not None and peer != rank:
                    kind = _T.FWD_SEND if key[0] == "F" else _T.BWD_SEND
                    send = MetaStep(part.micro_index, kind, part.stage_index)
                    plan.sends[index + 1].append((peer, send))
    return plan


def _consumer_rank(key: DataKey, stage_to_rank: dict[int, int]) -> int | None:
    if key[0] not in ("F", "G"):
        return None
    return stage_to_rank.get(consumer_stage(key))


def _add_metadata(plans: dict[int, _RankPlan], metadata: str) -> None:
    """Put a SEND_META before the forward sends that carry shapes, a RECV_META before their receives."""
    if metadata == "none":
        return
    carried: set[DataKey] = set()
    for plan in plans.values():
        first_of_stage: set[int] = set()
        for gap in sorted(plan.sends):
            expanded = []
            for peer, send in plan.sends[gap]:
                stage = send.stage_index
                if send.meta_type is _T.FWD_SEND and (metadata == "all" or stage not in first_of_stage):
                    first_of_stage.add(stage)
                    expanded.append((peer, MetaStep(send.micro_index, _T.META_SEND, stage)))
                    carried.add(message_key(send))
                expanded.append((peer, send))
            plan.sends[gap] = expanded
    for plan in plans.values():
        recvs = []
        for recv in plan.recvs:
            if recv.step.meta_type is _T.FWD_RECV and message_key(recv.step) in carried:
                meta = MetaStep(recv.step.micro_index, _T.META_RECV, recv.step.stage_index)
                recvs.append(_Recv(recv.peer, recv.natural_gap, meta))
                recv.needs_meta = True
            recvs.append(recv)
        plan.recvs = recvs


def _use_dependencies(
    plans: dict[int, _RankPlan], stage_to_rank: dict[int, int], emit: _Emit, model: str, prefetch: bool,
) -> None:
    """Note what each receive's send depends on (in the job model, with the places so far): a gap
    issues its data sends before waiting for metadata that depends on them, and (``prefetch``) a
    receive may go one compute step early where its send does not depend on that step."""
    outcome = run_job(_assemble_all(plans, emit), stage_to_rank, model=model, track_clocks=True)
    if not outcome.finished:
        return  # validation reports the deadlock of the schedule itself
    position = {rank: k for k, rank in enumerate(outcome.ranks)}
    for rank, plan in plans.items():
        for recv in plan.recvs:
            recv.depends_on = outcome.send_clocks[message_key(recv.step)][position[rank]]
            if prefetch and not recv.needs_meta and not recv.step.meta_type.is_meta:
                if recv.natural_gap - 1 > recv.depends_on:
                    recv.wanted_gap = recv.natural_gap - 1


def _uncross(plans: dict[int, _RankPlan]) -> None:
    """Stream model, two ranks at a time: the groups holding their messages must come in the same
    order on both ranks, else each waits for a group the other reaches only after its own. For
    each crossing of two messages: a prefetched receive goes back to its natural place (a
    backward receive before a forward one: forward inputs are the prefetches that pay); else a
    receive is posted earlier, in the group of the other message on its rank."""
    recvs = {(rank, recv.step): recv for rank, plan in plans.items() for recv in plan.recvs}
    # each receive's peer and the very send step it matches (fixed: only the places move); steps are
    # looked up by identity below, hashing a MetaStep millions of times being the cost of a sweep
    send_steps = {(rank, send): send for rank, plan in plans.items() for sends in plan.sends.values()
                  for _, send in sends}
    matches = {(rank, id(recv.step)): (recv.peer, id(send_steps[(recv.peer, counterpart(recv.step))]))
               for (rank, _), recv in recvs.items() if (recv.peer, counterpart(recv.step)) in send_steps}
    pair_keys = sorted({(min(rank, peer), max(rank, peer)) for (rank, _), (peer, _) in matches.items()})
    cache: _GroupCache = {}  # valid within this call: only wanted gaps change here
    where: dict[int, dict[int, tuple[tuple[int, int], MetaStep]]] = {}
    dirty = set(plans)  # ranks whose receives moved: only their positions, and their pairs, change
    for _ in range(sum(len(plan.recvs) for plan in plans.values()) + 1):
        for rank in dirty:
            where[rank] = _rank_group_positions(rank, plans[rank], cache)
        moved: set[int] = set()
        # a fix touches only its pair's receives, so the pairs of one sweep are independent; a pair
        # whose ranks did not move is as the last sweep left it (no fix was possible there)
        for low, high in pair_keys:
            if low not in dirty and high not in dirty:
                continue
            entries = _pair_entries(low, high, where, matches)
            entries.sort(key=lambda e: (e[0][0], e[1][0]))
            furthest = None
            for entry in entries:
                if furthest is not None and entry[1][0] < furthest[1][0] and entry[0][0] > furthest[0][0]:
                    if _fix_crossing(recvs, low, high, furthest, entry):
                        moved |= {low, high}
                        furthest = entry  # the fixed pair no longer holds the line
                        continue
                if furthest is None or entry[1][0] > furthest[1][0]:
                    furthest = entry
        if not moved:
            return
        dirty = moved


_GroupCache = dict[tuple[int, int, tuple[int, ...]], list[list[MetaStep]]]
_Positions = dict[int, dict[int, tuple[tuple[int, int], MetaStep]]]


def _pair_entries(low: int, high: int, where: _Positions, matches: dict) -> list[tuple]:
    """The messages between ranks ``low`` and ``high``, each as (place on low, place on high, its
    operation on low, its operation on high): low's receives first, then high's, in program order."""
    entries = []
    for op_id, (place, op) in where[low].items():
        match = matches.get((low, op_id))
        if match is not None and match[0] == high:
            other_place, other = where[high][match[1]]
            entries.append((place, other_place, op, other))
    for op_id, (place, op) in where[high].items():
        match = matches.get((high, op_id))
        if match is not None and match[0] == low:
            other_place, other = where[low][match[1]]
            entries.append((other_place, place, other, op))
    return entries


def _rank_group_positions(
    rank: int, plan: _RankPlan, cache: _GroupCache
) -> dict[int, tuple[tuple[int, int], MetaStep]]:
    """id of a data operation of ``rank`` -> ((index of its group among the rank's groups, its gap),
    the operation) in the batch lowering of ``plan`` as it stands: what ``_assemble(plan,
    _emit_batch)`` would make, read from the slots without building the steps. ``_uncross`` asks for
    it once per sweep and only moves receives between gaps, so a gap's groups are cached by the
    receives it holds."""
    _place_recvs(plan)
    where: dict[int, tuple[tuple[int, int], MetaStep]] = {}
    recvs_at: dict[int, list[_Recv]] = defaultdict(list)
    for recv in plan.recvs:
        recvs_at[recv.gap].append(recv)
    group = 0
    for gap in range(len(plan.items) + 1):
        here = recvs_at.get(gap, [])
        key = (rank, gap, tuple(id(recv) for recv in here))
        groups = cache.get(key)
        if groups is None:
            sends = [send for _, send in plan.sends.get(gap, ()) if not send.meta_type.is_meta]
            slots, _ = _gap_slots(plan, gap, sends, here)
            groups = cache[key] = [slot for slot in slots if slot]  # one BATCH step per non-empty slot
        for ops in groups:
            place = (group, gap)
            for op in ops:
                where[id(op)] = (place, op)
            group += 1
    return where


def _fix_crossing(recvs: dict, low: int, high: int, first: tuple, second: tuple) -> bool:
    """``first`` is earlier than ``second`` on rank ``low`` but later on rank ``high``."""
    involved = [recvs[(rank, op)] for rank, op in ((low, first[2]), (low, second[2]), (high, first[3]),
                                                     (high, second[3])) if op.meta_type.is_recv]
    early = [r for r in involved if r.wanted_gap < r.natural_gap]
    if early:
        early.sort(key=lambda r: (r.step.meta_type is not _T.BWD_RECV, -r.peer))
        early[0].wanted_gap = early[0].natural_gap
        return True
    moves = []
    if second[2].meta_type.is_recv:  # on rank low, post second's receive with first's group
        moves.append((recvs[(low, second[2])], first[0][1]))
    if first[3].meta_type.is_recv:  # on rank high, post first's receive with second's group
        moves.append((recvs[(high, first[3])], second[1][1]))
    moves = [(recv, gap) for recv, gap in moves if gap < recv.gap]
    if not moves:
        return False
    recv, gap = min(moves, key=lambda m: m[0].gap - m[1])
    recv.wanted_gap = min(recv.wanted_gap, gap)
    return True


def _repair_for_stream(
    plans: dict[int, _RankPlan], stage_to_rank: dict[int, int], emit: _Emit, force: bool
) -> bool:
    """Move operations until the job finishes in the stream model (groups of a rank run in order).

    While the model is stuck, for an operation of a rank's first unfinished group:

    - a send whose receive sits behind the peer's first unfinished group, or behind the
      metadata receive the peer's thread waits for, gets that receive posted there (posting a
      receive earlier never needs data);
    - a receive whose send sits behind the metadata receive its sender's thread waits for gets
      that gap's sends issued before the metadata receives;

    failing both, a receive posted before its natural place goes back there, with every receive
    of the same rank, kind and stage (a schedule repeats itself; one at a time would take as
    many runs as there are micro-batches). What cannot be repaired is left for validation to
    report. True when the last run finished without any forced move (the lists as they stand finish).
    """
    recvs = {(rank, recv.step): recv for rank, plan in plans.items() for recv in plan.recvs}
    send_gap = {(rank, send): gap for rank, plan in plans.items() for gap, sends in plan.sends.items()
                for _, send in sends}
    for _ in range(2 * sum(len(plan.recvs) for plan in plans.values()) + 1):
        lowered = _assemble_all(plans, emit)
        outcome = run_job(lowered, stage_to_rank, model="stream", force_posts=force)
        gap_of = _GapIndex(lowered)
        if outcome.forced:
            changed = False
            for rank, step, index in outcome.forced:  # receives the model had to post early
                recv = recvs[(rank, step)]
                gap = gap_of(rank, index)
                if gap < recv.wanted_gap:
                    recv.wanted_gap, changed = gap, True
            if changed:
                continue
            return False  # the moves the model made do not fit the gaps: leave it to the slow repairs
        if outcome.finished:
            return True
        head_gap = {rank: gap_of(rank, index) for rank, index in outcome.heads.items()}
        meta_wait = {
            rank: gap_of(rank, index)
            for rank, (index, _) in outcome.stuck.items()
            if index < len(lowered[rank]) and lowered[rank][index].meta_type is _T.META_RECV
        }
        moved = False
        for rank, ops in outcome.pending.items():
            for op in ops:
                peer = peer_rank(op, stage_to_rank)
                if op.meta_type.is_send:
                    recv = recvs.get((peer, counterpart(op)))
                    if recv is None:
                        continue
                    waiting = meta_wait.get(peer)
                    if waiting is not None and recv.gap >= waiting:
                        # before the metadata receives of that gap; one that needs metadata of its own goes
                        # right after its metadata (which moves with it)
                        recv.wanted_gap = min(recv.wanted_gap, waiting)
                        recv.before_meta = not recv.needs_meta
                        moved = True
                    elif peer in head_gap and recv.gap > head_gap[peer]:
                        recv.wanted_gap = min(recv.wanted_gap, head_gap[peer])
                        moved = True
                else:
                    gap = send_gap.get((peer, counterpart(op)))  # None: no send (or no list) on the peer
                    plan = plans.get(peer)
                    if gap is not None and meta_wait.get(peer) == gap and gap not in plan.sends_first:
                        plan.sends_first.add(gap)
                        moved = True
        if not moved:  # un-prefetch: every receive of the same rank, kind and stage (one pattern)
            patterns = {(rank, op.meta_type, op.stage_index) for rank, ops in outcome.pending.items() for op in ops
                        if (rank, op) in recvs and recvs[(rank, op)].wanted_gap < recvs[(rank, op)].natural_gap}
            for (rank, step), recv in recvs.items():
                if (rank, step.meta_type, step.stage_index) in patterns and recv.wanted_gap < recv.natural_gap:
                    recv.wanted_gap, recv.before_meta = recv.natural_gap, False
                    moved = True
        if not moved:
            return False
    return False


class _GapIndex:
    """The gap (number of compute steps before it) of the step at an index of a rank's list; each
    rank's prefix counts are made once, on the first question about that rank."""

    def __init__(self, lowered: dict[int, list[MetaStep]]) -> None:
        self.lowered = lowered
        self.prefix: dict[int, list[int]] = {}

    def __call__(self, rank: int, index: int) -> int:
        counts = self.prefix.get(rank)
        if counts is None:
            counts, seen = [], 0
            for step in self.lowered[rank]:
                counts.append(seen)
                seen += not step.meta_type.is_comm
            counts.append(seen)
            self.prefix[rank] = counts
        return counts[min(index, len(counts) - 1)]


def _number_fifo(plans: dict[int, _RankPlan]) -> None:
    """Give each recv its FIFO index: the place of its send among the sender's messages to this rank
    on the same channel. Sends and receives are fixed once metadata is added, so this runs once;
    the places of receives change many times (``_apply_fifo_order``)."""
    send_order: dict[tuple[int, int, bool], dict[MetaStep, int]] = defaultdict(dict)
    for rank, plan in plans.items():
        for gap in sorted(plan.sends):
            for peer, send in plan.sends[gap]:
                order = send_order[(rank, peer, send.meta_type.is_meta)]
                order.setdefault(send, len(order))
    for rank, plan in plans.items():
        channels: dict[tuple[bool, int], list[_Recv]] = defaultdict(list)
        for recv in plan.recvs:
            is_meta = recv.step.meta_type.is_meta
            sends = send_order.get((recv.peer, rank, is_meta), {})
            recv.fifo_index = sends.get(counterpart(recv.step), float("inf"))
            if recv.fifo_index != float("inf"):
                channels[(is_meta, recv.peer)].append(recv)
        for recvs in channels.values():
            recvs.sort(key=lambda r: r.fifo_index)
        plan.fifo = _FifoPlan(
            data_channels=[recvs for (is_meta, _), recvs in channels.items() if not is_meta],
            meta_channels=[recvs for (is_meta, _), recvs in channels.items() if is_meta],
            data_recvs=[(message_key(r.step), r) for r in plan.recvs if not r.step.meta_type.is_meta],
            meta_recvs=[(("F", *message_key(r.step)[1:]), r) for r in plan.recvs if r.step.meta_type.is_meta],
        )


def _apply_fifo_order(plans: dict[int, _RankPlan]) -> None:
    for plan in plans.values():
        _place_recvs(plan)


def _place_recvs(plan: _RankPlan) -> None:
    """Give each recv of a rank its final gap: the suffix minimum of wanted gaps along each FIFO
    channel, data channels first; a metadata receive also no later than the data receive it describes."""
    fifo = plan.fifo
    if fifo is None:
        raise RuntimeError("lowering: _number_fifo must run before the receives are placed")
    for recv in plan.recvs:
        recv.gap = recv.wanted_gap
    for recvs in fifo.data_channels:
        _suffix_minimum(recvs, len(plan.items))
    if fifo.meta_recvs:
        data_gap = {key: recv.gap for key, recv in fifo.data_recvs}
        for key, recv in fifo.meta_recvs:
            recv.gap = min(recv.gap, data_gap.get(key, recv.gap))
        for recvs in fifo.meta_channels:
            _suffix_minimum(recvs, len(plan.items))


def _suffix_minimum(recvs: list[_Recv], end: int) -> None:
    """Receives of one FIFO channel, in order: none may be posted after a later one."""
    earliest = end
    for recv in reversed(recvs):
        earliest = min(earliest, recv.gap)
        recv.gap = earliest


_Emit = Callable[[list[list[MetaStep]], list[MetaStep]], list[MetaStep]]
"""(the data operations issued together at each slot of a gap, the metadata receives between
the slots) -> the steps of that gap."""


def _assemble_all(plans: dict[int, _RankPlan], emit: _Emit) -> dict[int, list[MetaStep]]:
    _apply_fifo_order(plans)
    return {rank: _assemble(plan, emit) for rank, plan in plans.items()}


def _assemble(plan: _RankPlan, emit: _Emit) -> list[MetaStep]:
    recvs_at: dict[int, list[_Recv]] = defaultdict(list)
    for recv in plan.recvs:
        recvs_at[recv.gap].append(recv)
    out: list[MetaStep] = []
    cache = plan.assembled
    no_recvs: list[_Recv] = []
    for gap in range(len(plan.items) + 1):
        here = recvs_at.get(gap, no_recvs)
        # everything _gap_slots reads that may change between assemblies
        key = (emit, gap in plan.sends_first, tuple((id(r), r.before_meta, r.depends_on) for r in here))
        cached = cache.get(gap)
        if cached is not None and cached[0] == key:
            out += cached[1]
        else:
            sends = [send for _, send in plan.sends.get(gap, [])]
            steps = [send for send in sends if send.meta_type.is_meta]
            steps += emit(*_gap_slots(plan, gap, [s for s in sends if not s.meta_type.is_meta], here))
            cache[gap] = (key, steps)
            out += steps
        if gap < len(plan.items):
            out.append(plan.items[gap])
    return out


def _gap_slots(
    plan: _RankPlan, gap: int, sends: list[MetaStep], recvs: list[_Recv]
) -> tuple[list[list[MetaStep]], list[MetaStep]]:
    """Split a gap at its metadata receives (the runtime waits for each): slot 0 is before the
    first, slot k + 1 after the k-th. A data receive goes after the metadata it needs and after
    every receive of its peer ahead of it; the data sends go to slot 0 when a metadata receive
    of this gap depends on them (or a repair said so), else to slot 1; the data receives go with
    the sends (a group of receives alone ahead of the sends would cross the same groups of a
    peer that does the same), unless a repair marked them to go before the metadata."""
    ordered = _order_recvs(recvs)
    metas = [r for r in ordered if r.step.meta_type.is_meta]
    meta_slot = {message_key(r.step)[1:]: k + 1 for k, r in enumerate(metas)}
    sends_first = (
        plan.eager or not metas or gap in plan.sends_first
        or any(r.depends_on >= gap - 1 or r.depends_on == -2 for r in metas)
    )
    send_slot = 0 if sends_first else 1
    slots: list[list[MetaStep]] = [[] for _ in range(len(metas) + 1)]
    slots[send_slot] += sends
    last_of_peer: dict[int, int] = {}
    for recv in ordered:
        if recv.step.meta_type.is_meta:
            continue
        key = message_key(recv.step)
        slot = meta_slot.get(key[1:], 0) if recv.needs_meta else 0
        if not recv.before_meta:  # with the sends: a group of receives alone ahead of them would cross the peer's
            slot = max(slot, send_slot)
        slot = max(slot, last_of_peer.get(recv.peer, 0))
        last_of_peer[recv.peer] = slot
        slots[slot].append(recv.step)
    return slots, [r.step for r in metas]


def _order_recvs(recvs: list[_Recv]) -> list[_Recv]:
    """Peers by urgency (earliest natural consumer), each peer's recvs in FIFO order."""
    urgency: dict[int, tuple[int, int]] = {}
    for recv in recvs:
        here = (recv.natural_gap, recv.peer)
        urgency[recv.peer] = min(urgency.get(recv.peer, here), here)
    return sorted(recvs, key=lambda r: (urgency[r.peer], r.fifo_index, r.natural_gap))


def _emit_plain(slots: list[list[MetaStep]], meta_recvs: list[MetaStep]) -> list[MetaStep]:
    out = list(slots[0])
    for meta, slot in zip(meta_recvs, slots[1:], strict=True):
        out += [meta, *slot]
    return out


def _emit_batch(slots: list[list[MetaStep]], meta_recvs: list[MetaStep]) -> list[MetaStep]:
    def batch(ops: list[MetaStep]) -> list[MetaStep]:
        return [MetaStep(None, _T.BATCH_SEND_RECV, None, ops)] if ops else []

    out = batch(slots[0])
    for meta, slot in zip(meta_recvs, slots[1:], strict=True):
        out += [meta, *batch(slot)]
    return out
