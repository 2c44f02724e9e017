"""Lowering: insert the point-to-point steps a compute-only schedule needs.

Conventions (the runtime relies on them):

- ``SEND_F.s<s>.m<i>``: stage s sends its forward output of micro i to stage s + 1;
- ``RECV_F.s<s>.m<i>``: stage s receives its forward input of micro i from stage s - 1;
- ``SEND_B.s<s>.m<i>``: stage s sends the gradient of its input of micro i to stage s - 1;
- ``RECV_B.s<s>.m<i>``: stage s receives the gradient of its output of micro i from stage s + 1.

Nothing is inserted between adjacent stages on the same rank. A send goes right after the
compute that produced its data (F for SEND_F, B or I for SEND_B). A recv goes right before
the compute that consumes it, except that on every receiving rank the recvs from one peer
are kept in that peer's send order (FIFO matching, as NCCL/HCCL do): the k-th recv is
moved up to the earliest natural position of any later recv from the same peer. Posting a
recv early never adds a wait the natural position did not already have, so the lowered
schedule is deadlock free whenever the compute schedule is.

With ``transport="batch"`` the sends and recvs of one gap between computes are grouped per
peer into one ``BATCH[...]`` step (sends first, then recvs); groups holding a send come
first in the gap so that no send waits behind another peer's recv.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from .ir import DataKey, MetaStep, MetaStepType, Schedule, consumer_stage, consumes, produces

TRANSPORTS = ("plain", "batch")

_T = MetaStepType


def peer_rank(op: MetaStep, stage_to_rank: dict[int, int]) -> int:
    """Rank on the other side of a send/recv step, from the conventions above."""
    if op.stage_index is None or not (op.meta_type.is_send or op.meta_type.is_recv):
        raise ValueError(f"{op} is not a send/recv step with a stage")
    towards_next = op.meta_type in (_T.FWD_SEND, _T.BWD_RECV)
    peer_stage = op.stage_index + (1 if towards_next else -1)
    if peer_stage not in stage_to_rank:
        raise ValueError(f"{op} has no peer: stage {peer_stage} does not exist")
    return stage_to_rank[peer_stage]


@dataclass
class _Recv:
    peer: int
    natural_gap: int
    step: MetaStep
    fifo_index: float = float("inf")
    gap: int = -1


@dataclass
class _RankPlan:
    items: list[MetaStep]
    sends: dict[int, list[tuple[int, MetaStep]]] = field(default_factory=lambda: defaultdict(list))
    recvs: list[_Recv] = field(default_factory=list)


def lower(
    compute: Schedule, stage_to_rank: dict[int, int], transport: str = "plain"
) -> dict[int, list[MetaStep]]:
    """Insert FWD/BWD send and recv steps (see module docstring); idle slots are dropped."""
    if transport not in TRANSPORTS:
        valid = ", ".join(TRANSPORTS)
        raise ValueError(f"unknown transport {transport!r}; valid transports: {valid}")
    plans = {r: _plan_rank(r, steps, stage_to_rank) for r, steps in sorted(compute.items())}
    _apply_fifo_order(plans)
    emit = _emit_batch if transport == "batch" else _emit_plain
    return {rank: _assemble(plan, emit) for rank, plan in plans.items()}


def _check_stage(step: MetaStep, stage_to_rank: dict[int, int]) -> None:
    if step.stage_index not in stage_to_rank:
        raise ValueError(f"step {step}: stage {step.stage_index} is not in stage_to_rank")


def _plan_rank(rank: int, steps: list[MetaStep | None], stage_to_rank: dict[int, int]) -> _RankPlan:
    """Natural positions: gap g sits before item g; sends of item g go to gap g + 1."""
    num_stages = len(stage_to_rank)
    plan = _RankPlan(items=[step for step in steps if step is not None])
    for index, step in enumerate(plan.items):
        if step.meta_type.is_comm:
            raise ValueError(
                f"rank {rank}: {step} is already a communication step; lower compute-only lists"
            )
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


def _apply_fifo_order(plans: dict[int, _RankPlan]) -> None:
    """Give each recv its FIFO index and its final gap (suffix minimum of natural gaps)."""
    send_order: dict[tuple[int, int], dict[MetaStep, int]] = defaultdict(dict)
    for rank, plan in plans.items():
        for gap in sorted(plan.sends):
            for peer, send in plan.sends[gap]:
                order = send_order[(rank, peer)]
                order.setdefault(send, len(order))
    for rank, plan in plans.items():
        by_peer: dict[int, list[_Recv]] = defaultdict(list)
        for recv in plan.recvs:
            sends = send_order.get((recv.peer, rank), {})
            recv.fifo_index = sends.get(counterpart(recv.step), float("inf"))
            recv.gap = recv.natural_gap
            by_peer[recv.peer].append(recv)
        for recvs in by_peer.values():
            matched = [r for r in recvs if r.fifo_index != float("inf")]
            matched.sort(key=lambda r: r.fifo_index)
            earliest = len(plan.items)
            for recv in reversed(matched):
                earliest = min(earliest, recv.natural_gap)
                recv.gap = earliest


def counterpart(op: MetaStep) -> MetaStep:
    """The step on the peer that matches a send/recv: SEND_F.s<s> <-> RECV_F.s<s+1>,
    SEND_B.s<s> <-> RECV_B.s<s-1> (same micro-batch)."""
    if op.stage_index is None:
        raise ValueError(f"{op} has no stage")
    pairs = {
        _T.FWD_SEND: (_T.FWD_RECV, 1),
        _T.FWD_RECV: (_T.FWD_SEND, -1),
        _T.BWD_SEND: (_T.BWD_RECV, -1),
        _T.BWD_RECV: (_T.BWD_SEND, 1),
    }
    if op.meta_type not in pairs:
        raise ValueError(f"{op} is not a send/recv step")
    kind, shift = pairs[op.meta_type]
    return MetaStep(op.micro_index, kind, op.stage_index + shift)


_Emit = Callable[[list[tuple[int, MetaStep]], list[_Recv]], list[MetaStep]]


def _assemble(plan: _RankPlan, emit: _Emit) -> list[MetaStep]:
    recvs_at: dict[int, list[_Recv]] = defaultdict(list)
    for recv in plan.recvs:
        recvs_at[recv.gap].append(recv)
    out: list[MetaStep] = []
    for gap in range(len(plan.items) + 1):
        out += emit(plan.sends.get(gap, []), _order_recvs(recvs_at.get(gap, [])))
        if gap < len(plan.items):
            out.append(plan.items[gap])
    return out


def _order_recvs(recvs: list[_Recv]) -> list[_Recv]:
    """Peers by urgency (earliest natural consumer), each peer's recvs in FIFO order."""
    urgency: dict[int, tuple[int, int]] = {}
    for recv in recvs:
        here = (recv.natural_gap, recv.peer)
        urgency[recv.peer] = min(urgency.get(recv.peer, here), here)
    return sorted(recvs, key=lambda r: (urgency[r.peer], r.fifo_index, r.natural_gap))


def _emit_plain(sends: list[tuple[int, MetaStep]], recvs: list[_Recv]) -> list[MetaStep]:
    return [send for _, send in sends] + [recv.step for recv in recvs]


def _emit_batch(sends: list[tuple[int, MetaStep]], recvs: list[_Recv]) -> list[MetaStep]:
    groups: dict[int, list[MetaStep]] = {}
    for peer, send in sends:
        groups.setdefault(peer, []).append(send)
    for recv in recvs:
        groups.setdefault(recv.peer, []).append(recv.step)
    return [MetaStep(None, _T.BATCH_SEND_RECV, None, ops) for ops in groups.values()]
