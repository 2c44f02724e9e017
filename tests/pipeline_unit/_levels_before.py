# ruff: noqa
# Frozen copy of lowering/levels.py as of cd39060, the oracle for the speed test
# (test_levels_speed_equal.py). Do not edit.
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

from collections import defaultdict

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType, Schedule, consumer_stage
from _flow_before import Flow, flow_of

_T = MetaStepType


def lower_by_levels(compute: Schedule, stage_to_rank: dict[int, int], metadata: str) -> dict[int, list[MetaStep]] | None:
    """Every rank's batch lists, or None where the compute lists hold something
    the flow does not model or cannot finish (lowering them the old way lets validation say what)."""
    micros = [step.micro_index for steps in compute.values() for step in steps if step is not None]
    num_micro = max((i for i in micros if type(i) is int), default=-1) + 1
    flow = flow_of(compute, stage_to_rank, num_micro, "none", False)
    if flow is None:
        return None
    level = flow.run(None, levels=True)
    if level is None:
        return None
    return {rank: rank_list(flow, rank, level, metadata) for rank in sorted(flow.items)}


def carried(flow: Flow, level: dict[DataKey, int], metadata: str, rank: int) -> set[DataKey]:
    """Forward values to or from ``rank`` whose shapes travel ahead of them: the first *sent* of each
    stage boundary (``"first"``: the receiver makes every later buffer of that boundary from those
    shapes, so no data receive of it may come before them) or every one (``"all"``)."""
    out: set[DataKey] = set()
    if metadata == "none":
        return out
    for (sender, receiver), sent in flow.channels.items():
        if rank not in (sender, receiver):
            continue
        if metadata == "all":
            out.update(key for key in sent if key[0] == "F")
            continue
        first: dict[int, tuple[int, DataKey]] = {}  # stage -> (boundary, value): the earliest, then the first made
        for key in sent:
            if key[0] == "F":
                t = boundary(flow, level, key)
                if key[1] not in first or t < first[key[1]][0]:
                    first[key[1]] = (t, key)
        out.update(key for _, key in first.values())
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


def rank_list(flow: Flow, rank: int, level: dict[DataKey, int], metadata: str) -> list[MetaStep]:
    """``rank``'s lowered list (see the module docstring)."""
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
