"""One rank's lowered, checked list, in time linear in the job.

``lower`` and ``validate_lowered`` work on the whole job: lowering runs the job model with vector
clocks (one entry per rank) to find where a receive may be posted early, validation runs it
again to prove the job finishes; each is O(job x ranks) in time and memory. A rank needs only its
own list, and two of the lowerings follow from one pass over the compute lists (``flow.py``):

- ``plain`` on gloo's eager engine. A send never waits there, so a rank waits only where it
  consumes a value received from another rank (the compute step; a ``RECV_META`` the runtime
  waits for). Lowering puts every send right after the step that made its value, ahead of any
  wait of that gap, and every wait no later than the step that needs it. So the lowered job
  finishes exactly when the compute job finishes in which each step also waits for the values
  whose ``RECV_META`` lowering put in its gap; ``Flow.run`` executes that job (with the waits
  where prefetch may pull them at the earliest, the strictest case, when they differ) or finds it
  stuck. Where prefetch may post a receive early is the eager job model's clock entry of the
  receiving rank (the last compute step of that rank the send follows): one number per value,
  carried along the same pass. The rest (sends, receives, metadata, FIFO numbering) reads only
  the rank's and its neighbours' compute lists, so ``plan_rank`` runs ``p2p.py``'s own code on
  those: the list is the one ``lower`` makes for that rank.
- ``batch`` with ``prefetch`` (NCCL/HCCL, or gloo): ``levels.py``, free of deadlock by
  construction; its lists are ``lower``'s for the same options.

The pass checks the compute lists as ``validate_compute`` does (step kinds, placement, ranges,
each value made once, counts, order); the rank's list is then checked against what was modelled
(``rank_checks.py``). Anything the pass does not handle or cannot prove returns ``None``: the
caller lowers and validates the whole job as before, which reports the problem with the usual
``ScheduleError`` (so errors are unchanged).
"""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType, Schedule, message_key
from hyper_parallel.core.pipeline_parallel.lowering import levels, p2p, rank_checks
from hyper_parallel.core.pipeline_parallel.lowering.flow import Flow, counts_complete, flow_of
from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc

_T = MetaStepType


def plan_rank(
    compute: Schedule,
    stage_to_rank: dict[int, int],
    rank: int,
    num_microbatches: int,
    transport: str = "plain",
    *,
    metadata: str = "none",
    prefetch: bool = False,
    forward_only: bool = False,
) -> list[MetaStep] | None:
    """``rank``'s list as ``lower(compute, stage_to_rank, transport, metadata=, prefetch=)[rank]``
    makes it, checked as ``validate_lowered`` would check the whole job: for ``plain`` on gloo's
    eager engine, for ``batch`` with ``prefetch`` (``levels.py``) on either engine. None where this
    pass cannot prove it or does not apply (the caller lowers and validates the whole job then)."""
    if metadata not in p2p.METADATA or transport not in p2p.TRANSPORTS or type(rank) is not int \
            or rank not in compute or type(num_microbatches) is not int or num_microbatches < 1:
        return None  # the whole-job path refuses what is wrong here with its usual message
    if transport == "batch" and not prefetch:
        return None
    with paused_gc():
        flow = flow_of(compute, stage_to_rank, num_microbatches, metadata if transport == "plain" else "none",
                       forward_only)
        if flow is None:
            return None
        if transport == "batch":
            level = flow.run(None, levels=True)
            if level is None or not counts_complete(level, len(stage_to_rank), num_microbatches, forward_only):
                return None
            own = levels.rank_list(flow, rank, level, metadata)
            rank_checks.check_levels_list(own, rank, flow, level, metadata)
            return own
        lists = plain_lists(flow, compute, [rank], num_microbatches, metadata=metadata, prefetch=prefetch,
                            forward_only=forward_only)
        return None if lists is None else lists[rank]


def plain_lists(flow: Flow, compute: Schedule, ranks: list[int], num_microbatches: int, *, metadata: str,
                prefetch: bool, forward_only: bool, early_proved: bool = False,
                runs: dict[int, dict[DataKey, int]] | None = None) -> dict[int, list[MetaStep]] | None:
    """The ``plain`` lists of ``ranks`` (each as ``plan_rank`` makes it) from one flow of the job;
    ``early_proved``: the caller ran the job with the metadata waits at their earliest places;
    ``runs``: rank -> what ``flow.run(rank)`` returns, where the caller has it already."""
    stage_to_rank = flow.stage_to_rank
    lists: dict[int, list[MetaStep]] = {}
    for rank in ranks:
        made = runs[rank] if runs and rank in runs else flow.run(rank)
        if made is None or not counts_complete(made, len(stage_to_rank), num_microbatches, forward_only):
            return None
        if prefetch and not early_proved and flow.meta_early != flow.meta_gap and flow.run(rank, "early") is None:
            return None  # the strictest waits prefetch can make may not finish: the whole-job check decides
        early_proved = True
        own = _lower_rank(compute, stage_to_rank, rank, metadata, prefetch, made)
        rank_checks.check_plain_list(own, rank, flow)
        lists[rank] = own
    return lists


def _lower_rank(compute: Schedule, stage_to_rank: dict[int, int], rank: int, metadata: str, prefetch: bool,
                depends: dict[DataKey, int]) -> list[MetaStep]:
    """``p2p._lower`` for the plain transport, on ``rank`` and the ranks it talks to only."""
    peers = {stage_to_rank[s + d] for s, r in stage_to_rank.items() if r == rank for d in (-1, 1)
             if s + d in stage_to_rank}
    plans = {r: p2p._plan_rank(r, compute[r], stage_to_rank) for r in sorted(peers | {rank})}
    for plan in plans.values():
        plan.eager = True
    p2p._add_metadata(plans, metadata)
    p2p._number_fifo(plans)
    plan = plans[rank]
    for recv in plan.recvs:
        recv.wanted_gap = recv.natural_gap
        if not (prefetch or metadata != "none"):
            continue
        key = message_key(recv.step)
        if key[0] == "M":
            key = ("F", *key[1:])
        recv.depends_on = depends[key]  # the eager clock of its send, at this rank's entry
        if prefetch and not recv.needs_meta and not recv.step.meta_type.is_meta:
            if recv.natural_gap - 1 > recv.depends_on:
                recv.wanted_gap = recv.natural_gap - 1
    p2p._place_recvs(plan)
    return p2p._assemble(plan, p2p._emit_plain)
