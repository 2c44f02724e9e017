"""One rank's MPipe list, planned and checked in time linear in the job (gloo's eager engine).

The whole-job path lowers every rank, places the MPipe steps (``model.place_mpipe_steps``) and
runs the whole job in the MPipe timed model (``model.check_mpipe``). A rank needs its own list,
and what it depends on is small:

- the body lists (``lowering/rank_plan.plain_lists``, one flow of the job read once) of this
  rank, and of stage 0's rank where this rank exchanges body messages with it: an MPipe message
  takes its place among the body messages of its pair of ranks (first in, first out). Stage 0's
  rank also needs the ranks it exchanges body messages with, but only the order of their compute
  steps and messages, which their plainest lowering has. A rank with no body message to or from
  stage 0's rank needs of stage 0's list only its MPipe steps and forward positions, which the
  compute list gives;
- the places of the overflow preprocesses of those owners, from one timed run of the compute
  job (``placement.py``), which the whole-job path takes too; the same run proves that they
  make no deadlock (``placement.py`` says why), and, with the body's own proof (``flow.py``),
  that the job finishes on the eager engine. Without overflow micro-batches every preprocess
  runs first on its owner or in line on stage 0's rank, and a preprocess backward on an owner
  comes after all its body steps: no wait they add can close a cycle;
- ``plan.insert_mpipe_steps`` on those lists: the same code as the whole job's, so this rank's
  list is the one the whole-job path makes for it.

`check_rank_mpipe` then checks the rank's MPipe steps as ``plan.check_mpipe_steps`` checks the
whole job's: the steps the plan gives this rank, each once, in an order the runtime can run,
and first-in-first-out with the lists planned here. Every rank checks its own, so together they
check every pair. None where a part cannot be proved: the caller plans the whole job then, which
reports the problem with the usual ``ScheduleError``.
"""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.features.mpipe.placement import overflow_slots, preprocess_costs, time_job
from hyper_parallel.core.pipeline_parallel.features.mpipe.plan import (
    MPIPE_TYPES,
    MPipePlan,
    channel_ops,
    insert_mpipe_steps,
    overflow_micros,
)
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType, Schedule
from hyper_parallel.core.pipeline_parallel.lowering.flow import flow_of
from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc
from hyper_parallel.core.pipeline_parallel.lowering.rank_plan import _lower_rank, plain_lists
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost

_T = MetaStepType


def plan_mpipe_rank(compute: Schedule, stage_to_rank: dict[int, int], rank: int, plan: MPipePlan, *,
                    metadata: str, prefetch: bool, forward_only: bool = False, costs: CostModel | None = None,
                    preprocess: StageCost | None = None) -> list[MetaStep] | None:
    """``rank``'s lowered list with its MPipe steps, equal to what the whole-job path makes
    (``lower`` with ``plain``, then ``model.place_mpipe_steps``), checked for gloo's eager
    engine; None where this pass cannot prove it (see the module docstring)."""
    num_micro = plan.num_microbatches
    if type(rank) is not int or rank not in compute or sorted(compute) != list(range(plan.num_ranks)):
        return None
    plan_run = plan.with_backward(forward_only)
    with paused_gc():
        flow = flow_of(compute, stage_to_rank, num_micro, metadata, forward_only)
        if flow is None:
            return None
        zero = stage_to_rank[0]
        talks = {pair for pair, sent in flow.channels.items() if sent}
        partners = {q for pair in talks if zero in pair for q in pair} - {zero}
        needed = {rank} | ({zero} if rank in partners else set())
        costs, preprocess = preprocess_costs(plan, stage_to_rank, costs, preprocess)
        timing, runs = None, None
        if overflow_micros(plan_run, zero):
            # the timed run places the overflow preprocesses; it runs the job with the earliest metadata
            # waits (which proves them), and where those are the natural ones its clock entries of stage
            # 0's rank and of this rank are what ``Flow.run`` returns for them: one run of the job, not three
            timing = time_job(flow, plan_run, costs, preprocess, rank)
            if timing is None:
                return None  # the job cannot finish with those waits: the whole-job check decides
            if flow.meta_early == flow.meta_gap and not timing.made_twice:
                runs = timing.follows
        lists = plain_lists(flow, compute, sorted(needed), num_micro, metadata=metadata, prefetch=prefetch,
                            forward_only=forward_only, early_proved=timing is not None, runs=runs)
        if lists is None:
            return None
        if rank == zero:
            # stage 0's list depends on a partner's only through the order of its compute steps and of
            # its data messages with stage 0 (where an MPipe message goes among them), which every
            # lowering of it has: the plainest (no metadata, no prefetch) serves, without a run of the job
            for q in partners:
                lists[q] = _lower_rank(compute, stage_to_rank, q, "none", False, {})
        if zero not in lists:
            # a rank without body messages to or from stage 0's rank: stage 0's list matters to it only
            # through the MPipe steps put there for it and the forward positions that bound where its
            # receives go, which its empty body channel always meets; the compute list serves for both
            lists[zero] = list(flow.items[zero])
        slots = None if timing is None else overflow_slots(flow, plan_run, costs, preprocess, lists, timing)
        try:
            out = insert_mpipe_steps(lists, stage_to_rank, plan, forward_only, slots, partial=True)
            check_rank_mpipe(out, rank, stage_to_rank, plan, forward_only)
        except (ScheduleError, ValueError):
            return None  # the whole-job path reports it
        return out[rank]


def check_rank_mpipe(lowered: dict[int, list[MetaStep]], rank: int, stage_to_rank: dict[int, int], plan: MPipePlan,
                     forward_only: bool = False) -> None:
    """Raise ScheduleError unless ``rank``'s list holds the MPipe steps the plan gives it, each
    once, in an order the runtime can run, and every pair of ranks in ``lowered`` with ``rank``
    sends and receives its messages in the same order (see the module docstring)."""
    plan = plan.with_backward(forward_only)
    zero = stage_to_rank[0]
    steps = lowered[rank]
    where: dict[tuple[MetaStepType, int], int] = {}
    for k, step in enumerate(steps):
        if step.meta_type in MPIPE_TYPES:
            key = (step.meta_type, step.micro_index)
            if key in where:
                raise ScheduleError(f"{step} appears twice", lowered, [(rank, where[key]), (rank, k)])
            where[key] = k
        for part in step.parts:
            if part.stage_index == 0 and part.meta_type in (_T.FWD, _T.BWD, _T.BWD_INPUT):
                where.setdefault((_T.FWD if part.meta_type is _T.FWD else _T.BWD, part.micro_index), k)
    expected = set()
    order: list[tuple[tuple[MetaStepType, int], tuple[MetaStepType, int], str]] = []  # (earlier, later, why)
    for j in range(plan.num_microbatches):
        owner = plan.owner(j)
        if rank == owner:
            expected.add((_T.PRE_FWD, j))
        if owner != zero and rank == owner:
            expected.add((_T.PRE_SEND, j))
            order.append(((_T.PRE_FWD, j), (_T.PRE_SEND, j), f"SEND_P.m{j} must follow PF.m{j}"))
        if rank == zero:
            if owner == zero:
                order.append(((_T.PRE_FWD, j), (_T.FWD, j), f"PF.m{j} must come before F.s0.m{j}"))
            else:
                expected.add((_T.PRE_RECV, j))
                order.append(((_T.PRE_RECV, j), (_T.FWD, j), f"RECV_P.m{j} must come before F.s0.m{j}"))
                order.append(((_T.PRE_FWD, 0), (_T.PRE_RECV, j), f"RECV_P.m{j} needs the shapes of PF.m0 before it"))
        if plan.backward is None:
            continue
        if owner == zero or plan.backward == "recompute":
            if rank == zero:
                expected.add((_T.PRE_BWD, j))
                order.append(((_T.BWD, j), (_T.PRE_BWD, j),
                              f"PB.m{j} must follow the stage-0 backward of micro-batch {j}"))
            continue
        if rank == zero:
            expected.add((_T.PRE_GRAD_SEND, j))
            order.append(((_T.BWD, j), (_T.PRE_GRAD_SEND, j),
                          f"SEND_PG.m{j} must follow the stage-0 backward of micro-batch {j}"))
        if rank == owner:
            expected |= {(_T.PRE_GRAD_RECV, j), (_T.PRE_BWD, j)}
            order.append(((_T.PRE_FWD, j), (_T.PRE_GRAD_RECV, j), f"RECV_PG.m{j} must follow PF.m{j}"))
            order.append(((_T.PRE_GRAD_RECV, j), (_T.PRE_BWD, j), f"PB.m{j} must follow RECV_PG.m{j}"))
    found = {key for key in where if key[0] in MPIPE_TYPES}
    for kind, j in sorted(expected - found, key=lambda key: (key[1], key[0].code)):
        raise ScheduleError(f"MPipe: {MetaStep(j, kind, None)} is missing (expected on rank {rank})", lowered, [])
    for kind, j in sorted(found - expected, key=lambda key: (key[1], key[0].code)):
        raise ScheduleError(f"MPipe: {MetaStep(j, kind, None)} is not expected on rank {rank}", lowered,
                            [(rank, where[(kind, j)])])
    for earlier, later, why in order:
        if where[earlier] >= where[later]:
            raise ScheduleError(f"MPipe: {why}", lowered, [(rank, where[earlier]), (rank, where[later])])
    _check_channels(lowered, rank, stage_to_rank, plan)


def _check_channels(lowered: dict[int, list[MetaStep]], rank: int, stage_to_rank: dict[int, int],
                    plan: MPipePlan) -> None:
    """First in, first out on every channel of ``rank`` with a rank planned here (stage 0's rank,
    and on it every rank it talks to in the body): the k-th send carries what the k-th receive
    expects. Stage 0's rank's other channels carry MPipe messages only, in micro-batch order;
    the other ranks' other channels body messages only, whose order ``rank_checks`` checked."""
    mine: dict[tuple[bool, int], list[tuple[object, int]]] = {}
    for k, step in enumerate(lowered[rank]):
        for is_send, peer, key in channel_ops(step, stage_to_rank, plan):
            mine.setdefault((is_send, peer), []).append((key, k))
    for (is_send, peer), ops in sorted(mine.items()):
        if peer in lowered:
            theirs = [key for k, step in enumerate(lowered[peer])
                      for sends, other, key in channel_ops(step, stage_to_rank, plan)
                      if other == rank and sends != is_send]
            ours = [key for key, _ in ops]
            src, dst = (rank, peer) if is_send else (peer, rank)
            if ours != theirs:
                n = next((n for n, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                raise ScheduleError(f"MPipe: FIFO order from rank {src} to rank {dst} differs at message #{n + 1}: "
                                    f"rank {rank} has {ours[n] if n < len(ours) else 'none'}, rank {peer} "
                                    f"{theirs[n] if n < len(theirs) else 'none'}", lowered,
                                    [(rank, ops[min(n, len(ops) - 1)][1])])
            continue
        keys = [key for key, _ in ops]
        if rank == stage_to_rank[0]:  # an owner without body messages here: its MPipe messages, in order
            if any(key[0] not in ("P", "D") for key in keys) or keys != sorted(keys):  # type: ignore[index]
                raise ScheduleError(f"MPipe: rank {rank}'s messages {'to' if is_send else 'from'} rank {peer} are "
                                    f"not MPipe messages in micro-batch order: {keys[:6]}", lowered, [(rank, ops[0][1])])
        elif any(key[0] in ("P", "D") for key in keys):  # type: ignore[index]
            raise ScheduleError(f"MPipe: rank {rank} has an MPipe message with rank {peer}, which is not stage 0's",
                                lowered, [(rank, ops[0][1])])
