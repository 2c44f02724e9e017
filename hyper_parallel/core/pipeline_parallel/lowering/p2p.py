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

Each rank's plan (its sends and receives, their FIFO numbering and places, the assembly of its list
gap by gap) is made in ``p2p_plan.py``; this module lowers the whole job with it and repairs it.
"""

from __future__ import annotations

from collections import defaultdict

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType, Schedule, message_key
from hyper_parallel.core.pipeline_parallel.lowering.comm_steps import PAIRS, peer_rank
from hyper_parallel.core.pipeline_parallel.lowering.comm_steps import counterpart  # noqa: F401  (p2p's API)
from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc
from hyper_parallel.core.pipeline_parallel.lowering.job_model import note_finished, run_job
from hyper_parallel.core.pipeline_parallel.lowering.levels import lower_by_levels
from hyper_parallel.core.pipeline_parallel.lowering.p2p_plan import (  # rank_plan.py uses the planning steps too
    _NO_RECVS,
    _NO_SENDS,
    _add_metadata,
    _assemble,  # noqa: F401
    _assemble_all,
    _Emit,
    _emit_batch,
    _emit_plain,
    _cached_gap_slots,
    _gap_slots,  # noqa: F401
    _slots_key,
    _number_fifo,
    _place_recvs,
    _plan_rank,
    _RankPlan,
    _Recv,
    _sends_by_gap,
)

TRANSPORTS = ("plain", "batch")
METADATA = ("none", "first", "all")

_T = MetaStepType


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
    _number_fifo(plans)  # each receive wanted at its natural place, as made
    if prefetch or (metadata != "none" and _dependencies_read(transport, stage_to_rank)):
        # what each send depends on, sends never waiting
        _use_dependencies(plans, stage_to_rank, _emit_plain, "eager", prefetch and transport == "plain")
    if transport == "plain":
        return _assemble_all(plans, _emit_plain)
    _uncross(plans)
    finished = _repair(plans, stage_to_rank)
    lowered = _assemble_all(plans, _emit_batch)
    if finished:  # the last run of the repairs ran these lists: validation need not run them again
        note_finished(lowered, stage_to_rank, "stream")
    return lowered


def _dependencies_read(transport: str, stage_to_rank: dict[int, int]) -> bool:
    """Whether lowering without prefetch reads what ``_use_dependencies`` notes: the batch lowering
    does (where a gap's sends go); the plain one never does (its sends always go first), so its run of
    the job model (O(job x ranks), with clocks) can be skipped where that run cannot raise: with stages
    0 to n - 1, every stage the model looks up for a step's inputs or a message exists."""
    return transport != "plain" or not all(stage in stage_to_rank for stage in range(len(stage_to_rank)))


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
    recvs = _recvs_by_step(plans)
    # each receive's peer and the very send step it matches (fixed: only the places move); steps are
    # looked up by identity below, hashing a MetaStep millions of times being the cost of a sweep
    send_steps = {_step_key(rank, send): send for rank, plan in plans.items() for sends in plan.sends.values()
                  for _, send in sends}
    matches = {}
    for (rank, *_), recv in recvs.items():
        send = send_steps.get(_counterpart_key(recv.peer, recv.step))
        if send is not None:
            matches[(rank, id(recv.step))] = (recv.peer, id(send))
    pair_keys = sorted({(min(rank, peer), max(rank, peer)) for (rank, _), (peer, _) in matches.items()})
    cache: _GroupCache = {}  # valid within this call: only wanted gaps change here
    where: dict[int, dict[int, tuple[tuple[int, int], MetaStep]]] = {}
    dirty = set(plans)  # ranks whose receives moved: only their positions, and their pairs, change
    by_peer: dict[int, dict[int, list[tuple]]] = {}
    for _ in range(sum(len(plan.recvs) for plan in plans.values()) + 1):
        for rank in dirty:
            where[rank] = _rank_group_positions(rank, plans[rank], cache)
            by_peer[rank] = _matched_by_peer(rank, where[rank], matches)
        moved: set[int] = set()
        # a fix touches only its pair's receives, so the pairs of one sweep are independent; a pair
        # whose ranks did not move is as the last sweep left it (no fix was possible there)
        for low, high in pair_keys:
            if low not in dirty and high not in dirty:
                continue
            entries = _pair_entries(low, high, where, by_peer)
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


_GroupCache = dict[tuple[int, int, tuple[_Recv, ...]], list[list[MetaStep]]]
_Positions = dict[int, dict[int, tuple[tuple[int, int], MetaStep]]]


def _matched_by_peer(rank: int, where: dict[int, tuple[tuple[int, int], MetaStep]],
                     matches: dict) -> dict[int, list[tuple]]:
    """The receives of ``rank`` that match a send, by the sender's rank, each as (its place, the
    receive, the id of the send), in program order (the order of ``where``)."""
    by_peer: dict[int, list[tuple]] = defaultdict(list)
    for op_id, (place, op) in where.items():
        match = matches.get((rank, op_id))
        if match is not None:
            by_peer[match[0]].append((place, op, match[1]))
    return by_peer


def _pair_entries(low: int, high: int, where: _Positions, by_peer: dict[int, dict[int, list[tuple]]]) -> list[tuple]:
    """The messages between ranks ``low`` and ``high``, each as (place on low, place on high, its
    operation on low, its operation on high): low's receives first, then high's, in program order."""
    entries = []
    on_high = where[high]
    for place, op, other_id in by_peer[low].get(high, ()):
        other_place, other = on_high[other_id]
        entries.append((place, other_place, op, other))
    on_low = where[low]
    for place, op, other_id in by_peer[high].get(low, ()):
        other_place, other = on_low[other_id]
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
    sends_at = _sends_by_gap(plan)
    group = 0
    end = len(plan.items)
    for gap in sorted(gap for gap in recvs_at.keys() | sends_at.keys() if 0 <= gap <= end):  # an empty gap has no group
        here = recvs_at.get(gap, _NO_RECVS)
        key = (rank, gap, tuple(here))  # the receives by identity (eq=False), compared in C
        groups = cache.get(key)
        if groups is None:
            slots, _ = _cached_gap_slots(plan, gap, sends_at.get(gap, _NO_SENDS)[1], here,
                                         _slots_key(plan, gap, here))
            groups = cache[key] = [slot for slot in slots if slot]  # one BATCH step per non-empty slot
        for ops in groups:
            place = (group, gap)
            for op in ops:
                where[id(op)] = (place, op)
            group += 1
    return where


_StepKey = tuple[int, int | None, MetaStepType, int | None]


def _step_key(rank: int, step: MetaStep) -> _StepKey:
    """(rank, step) as a tuple, hashed in C: equal exactly where the steps are (a send or receive
    step has no sub-steps)."""
    return rank, step.micro_index, step.meta_type, step.stage_index


def _counterpart_key(peer: int, step: MetaStep) -> _StepKey:
    """``_step_key(peer, counterpart(step))`` without making the step."""
    kind, shift = PAIRS[step.meta_type]
    return peer, step.micro_index, kind, step.stage_index + shift


def _recvs_by_step(plans: dict[int, _RankPlan]) -> dict[_StepKey, _Recv]:
    return {_step_key(rank, recv.step): recv for rank, plan in plans.items() for recv in plan.recvs}


def _fix_crossing(recvs: dict, low: int, high: int, first: tuple, second: tuple) -> bool:
    """``first`` is earlier than ``second`` on rank ``low`` but later on rank ``high``."""
    involved = [recvs[_step_key(rank, op)] for rank, op in ((low, first[2]), (low, second[2]), (high, first[3]),
                                                              (high, second[3])) if op.meta_type.is_recv]
    early = [r for r in involved if r.wanted_gap < r.natural_gap]
    if early:
        early.sort(key=lambda r: (r.step.meta_type is not _T.BWD_RECV, -r.peer))
        early[0].wanted_gap = early[0].natural_gap
        return True
    moves = []
    if second[2].meta_type.is_recv:  # on rank low, post second's receive with first's group
        moves.append((recvs[_step_key(low, second[2])], first[0][1]))
    if first[3].meta_type.is_recv:  # on rank high, post first's receive with second's group
        moves.append((recvs[_step_key(high, first[3])], second[1][1]))
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
    recvs = _recvs_by_step(plans)
    send_gap = {_step_key(rank, send): gap for rank, plan in plans.items() for gap, sends in plan.sends.items()
                for _, send in sends}
    for _ in range(2 * sum(len(plan.recvs) for plan in plans.values()) + 1):
        lowered = _assemble_all(plans, emit)
        outcome = run_job(lowered, stage_to_rank, model="stream", force_posts=force)
        gap_of = _GapIndex(lowered)
        if outcome.forced:
            changed = False
            for rank, step, index in outcome.forced:  # receives the model had to post early
                recv = recvs[_step_key(rank, step)]
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
                    recv = recvs.get(_counterpart_key(peer, op))
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
                    gap = send_gap.get(_counterpart_key(peer, op))  # None: no send (or no list) on the peer
                    plan = plans.get(peer)
                    if gap is not None and meta_wait.get(peer) == gap and gap not in plan.sends_first:
                        plan.sends_first.add(gap)
                        moved = True
        if not moved:  # un-prefetch: every receive of the same rank, kind and stage (one pattern)
            patterns = {(rank, op.meta_type, op.stage_index) for rank, ops in outcome.pending.items() for op in ops
                        for recv in (recvs.get(_step_key(rank, op)),)
                        if recv is not None and recv.wanted_gap < recv.natural_gap}
            for (rank, _, kind, stage), recv in recvs.items():
                if (rank, kind, stage) in patterns and recv.wanted_gap < recv.natural_gap:
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
