"""A rank's plan in ``p2p.py``'s lowering: its sends and receives at their natural places, their FIFO
numbering, where each receive is posted, and the rank's list assembled from that, gap by gap.

``p2p.py`` moves receives (prefetch, the batch repairs) and assembles again; ``rank_plan.py`` runs
the same steps for one rank. What a compute part sends and receives is worked out once per kind
and stage (``comm_steps.part_comms``): a large schedule repeats them for every micro-batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType, message_key
from hyper_parallel.core.pipeline_parallel.lowering.comm_steps import (
    PAIRS,
    PartComms,
    batch_step,
    comm_step,
    part_comms,
)

_T = MetaStepType


@dataclass(eq=False, slots=True)
class _Recv:
    peer: int
    natural_gap: int
    step: MetaStep
    needs_meta: bool = False  # a data receive whose shapes come in a RECV_META of this run
    wanted_gap: int = -1  # natural_gap (as made), or earlier when prefetched or repaired
    depends_on: int = -2  # last compute step of this rank its send depends on (-2: unknown, assume its gap)
    before_meta: bool = False  # posted before the metadata receives of its gap
    fifo_index: float = float("inf")
    gap: int = -1


@dataclass
class _FifoPlan:
    """A rank's receives by FIFO channel (peer, data or metadata), each in its sender's order, and
    its metadata receives and the data receives they describe, with the data message of each."""

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
    assembled: dict[int, tuple[Callable, tuple, list[MetaStep]]] = field(default_factory=dict)
    # gap -> (what its slots depend on, its slots) from the last time they were made (``_cached_gap_slots``)
    slots: dict[int, tuple[tuple, tuple[list[list[MetaStep]], list[MetaStep]]]] = field(default_factory=dict)
    # gap -> (its metadata sends, its data sends): sends by gap without the peers; None: to be made again
    gap_sends: dict[int, tuple[list[MetaStep], list[MetaStep]]] | None = None


def _check_stage(step: MetaStep, stage_to_rank: dict[int, int]) -> None:
    if step.stage_index not in stage_to_rank:
        raise ValueError(f"step {step}: stage {step.stage_index} is not in stage_to_rank")


_SINGLE_PARTS = frozenset({_T.FWD, _T.BWD, _T.BWD_INPUT, _T.BWD_WEIGHT})  # a step that is its only part


def _plan_rank(rank: int, steps: list[MetaStep | None], stage_to_rank: dict[int, int]) -> _RankPlan:
    """Natural places: gap g sits before item g; sends of item g go to gap g + 1."""
    plan = _RankPlan(items=[step for step in steps if step is not None], gap_sends={})
    recvs, sends, gap_sends = plan.recvs, plan.sends, plan.gap_sends
    known: dict[tuple[MetaStepType, int | None], PartComms] = {}  # (kind, stage) -> its messages
    for index, step in enumerate(plan.items):
        kind = step.meta_type
        if kind.is_comm:
            raise ValueError(f"rank {rank}: {step} is already a communication step; lower compute-only lists")
        for part in (step,) if kind in _SINGLE_PARTS else step.parts:
            micro, stage = part.micro_index, part.stage_index
            comms = known.get((part.meta_type, stage))
            if comms is None:
                _check_stage(part, stage_to_rank)
                if micro is None:  # no message then (consumes / produces)
                    continue
                comms = known[(part.meta_type, stage)] = part_comms(part, rank, stage_to_rank)
            elif micro is None:
                continue
            for kind, peer in comms.recvs:
                recvs.append(_Recv(peer, index, comm_step(micro, kind, stage), False, index))
            if comms.sends:
                with_peers = sends[index + 1]
                if index + 1 not in gap_sends:
                    gap_sends[index + 1] = ([], [])
                data_sends = gap_sends[index + 1][1]
                for kind, peer in comms.sends:
                    send = comm_step(micro, kind, stage)
                    with_peers.append((peer, send))
                    data_sends.append(send)
    return plan


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
        plan.gap_sends = None
    for plan in plans.values():
        recvs = []
        for recv in plan.recvs:
            if recv.step.meta_type is _T.FWD_RECV and message_key(recv.step) in carried:
                meta = MetaStep(recv.step.micro_index, _T.META_RECV, recv.step.stage_index)
                recvs.append(_Recv(recv.peer, recv.natural_gap, meta, False, recv.natural_gap))
                recv.needs_meta = True
            recvs.append(recv)
        plan.recvs = recvs


def _number_fifo(plans: dict[int, _RankPlan]) -> None:
    """Give each recv its FIFO index: the place of its send among the sender's messages to this rank
    on the same channel. Sends and receives are fixed once metadata is added, so this runs once;
    the places of receives change many times (``_apply_fifo_order``)."""
    # (sender, receiver, metadata channel) -> (micro, kind, stage) of each send (a MetaStep without
    # sub-steps, as a tuple: hashed in C) -> its place
    send_order: dict[tuple[int, int, bool], dict[tuple, int]] = defaultdict(dict)
    for rank, plan in plans.items():
        for gap in sorted(plan.sends):
            for peer, send in plan.sends[gap]:
                kind = send.meta_type
                order = send_order[(rank, peer, kind.is_meta)]
                order.setdefault((send.micro_index, kind, send.stage_index), len(order))
    inf = float("inf")
    for rank, plan in plans.items():
        channels: dict[tuple[bool, int], list[_Recv]] = {}
        # (peer, receive kind) -> (the peer's sends to this rank on that channel, the counterpart's kind and
        # stage shift, the channel's receives)
        routes: dict[tuple[int, MetaStepType], tuple[dict[tuple, int], MetaStepType, int, list[_Recv]]] = {}
        for recv in plan.recvs:
            step = recv.step
            route = routes.get((recv.peer, step.meta_type))
            if route is None:
                is_meta = step.meta_type.is_meta
                route = routes[(recv.peer, step.meta_type)] = (
                    send_order.get((recv.peer, rank, is_meta), {}), *PAIRS[step.meta_type],
                    channels.setdefault((is_meta, recv.peer), []))
            sends, match, shift, channel = route
            index = sends.get((step.micro_index, match, step.stage_index + shift))
            if index is None:
                recv.fifo_index = inf
            else:
                recv.fifo_index = index
                channel.append(recv)
        for recvs in channels.values():
            recvs.sort(key=_BY_FIFO_INDEX)
        plan.fifo = _fifo_plan(plan.recvs, channels)


_BY_FIFO_INDEX = attrgetter("fifo_index")


def _fifo_plan(recvs: list[_Recv], channels: dict[tuple[bool, int], list[_Recv]]) -> _FifoPlan:
    meta_recvs = [(("F", *message_key(r.step)[1:]), r) for r in recvs if r.step.meta_type.is_meta]
    described = {key for key, _ in meta_recvs}
    data_recvs = []
    if described:
        data_recvs = [(key, r) for r in recvs if not r.step.meta_type.is_meta
                      for key in (message_key(r.step),) if key in described]
    return _FifoPlan(
        data_channels=[recvs for (is_meta, _), recvs in channels.items() if not is_meta],
        meta_channels=[recvs for (is_meta, _), recvs in channels.items() if is_meta],
        data_recvs=data_recvs,
        meta_recvs=meta_recvs,
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
        if recv.gap < earliest:
            earliest = recv.gap
        else:
            recv.gap = earliest


_Emit = Callable[[list[list[MetaStep]], list[MetaStep]], list[MetaStep]]
"""(the data operations issued together at each slot of a gap, the metadata receives between
the slots) -> the steps of that gap."""


def _assemble_all(plans: dict[int, _RankPlan], emit: _Emit) -> dict[int, list[MetaStep]]:
    _apply_fifo_order(plans)
    return {rank: _assemble(plan, emit) for rank, plan in plans.items()}


def _assemble(plan: _RankPlan, emit: _Emit) -> list[MetaStep]:
    """The rank's list: each compute step after the steps of the gap before it (``_gap_steps``);
    an empty gap has none. With ``_emit_plain``, a gap without a metadata receive is simply its
    sends, then its receives in order (what ``_gap_slots`` makes of it: one slot)."""
    recvs_at: dict[int, list[_Recv]] = defaultdict(list)
    for recv in plan.recvs:
        recvs_at[recv.gap].append(recv)
    sends_at = _sends_by_gap(plan)
    items = plan.items
    end = len(items)
    plain = emit is _emit_plain
    meta_gaps = {recv.gap for _, recv in plan.fifo.meta_recvs} if plain and plan.fifo is not None else None
    out: list[MetaStep] = []
    done = 0
    for gap in sorted(gap for gap in recvs_at.keys() | sends_at.keys() if 0 <= gap <= end):
        out += items[done:gap]
        done = gap
        here = recvs_at.get(gap, _NO_RECVS)
        if meta_gaps is None or gap in meta_gaps:
            out += _gap_steps(plan, gap, here, emit)
            continue
        meta_sends, data_sends = sends_at.get(gap, _NO_SENDS)
        out += meta_sends
        out += data_sends
        if len(here) == 1:
            out.append(here[0].step)
        elif here:
            out += [recv.step for recv in _order_recvs(here)]
    out += items[done:]
    return out


_NO_RECVS: list[_Recv] = []
_NO_SENDS: tuple[list[MetaStep], list[MetaStep]] = ([], [])


def _sends_by_gap(plan: _RankPlan) -> dict[int, tuple[list[MetaStep], list[MetaStep]]]:
    """gap -> (its metadata sends, its data sends), each in send order (made again after ``_add_metadata``)."""
    if plan.gap_sends is None:
        plan.gap_sends = {gap: ([send for _, send in sends if send.meta_type.is_meta],
                                [send for _, send in sends if not send.meta_type.is_meta])
                          for gap, sends in plan.sends.items()}
    return plan.gap_sends


def _gap_steps(plan: _RankPlan, gap: int, here: list[_Recv], emit: _Emit) -> list[MetaStep]:
    """The steps of one gap: metadata sends first, then what ``emit`` makes of its slots; kept from
    the last assembly while nothing ``_gap_slots`` reads changed."""
    key = _slots_key(plan, gap, here)
    cached = plan.assembled.get(gap)
    if cached is not None and cached[0] is emit and cached[1] == key:
        return cached[2]
    meta_sends, data_sends = _sends_by_gap(plan).get(gap, _NO_SENDS)
    steps = list(meta_sends)
    steps += emit(*_cached_gap_slots(plan, gap, data_sends, here, key))
    plan.assembled[gap] = (emit, key, steps)
    return steps


def _slots_key(plan: _RankPlan, gap: int, here: list[_Recv]) -> tuple:
    """What ``_gap_slots`` reads of a gap that can change between two assemblies (the receives there,
    in order; their ``before_meta`` and ``depends_on`` and the gap's ``sends_first`` where the gap may
    hold a metadata receive): equal keys, equal slots. A rank without metadata receives (every gap
    then one slot) needs only the receives, compared by identity in C."""
    if plan.fifo is not None and not plan.fifo.meta_recvs:
        return tuple(here)
    return gap in plan.sends_first, tuple([(id(r), r.before_meta, r.depends_on) for r in here])


def _cached_gap_slots(
    plan: _RankPlan, gap: int, sends: list[MetaStep], here: list[_Recv], key: tuple
) -> tuple[list[list[MetaStep]], list[MetaStep]]:
    """``_gap_slots`` of a gap whose ``_slots_key`` is ``key``, kept per gap: the batch lowering asks
    for them in its sweeps over message crossings (``p2p._uncross``) and again to assemble."""
    cached = plan.slots.get(gap)
    if cached is not None and cached[0] == key:
        return cached[1]
    slots = _gap_slots(plan, gap, sends, here)
    plan.slots[gap] = (key, slots)
    return slots


def _gap_slots(
    plan: _RankPlan, gap: int, sends: list[MetaStep], recvs: list[_Recv]
) -> tuple[list[list[MetaStep]], list[MetaStep]]:
    """Split a gap at its metadata receives (the runtime waits for each): slot 0 is before the
    first, slot k + 1 after the k-th. A data receive goes after the metadata it needs and after
    every receive of its peer ahead of it; the data sends go to slot 0 when a metadata receive
    of this gap depends on them (or a repair said so), else to slot 1; the data receives go with
    the sends (a group of receives alone ahead of the sends would cross the same groups of a
    peer that does the same), unless a repair marked them to go before the metadata."""
    for recv in recvs:
        if recv.step.meta_type.is_meta:
            break
    else:  # one slot: the sends, then the receives
        slot = list(sends)
        slot += [recv.step for recv in (_order_recvs(recvs) if len(recvs) > 1 else recvs)]
        return [slot], []
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
    out = [batch_step(slots[0])] if slots[0] else []
    for meta, slot in zip(meta_recvs, slots[1:], strict=True):
        out.append(meta)
        if slot:
            out.append(batch_step(slot))
    return out
