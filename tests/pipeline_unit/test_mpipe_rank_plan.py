"""Issue 22 for MPipe: one rank's list with its MPipe steps, planned in time linear in the job.

The whole-job path (``lower``, ``model.place_mpipe_steps``, ``model.check_mpipe``) is the oracle:
every rank's planned list must equal its list there, over every option MPipe has; the places the
timed run picks must let the whole job finish in the MPipe timed model under any costs; and the
rank's own check must refuse broken lists."""

from __future__ import annotations

import itertools
import random

import pytest

from hyper_parallel.core.pipeline_parallel.features.mpipe import model
from hyper_parallel.core.pipeline_parallel.features.mpipe.plan import MPipePlan
from hyper_parallel.core.pipeline_parallel.features.mpipe.rank_plan import check_rank_mpipe, plan_mpipe_rank
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStepType as T
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError
from hyper_parallel.core.pipeline_parallel.schedule import _forwards_only
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost


def _job(p, v, m, plan, forward_only, prefetch, costs=None, pre=None):
    placement = looped_placement(p, v)
    compute = model.body_schedule(p, v, m)
    if forward_only:
        compute = _forwards_only(compute)
    body = lower(compute, placement, "plain", metadata="first", prefetch=prefetch)
    whole = model.place_mpipe_steps(body, placement, plan, forward_only, costs, pre)
    model.check_mpipe(whole, placement, plan, forward_only)  # the whole job finishes in the MPipe model
    return compute, placement, whole


def _plans(p, m):
    for mode, backward, compute in itertools.product(("full", "min"), ("recompute", "owner", None), (True, False)):
        if backward is None or compute:
            yield MPipePlan(p, m, mode, True, compute, backward, ship_inputs=backward == "recompute" and mode == "min")


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_each_rank_plans_the_list_the_whole_job_path_makes(p):
    checked = 0
    for v, forward_only, prefetch in itertools.product((1, 2, 3), (False, True), (False, True)):
        for m in sorted({1, p, p + 1, 2 * p + 1}):
            if v > 1 and m < p:
                continue
            for plan in _plans(p, m):
                compute, placement, whole = _job(p, v, m, plan, forward_only, prefetch)
                for rank in range(p):
                    own = plan_mpipe_rank(compute, placement, rank, plan, metadata="first", prefetch=prefetch,
                                          forward_only=forward_only)
                    assert own == whole[rank], (p, v, m, plan, forward_only, prefetch, rank)
                    checked += 1
    assert checked > 100


def _random_costs(rng, stages):
    return CostModel(stages=tuple(StageCost(F=rng.uniform(0.1, 3), B=rng.uniform(0.2, 6)) for _ in range(stages)),
                     p2p_latency_ms=rng.choice([0.0, 0.05, 1.0, 4.0]))


def test_timed_places_let_the_job_finish_under_any_costs():
    """The placement's argument (placement.py): whatever the costs, the places it picks make no
    deadlock; the whole job runs to its end in the MPipe timed model, and each rank's own plan
    agrees with the whole job's under those costs."""
    rng = random.Random(22)
    for _ in range(60):
        p, v = rng.randint(2, 5), rng.randint(1, 3)
        m = rng.randint(p + 1, 4 * p)
        plan = MPipePlan(p, m, "full", True, True, rng.choice(["recompute", "owner", None]))
        costs = _random_costs(rng, p * v)
        pre = StageCost(F=rng.choice([0.0, 0.3, 1.0, 5.0]), B=rng.uniform(0, 4))
        prefetch = rng.random() < 0.5
        compute, placement, whole = _job(p, v, m, plan, False, prefetch, costs, pre)
        model.run_mpipe(whole, placement, plan, costs, pre)
        for rank in range(p):
            assert plan_mpipe_rank(compute, placement, rank, plan, metadata="first", prefetch=prefetch,
                                   costs=costs, preprocess=pre) == whole[rank]


def test_the_places_fill_idle_time_before_the_forward_needs_them():
    """p = 4, v = 2, m = 12 (owners 1-3 each own two overflow micro-batches): the timed places
    finish no later than the structural ones (a round ahead, no timed run)."""
    p, v, m = 4, 2, 12
    plan = MPipePlan(p, m, "full", True, True, None)
    placement = looped_placement(p, v)
    body = lower(model.body_schedule(p, v, m), placement, "plain", metadata="first")
    timed = model.run_mpipe(model.place_mpipe_steps(body, placement, plan), placement, plan)
    structural = model.run_mpipe(model.insert_mpipe_steps(body, placement, plan), placement, plan)
    assert timed.makespan <= structural.makespan


# ---------------------------------------------------------------------- the rank's check can fail


def _planned(p=3, v=1, m=8, backward="owner"):
    plan = MPipePlan(p, m, "full", True, True, backward)
    compute, placement, whole = _job(p, v, m, plan, False, False)
    return plan, placement, {r: list(steps) for r, steps in whole.items()}


def _move(steps, text, to):
    step = MetaStep.from_str(text)
    steps.remove(step)
    steps.insert(to, step)


def test_the_planned_lists_pass_the_rank_check():
    plan, placement, lists = _planned()
    for rank in lists:
        check_rank_mpipe(lists, rank, placement, plan)


@pytest.mark.parametrize("rank, breakage, text", [
    (0, lambda s: s.remove(MetaStep.from_str("RECV_P.m1")), "RECV_P.m1 is missing"),
    (1, lambda s: s.append(MetaStep.from_str("PF.m2")), "PF.m2 is not expected on rank 1"),
    (1, lambda s: s.append(MetaStep.from_str("PF.m1")), "PF.m1 appears twice"),
    (1, lambda s: _move(s, "SEND_P.m4", 0), "SEND_P.m4 must follow PF.m4"),
    (0, lambda s: _move(s, "RECV_P.m1", len(s) - 1), "RECV_P.m1 must come before F.s0.m1"),
    (0, lambda s: _move(s, "RECV_P.m1", 0), "needs the shapes of PF.m0"),
    (0, lambda s: _move(s, "PB.m0", 0), "PB.m0 must follow the stage-0 backward"),
    (0, lambda s: _move(s, "SEND_PG.m1", 0), "SEND_PG.m1 must follow the stage-0 backward"),
    (1, lambda s: _move(s, "PB.m1", s.index(MetaStep.from_str("RECV_PG.m1"))), "PB.m1 must follow RECV_PG.m1"),
])
def test_the_rank_check_refuses_a_broken_list(rank, breakage, text):
    plan, placement, lists = _planned()
    breakage(lists[rank])
    with pytest.raises(ScheduleError, match=text):
        check_rank_mpipe(lists, rank, placement, plan)


def test_the_rank_check_finds_fifo_order_broken_with_a_partner():
    """Rank 1 sends body gradients to rank 0 and its preprocess outputs: moving an MPipe send
    past the next body send breaks first-in-first-out on that channel (seen from either side)."""
    plan, placement, lists = _planned()
    steps = lists[1]
    send = steps.index(MetaStep.from_str("SEND_P.m4"))
    body = next(k for k in range(send + 1, len(steps)) if steps[k].meta_type is T.BWD_SEND)
    _move(steps, "SEND_P.m4", body)
    for rank in (1, 0):
        with pytest.raises(ScheduleError, match="FIFO order from rank 1 to rank 0"):
            check_rank_mpipe({1: steps, 0: lists[0]}, rank, placement, plan)


def test_the_rank_check_refuses_mpipe_messages_out_of_order_with_an_owner_it_does_not_plan():
    """p = 4: rank 2 has no body channel with rank 0, so rank 0's check sees its MPipe receives
    from rank 2 alone; they must come in micro-batch order."""
    plan, placement, lists = _planned(p=4, m=10, backward="recompute")
    steps = lists[0]
    a, b = steps.index(MetaStep.from_str("RECV_P.m2")), steps.index(MetaStep.from_str("RECV_P.m6"))
    steps[a], steps[b] = steps[b], steps[a]
    with pytest.raises(ScheduleError, match="rank 0's messages from rank 2 are not MPipe messages in micro-batch"):
        check_rank_mpipe({0: steps, 1: lists[1], 3: lists[3]}, 0, placement, plan)


def test_a_rank_that_is_not_an_owner_has_no_mpipe_message_with_another_rank():
    plan, placement, lists = _planned(p=4, m=10, backward="recompute")
    lists[2].insert(0, MetaStep.from_str("RECV_P.m1"))
    with pytest.raises(ScheduleError, match="RECV_P.m1 is not expected on rank 2"):
        check_rank_mpipe({2: lists[2]}, 2, placement, plan)


def test_what_the_pass_cannot_plan_is_left_to_the_whole_job_path():
    plan = MPipePlan(2, 4, "full", True, True, "recompute")
    placement = looped_placement(2, 1)
    compute = model.body_schedule(2, 1, 4)
    assert plan_mpipe_rank(compute, placement, "0", plan, metadata="first", prefetch=False) is None
    assert plan_mpipe_rank(compute, placement, 5, plan, metadata="first", prefetch=False) is None
    broken = {r: list(steps) for r, steps in compute.items()}
    broken[1] = [s for s in broken[1] if not (s is not None and s.micro_index == 3 and s.meta_type is T.BWD)]
    assert plan_mpipe_rank(broken, placement, 0, plan, metadata="first", prefetch=False) is None
    stuck = {r: list(steps) for r, steps in compute.items()}
    stuck[1].reverse()  # backwards before their forwards: the job cannot finish
    assert plan_mpipe_rank(stuck, placement, 0, plan, metadata="first", prefetch=False) is None


@pytest.mark.parametrize("scale", [0.0, 1e-12])
def test_no_deadlock_when_steps_take_no_time(scale):
    """Review finding: with zero (or vanishing) costs every time ties, and places chosen by time
    alone put a preprocess after a step that waits on the forward it feeds. The clock entries keep
    it before: the job finishes, and each rank's plan is still the whole job's."""
    p, v, m = 3, 1, 6
    plan = MPipePlan(p, m, "full", True, True, "recompute")
    costs = CostModel(stages=(StageCost(F=scale, B=2 * scale),) * (p * v), p2p_latency_ms=0.0)
    pre = StageCost(F=0.0, B=0.0)
    compute, placement, whole = _job(p, v, m, plan, False, False, costs, pre)  # check_mpipe: the job finishes
    for rank in range(p):
        assert plan_mpipe_rank(compute, placement, rank, plan, metadata="first", prefetch=False, costs=costs,
                               preprocess=pre) == whole[rank]


def test_no_deadlock_when_a_huge_cost_swamps_the_others():
    """Review finding: stage 0's backward costing 1e17 makes 1 ms vanish in the sums."""
    p, v, m = 3, 1, 9
    plan = MPipePlan(p, m, "full", True, True, "recompute")
    stages = (StageCost(F=1.0, B=1e17),) + (StageCost(F=1.0, B=2.0),) * (p * v - 1)
    costs = CostModel(stages=stages, p2p_latency_ms=0.0)
    _job(p, v, m, plan, False, True, costs, StageCost(F=1.0, B=2.0))


@pytest.mark.parametrize("p, v, m, metadata", [(2, 1, 5, "first"), (3, 1, 8, "first"), (4, 2, 9, "none"),
                                              (3, 3, 7, "all"), (5, 1, 13, "first"), (4, 1, 4, "all")])
def test_the_timed_run_carries_the_clock_entries_of_stage_zeros_rank(p, v, m, metadata):
    """The MPipe pass takes ``Flow.run`` of stage 0's rank and of its own from the timed run where
    the metadata waits sit at the same places in both (one run of the job, not three): the entries
    must be the same."""
    from hyper_parallel.core.pipeline_parallel.features.mpipe.placement import preprocess_costs, time_job
    from hyper_parallel.core.pipeline_parallel.lowering.flow import flow_of

    placement = looped_placement(p, v)
    compute = model.body_schedule(p, v, m)
    plan = MPipePlan(p, m, "full", True, True, "recompute")
    rng = random.Random(p * 100 + m)
    costs, pre = preprocess_costs(plan, placement, _random_costs(rng, p * v), None)
    flow = flow_of(compute, placement, m, metadata, False)
    for rank in range(p):
        timing = time_job(flow, plan, costs, pre, rank)
        assert not timing.made_twice
        assert timing.follows.keys() == {0, rank}
        for tracked, entries in timing.follows.items():
            natural = flow.run(tracked)
            if flow.meta_early == flow.meta_gap:
                assert entries == natural
            else:  # stricter waits: entries at least the natural ones
                assert all(entries[key] >= entry for key, entry in natural.items())


def test_a_value_made_twice_is_left_to_the_whole_job_path():
    """With overflow micro-batches the timed run stands in for ``Flow.run`` of stage 0's rank,
    which refuses a value made twice; the pass must refuse it too (the whole job reports it)."""
    p, v, m = 4, 1, 10
    placement = looped_placement(p, v)
    compute = {r: list(steps) for r, steps in model.body_schedule(p, v, m).items()}
    # on a rank without body messages to or from stage 0's rank, so nothing else in stage 0's plan sees it
    twice = next(s for s in compute[2] if s is not None and s.meta_type is T.FWD and s.micro_index == 2)
    compute[2].insert(compute[2].index(twice) + 1, twice)  # every value still made, one of them twice
    plan = MPipePlan(p, m, "full", True, True, "recompute")
    for rank in range(p):
        assert plan_mpipe_rank(compute, placement, rank, plan, metadata="first", prefetch=True) is None
