"""Each rank checks its own lowered list against the flow it was planned from (``rank_plan.py``).

A rank plans only its own list; these checks are what stands in for the whole-job run of
``validate_lowered``. Each says the list has the shape the proof of its lowering needs (module
docstrings of ``rank_plan.py`` and ``levels.py``); every rank checks its own, so together they cover
the job. A failure is a lowering bug, reported as a ``ScheduleError`` naming the rank.
"""

from __future__ import annotations

from collections import defaultdict

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType, message_key
from hyper_parallel.core.pipeline_parallel.lowering import p2p
from hyper_parallel.core.pipeline_parallel.lowering.flow import Flow
from hyper_parallel.core.pipeline_parallel.lowering.levels import boundary, carried, consumer_rank, recv_step, send_step
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError

_T = MetaStepType


def check_plain_list(own: list[MetaStep], rank: int, flow: Flow) -> None:
    """The rank's lowered list is what the pass modelled: each value it consumes from another rank
    is received before the step (its shapes first, in the modelled gap), each value another rank
    consumes is sent right after the step that made it, ahead of any wait of that gap, nothing
    twice, and the receives of each incoming channel come in the sender's order."""
    schedule = {rank: own}
    owner = flow.stage_to_rank

    def fail(reason: str, *marks: int) -> None:
        raise ScheduleError(f"lowering of rank {rank}: {reason}", schedule, [(rank, k) for k in marks])

    received: dict[DataKey, int] = {}  # key -> position
    sent: set[DataKey] = set()
    order: dict[tuple[int, bool], list[DataKey]] = defaultdict(list)
    owed: dict[DataKey, int] = {}  # values made here that another rank consumes, not sent yet -> position
    waited = False  # a RECV_META since the last compute step
    gap = 0
    outgoing: dict[tuple[int, bool], list[DataKey]] = defaultdict(list)  # (peer, shapes?) -> values sent, in order
    for pos, step in enumerate(own):
        kind = step.meta_type
        if kind.is_compute:
            if gap >= len(flow.items[rank]) or step is not flow.items[rank][gap] and step != flow.items[rank][gap]:
                fail(f"{step} is not this rank's next compute step", pos)
            if owed:
                key, where = next(iter(owed.items()))
                fail(f"{_text(key)} made at step {where} is not sent before the next compute step", where, pos)
            for key in flow.needs[rank][gap]:  # its inputs, and values whose shapes it waits for
                if flow.natural.get(key) == gap and owner[key[1]] != rank and key not in received:
                    fail(f"{step} consumes {_text(key)} with no receive before it", pos)
            for key in flow.makes[rank][gap]:
                if consumer_rank(flow, key) not in (None, rank):
                    owed[key] = pos
            waited = False
            gap += 1
            continue
        if kind is _T.BATCH_SEND_RECV or not (kind.is_send or kind.is_recv) or step.stage_index not in owner \
                or owner[step.stage_index] != rank:
            fail(f"{step} is not a send or receive of this rank's stages", pos)
        key = message_key(step)
        data = ("F", *key[1:]) if key[0] == "M" else key
        peer = p2p.peer_rank(step, owner)
        if peer == rank:
            fail(f"{step} talks to its own rank", pos)
        if kind.is_send:
            if key in sent or data not in owed or (waited and key[0] != "M"):
                fail(f"{step} is not right after the step that makes its value", pos)
            if (key[0] == "M") != (data in flow.meta_gap and ("M", *key[1:]) not in sent):
                fail(f"{step}: the shapes of {_text(data)} go ahead of it, once", pos)
            sent.add(key)
            outgoing[(peer, key[0] == "M")].append(data)
            if key[0] != "M":
                del owed[data]
            continue
        if key in received:
            fail(f"{step} appears twice", received[key], pos)
        if flow.natural.get(data) is None or owner[data[1]] == rank:
            fail(f"{step} receives a value this rank does not consume from another rank", pos)
        if key[0] != "M" and data in flow.meta_gap and ("M", *key[1:]) not in received:
            fail(f"{step} comes before the receive of its shapes", pos)
        if key[0] == "F" and flow.meta_gap and not any(k[0] == "M" and k[1] == key[1] for k in received):
            fail(f"{step} comes before the shapes of its stage boundary", pos)
        received[key] = pos
        order[(peer, key[0] == "M")].append(data)
        if key[0] == "M":
            waited = True
            if not flow.meta_early.get(data, -1) <= gap <= flow.meta_gap.get(data, -1):
                fail(f"{step} is not where the eager model put the wait for it", pos)
    if owed:
        key, where = next(iter(owed.items()))
        fail(f"{_text(key)} made at step {where} is never sent", where)
    if gap != len(flow.items[rank]):
        fail(f"the list holds {gap} of the rank's {len(flow.items[rank])} compute steps")
    for (peer, is_meta), keys in order.items():
        expected = [key for key in flow.channels.get((peer, rank), ()) if key in flow.meta_gap or not is_meta]
        if keys != expected:
            fail(f"the {'metadata' if is_meta else 'data'} receives from rank {peer} are not in its send order")
    for (peer, is_meta), keys in outgoing.items():  # what the peer's receives expect, in the same order
        expected = [key for key in flow.channels.get((rank, peer), ()) if key in flow.meta_gap or not is_meta]
        if keys != expected:
            fail(f"the {'metadata' if is_meta else 'data'} sends to rank {peer} are not in the order it receives them")


def _text(key: DataKey) -> str:
    return {"F": "F.s{}.m{}", "G": "the input gradient of stage {} for micro-batch {}"}.get(
        key[0], "{}.{}").format(key[1], key[2])


def check_levels_list(own: list[MetaStep], rank: int, flow: Flow, level: dict[DataKey, int], metadata: str) -> None:
    """``own`` has the shape the induction of ``levels.py`` needs: the batches hold operations of
    increasing boundaries, and only compute steps of levels below its first boundary precede it; a
    value this rank consumes from another rank is received before the step (its shapes right
    before the batch, which starts at their boundary); a value another rank consumes is sent at
    its boundary after the step that made it (its shapes before that, ahead of any wait for shapes
    of its boundary or later); no compute step follows a wait for shapes of a boundary above its
    level; nothing twice; the receives of each channel in the order the sender sends them."""
    schedule = {rank: own}

    def fail(reason: str, *marks: int) -> None:
        raise ScheduleError(f"lowering of rank {rank}: {reason}", schedule, [(rank, k) for k in marks])

    shapes = carried(flow, level, metadata, rank)
    shaped: set[int] = set()  # stages whose boundary's shapes arrived
    owed = {key for makes in flow.makes[rank] for key in makes if consumer_rank(flow, key) not in (None, rank)}
    sent: set[DataKey] = set()
    received: dict[DataKey, int] = {}
    meta_waiting: set[DataKey] = set()  # RECV_METAs since the last batch or compute step
    order: dict[int, list[DataKey]] = defaultdict(list)
    outgoing: dict[tuple[int, bool], list[DataKey]] = defaultdict(list)  # (peer, shapes?) -> values sent, in order
    last_level, last_boundary, meta_seen, k = -1, 0, 0, 0
    made_here: set[DataKey] = set()
    for pos, step in enumerate(own):
        kind = step.meta_type
        if kind.is_compute:
            if k >= len(flow.items[rank]) or step is not flow.items[rank][k] and step != flow.items[rank][k]:
                fail(f"{step} is not this rank's next compute step", pos)
            for key in flow.needs[rank][k]:
                if consumer_rank(flow, key) == rank and flow.stage_to_rank[key[1]] != rank and key not in received:
                    fail(f"{step} consumes {key} with no receive before it", pos)
            if meta_waiting:
                fail(f"{step} comes between a RECV_META and the batch it precedes", pos)
            last_level = level[flow.makes[rank][k][0]]
            if meta_seen > last_level:  # it would wait for the shapes of a later boundary
                fail(f"{step} (level {last_level}) comes after a RECV_META of boundary {meta_seen}", pos)
            made_here.update(flow.makes[rank][k])
            k += 1
        elif kind is _T.META_SEND:
            key = ("F", *message_key(step)[1:])
            if key not in shapes or key not in made_here or ("M", *key[1:]) in sent or key in sent \
                    or not max(last_level, meta_seen) < boundary(flow, level, key):
                fail(f"{step} is not between the step that makes its value and its boundary's waits", pos)
            sent.add(("M", *key[1:]))
            outgoing[(consumer_rank(flow, key), True)].append(key)
        elif kind is _T.META_RECV:
            key = ("F", *message_key(step)[1:])
            if key not in shapes or ("M", *key[1:]) in received or consumer_rank(flow, key) != rank:
                fail(f"{step} receives shapes this rank does not wait for", pos)
            received[("M", *key[1:])] = pos
            shaped.add(key[1])
            meta_waiting.add(key)
            meta_seen = max(meta_seen, boundary(flow, level, key))
            order[-1 - flow.stage_to_rank[key[1]]].append(key)
        elif kind is _T.BATCH_SEND_RECV:
            ops = step.comm_parts
            keys = [message_key(op) for op in ops]
            if not ops or any(key is None or key[0] == "M" for key in keys):
                fail(f"{step} must hold data sends and receives", pos)
            bounds = [boundary(flow, level, key) if key in flow.natural else -1 for key in keys]
            if bounds != sorted(bounds) or bounds[0] <= max(last_level, last_boundary):
                fail(f"{step} does not hold the operations of later boundaries than the last batch, in order", pos)
            if any(boundary(flow, level, key) != bounds[0] for key in meta_waiting):
                fail(f"a RECV_META right before {step} waits for shapes of a later boundary than its first", pos)
            for op, key in zip(ops, keys):
                peer = flow.stage_to_rank.get(key[1])
                if op.meta_type.is_send:
                    if key not in owed or key in sent or key not in made_here or op != send_step(key):
                        fail(f"{op} is not a send this rank owes", pos)
                    if key in shapes and ("M", *key[1:]) not in sent:
                        fail(f"{op} goes before the SEND_META of its shapes", pos)
                    sent.add(key)
                    outgoing[(consumer_rank(flow, key), False)].append(key)
                else:
                    if key in received or consumer_rank(flow, key) != rank or peer == rank or op != recv_step(key):
                        fail(f"{op} is not a receive this rank needs, once", pos)
                    if key in shapes and key not in meta_waiting:
                        fail(f"{op} has no RECV_META right before its batch", pos)
                    if shapes and key[0] == "F" and key[1] not in shaped:
                        fail(f"{op} comes before the shapes of its stage boundary", pos)
                    received[key] = pos
                    order[peer].append(key)
            if meta_waiting - set(keys):
                fail(f"a RECV_META right before {step} is for another batch", pos)
            meta_waiting.clear()
            last_boundary = bounds[-1]
        else:
            fail(f"{step} is not a step of a lowered batch list", pos)
    if k != len(flow.items[rank]):
        fail(f"the list holds {k} of the rank's {len(flow.items[rank])} compute steps")
    missing = sorted(key for key in owed if key not in sent) + sorted(
        f"shapes of {key}" for key in owed & shapes if ("M", *key[1:]) not in sent)
    if missing:
        fail(f"{missing[0]} is never sent")
    for peer in {flow.stage_to_rank[s] for s in flow.stage_to_rank} - {rank}:
        channel = sorted(flow.channels.get((peer, rank), []), key=lambda key: boundary(flow, level, key))
        if order.get(peer, []) != channel:  # the sender sends by boundary, in making order within one
            fail(f"the data receives from rank {peer} are not that rank's sends, in their order")
        if order.get(-1 - peer, []) != [key for key in channel if key in shapes]:
            fail(f"the metadata receives from rank {peer} are not that rank's sends, in their order")
        channel = sorted(flow.channels.get((rank, peer), []), key=lambda key: boundary(flow, level, key))
        if outgoing.get((peer, False), []) != channel:  # the order rank ``peer`` receives them in
            fail(f"the data sends to rank {peer} are not in the order it receives them")
        if outgoing.get((peer, True), []) != [key for key in channel if key in shapes]:
            fail(f"the metadata sends to rank {peer} are not in the order it receives them")
