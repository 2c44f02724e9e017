"""The send/recv steps of lowering: their peers, their counterparts, and what a compute part needs.

What a part (F/B/I/W) of stage ``s`` receives and sends, and from or to which rank, depends only
on its kind and stage (and whether it has a micro-batch), not on which micro-batch it runs: a
large schedule repeats the same few hundred (kind, stage) pairs for every micro-batch, so
``part_comms`` is asked once per pair (``p2p._plan_rank``) and only the steps are made per part.
"""

from __future__ import annotations

from dataclasses import dataclass

from hyper_parallel.core.pipeline_parallel.ir.steps import (
    MetaStep,
    MetaStepType,
    consumer_stage,
    consumes,
    produces,
    unchecked_step,
)

_T = MetaStepType


def peer_rank(op: MetaStep, stage_to_rank: dict[int, int]) -> int:
    """Rank on the other side of a send/recv step, from the conventions of ``p2p.py``."""
    if op.stage_index is None or not (op.meta_type.is_send or op.meta_type.is_recv):
        raise ValueError(f"{op} is not a send/recv step with a stage")
    peer_stage = op.stage_index + (1 if op.meta_type.towards_next else -1)
    if peer_stage not in stage_to_rank:
        raise ValueError(f"{op} has no peer: stage {peer_stage} does not exist")
    return stage_to_rank[peer_stage]


PAIRS = {
    _T.FWD_SEND: (_T.FWD_RECV, 1),
    _T.FWD_RECV: (_T.FWD_SEND, -1),
    _T.META_SEND: (_T.META_RECV, 1),
    _T.META_RECV: (_T.META_SEND, -1),
    _T.BWD_SEND: (_T.BWD_RECV, -1),
    _T.BWD_RECV: (_T.BWD_SEND, 1),
}
"""send/recv kind -> (the kind of its counterpart, the counterpart's stage minus its own)."""


def counterpart(op: MetaStep) -> MetaStep:
    """The step on the peer that matches a send/recv: SEND_F.s<s> <-> RECV_F.s<s+1>,
    SEND_META.s<s> <-> RECV_META.s<s+1>, SEND_B.s<s> <-> RECV_B.s<s-1> (same micro-batch)."""
    if op.stage_index is None:
        raise ValueError(f"{op} has no stage")
    if op.meta_type not in PAIRS:
        raise ValueError(f"{op} is not a send/recv step")
    kind, shift = PAIRS[op.meta_type]
    return MetaStep(op.micro_index, kind, op.stage_index + shift)


def comm_step(micro: int | None, kind: MetaStepType, stage: int | None) -> MetaStep:
    """``MetaStep(micro, kind, stage)`` without the argument checks (`unchecked_step`), for indices
    taken from checked steps: lowering makes a million of these for a large job."""
    return unchecked_step(micro, kind, stage)


def batch_step(ops: list[MetaStep]) -> MetaStep:
    """``MetaStep(None, BATCH_SEND_RECV, None, ops)`` without the argument checks, for send and
    receive steps lowering made (half a million per assembly of a large job); the sub-steps become
    a tuple, as the checked constructor makes them."""
    return unchecked_step(None, _T.BATCH_SEND_RECV, None, tuple(ops))


@dataclass(frozen=True, slots=True)
class PartComms:
    """A compute part's messages with other ranks: (step kind, peer rank) of each value it
    receives and of each it sends, in ``consumes`` / ``produces`` order."""

    recvs: tuple[tuple[MetaStepType, int], ...]
    sends: tuple[tuple[MetaStepType, int], ...]


def part_comms(part: MetaStep, rank: int, stage_to_rank: dict[int, int]) -> PartComms:
    """What ``part``, a compute step of ``rank`` whose stage is in ``stage_to_rank``, receives from
    and sends to other ranks; the same for every part of its kind and stage with a micro-batch."""
    num_stages = len(stage_to_rank)
    recvs = []
    for key in consumes(part, num_stages):
        if stage_to_rank.get(key[1], rank) != rank:
            kind = _T.FWD_RECV if key[0] == "F" else _T.BWD_RECV
            recvs.append((kind, peer_rank(MetaStep(part.micro_index, kind, part.stage_index), stage_to_rank)))
    sends = []
    for key in produces(part):
        peer = stage_to_rank.get(consumer_stage(key)) if key[0] in ("F", "G") else None
        if peer is not None and peer != rank:
            sends.append((_T.FWD_SEND if key[0] == "F" else _T.BWD_SEND, peer))
    return PartComms(tuple(recvs), tuple(sends))
