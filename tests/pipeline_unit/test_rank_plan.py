"""Issue 22: one rank's plan for gloo's eager engine (``lowering/rank_plan.py``).

- it is the very list ``lower(..., "plain")`` makes for that rank, over every library schedule,
  small p, v, m, prefetch on and off, each metadata mode, training and forward-only; for
  ``batch`` with prefetch, the list of ``lower``'s levels lowering (``levels.py``), which
  ``validate_lowered`` accepts on both engines;
- it never accepts what the whole-job check refuses: over shuffled, cut and misplaced compute
  lists, whenever ``plan_rank`` gives a list, whole-job lowering and ``validate_lowered`` accept
  the job and give the same list; where it cannot prove a plan it says so (None) and the
  schedule falls back to the whole-job check, whose error is unchanged;
- its check of the rank's list refuses lists that differ from what it modelled.
"""

from __future__ import annotations

import random

import pytest
from test_pp_lowering_oracle import OPTIONS, SCHEDULES, _compute, _configs

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering import rank_checks
from hyper_parallel.core.pipeline_parallel.lowering.flow import flow_of
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.lowering.rank_plan import plan_rank
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError, validate_lowered
from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B, ScheduleInterleaved1F1B, _forwards_only

T = MetaStepType


@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("cls,chunks,fuse", SCHEDULES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_each_rank_gets_the_list_whole_job_lowering_gives_it(cls, chunks, fuse, transport):
    """plain: every option; batch: with prefetch (the levels lowering), accepted on both engines."""
    checked = 0
    for p, v, m in _configs(cls, chunks):
        compute, placement = _compute(cls, p, v, m, fuse)
        for forward_only, prefetch, metadata in OPTIONS:
            prefetch = prefetch or transport == "batch"
            lists = _forwards_only(compute) if forward_only else compute
            want = lower(lists, placement, transport, metadata=metadata, prefetch=prefetch)
            if transport == "batch":
                for engine in ("stream", "eager"):
                    validate_lowered(want, placement, m, "batch", forward_only, engine=engine)
            for rank in lists:
                got = plan_rank(lists, placement, rank, m, transport, metadata=metadata, prefetch=prefetch,
                                forward_only=forward_only)
                assert got == want[rank], (cls.__name__, p, v, m, metadata, prefetch, forward_only, rank)
                checked += 1
    assert checked >= 200


def test_batch_without_prefetch_is_left_to_the_whole_job():
    compute, placement = Schedule1F1B.generate(3, 1, 4), Schedule1F1B.stage_placement(3, 1)
    assert plan_rank(compute, placement, 0, 4, "batch", metadata="first", prefetch=False) is None
    assert plan_rank(compute, placement, 0, 4, "nccl", metadata="first", prefetch=True) is None


def _mutated(compute, rng, num_micro):
    """The lists with a step moved, dropped, doubled or given to the wrong rank or micro-batch."""
    out = {rank: list(steps) for rank, steps in compute.items()}
    rank = rng.choice(sorted(out))
    steps = out[rank]
    what = rng.choice(["move", "move", "move", "drop", "double", "rank", "micro", "swap_ranks"])
    k = rng.randrange(len(steps))
    if what == "move":
        steps.insert(rng.randrange(len(steps)), steps.pop(k))
    elif what == "drop":
        steps.pop(k)
    elif what == "double":
        steps.insert(rng.randrange(len(steps)), steps[k])
    elif what == "rank":
        other = rng.choice(sorted(out))
        out[other].insert(rng.randrange(len(out[other]) + 1), steps.pop(k))
    elif what == "micro" and steps[k].micro_index is not None:
        step = steps[k]
        steps[k] = MetaStep(rng.choice([num_micro, step.micro_index ^ 1]), step.meta_type, step.stage_index)
    else:
        steps.insert(rng.randrange(len(steps)), steps.pop(k))
        steps.insert(rng.randrange(len(steps)), steps.pop(rng.randrange(len(steps))))
    return out


def _whole_job(lists, placement, m, metadata, prefetch, forward_only, transport="plain"):
    """The whole-job plan as before, or the error it raises (batch: checked on both engines)."""
    try:
        lowered = lower(lists, placement, transport, metadata=metadata, prefetch=prefetch)
        for engine in ("eager",) if transport == "plain" else ("stream", "eager"):
            validate_lowered(lowered, placement, m, transport, forward_only, engine=engine)
    except ValueError as exc:
        return exc
    return lowered


@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_it_never_accepts_what_the_whole_job_check_refuses(transport):
    rng = random.Random(2222)
    accepted = refused = 0
    cases = [(cls, p, chunks[-1], fuse) for cls, chunks, fuse in SCHEDULES for p in (2, 3, 4)]
    for cls, p, v, fuse in cases:
        m = max(cls.min_microbatches(p, v), p + 1)
        compute, placement = _compute(cls, p, v, m, fuse)
        for _ in range(12):
            lists = _mutated(compute, rng, m)
            if any(not steps for steps in lists.values()):
                continue
            metadata = rng.choice(["none", "first", "all"])
            prefetch = rng.random() < 0.7 or transport == "batch"
            whole = _whole_job(lists, placement, m, metadata, prefetch, False, transport)
            for rank in lists:
                got = plan_rank(lists, placement, rank, m, transport, metadata=metadata, prefetch=prefetch)
                if got is None:
                    continue
                assert not isinstance(whole, Exception), (cls.__name__, p, v, m, rank, str(whole).splitlines()[0])
                assert got == whole[rank]
                accepted += 1
            refused += isinstance(whole, Exception)
    assert accepted > 100 and refused > 100  # both sides were reached


def test_a_cycle_across_ranks_is_left_to_the_whole_job_check():
    # rank 0 runs B.s0.m0 before F.s0.m1 while rank 1 waits for F.s0.m1 first: a deadlock
    placement = Schedule1F1B.stage_placement(2, 1)
    compute = Schedule1F1B.generate(2, 1, 2)
    compute[1] = [MetaStep(1, T.FWD, 1), MetaStep(0, T.FWD, 1), MetaStep(0, T.BWD, 1), MetaStep(1, T.BWD, 1)]
    compute[0] = [MetaStep(0, T.FWD, 0), MetaStep(0, T.BWD, 0), MetaStep(1, T.FWD, 0), MetaStep(1, T.BWD, 0)]
    for rank in (0, 1):
        assert plan_rank(compute, placement, rank, 2, metadata="first", prefetch=True) is None
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_lowered(lower(compute, placement, "plain", metadata="first", prefetch=True), placement, 2, "plain")


def _flow_and_list(rank=1, cls=ScheduleInterleaved1F1B, p=3, v=2, m=6, metadata="first"):
    compute, placement = cls.generate(p, v, m), cls.stage_placement(p, v)
    flow = flow_of(compute, placement, m, metadata, False)
    own = plan_rank(compute, placement, rank, m, metadata=metadata, prefetch=True)
    rank_checks.check_plain_list(own, rank, flow)  # the list as made passes
    return flow, own


def _index(steps, text):
    return next(k for k, step in enumerate(steps) if str(step) == text)


def _moved(steps, text, to):
    out = list(steps)
    out.insert(to, out.pop(_index(out, text)))
    return out


@pytest.mark.parametrize("change", [
    "drop a receive", "drop a send", "doubled receive", "send a step late", "data send after a shapes wait",
    "receives out of their sender's order", "receive after its consumer", "shapes after their data",
    "shapes wait moved", "a stranger's step"])
def test_the_rank_check_refuses_lists_other_than_the_modelled_one(change):
    flow, own = _flow_and_list()
    recv = next(s for s in own if s.meta_type is T.FWD_RECV and str(s) != "RECV_F.s1.m0")
    send = next(s for s in own if s.meta_type is T.FWD_SEND)
    if change == "drop a receive":
        bad = [s for s in own if s is not recv]
    elif change == "drop a send":
        bad = [s for s in own if s is not send]
    elif change == "doubled receive":
        bad = own[:] + [recv]
    elif change == "send a step late":
        k = own.index(send)
        nxt = next(j for j in range(k + 1, len(own)) if own[j].meta_type.is_compute)
        bad = _moved(own, str(send), nxt)
    elif change == "data send after a shapes wait":
        # F.s1.m2's send after the wait for RECV_META.s4.m0's shapes, in the same gap
        assert _index(own, "SEND_F.s1.m2") + 1 == _index(own, "RECV_META.s4.m0")
        bad = _moved(own, "SEND_F.s1.m2", _index(own, "RECV_META.s4.m0"))
    elif change == "receives out of their sender's order":
        first = _index(own, "RECV_F.s1.m1")
        bad = _moved(own, "RECV_F.s1.m2", first)
    elif change == "receive after its consumer":
        bad = _moved(own, "RECV_F.s1.m2", _index(own, "F.s1.m2") + 1)
    elif change == "shapes after their data":
        bad = _moved(own, "RECV_META.s1.m0", _index(own, "RECV_F.s1.m0") + 1)
    elif change == "shapes wait moved":
        bad = _moved(own, "RECV_META.s4.m0", 0)  # a wait three steps earlier than lowering puts it
    else:
        bad = own[:1] + [MetaStep(0, T.FWD_RECV, 3)] + own[1:]
    with pytest.raises(ScheduleError, match="lowering of rank 1"):
        rank_checks.check_plain_list(bad, 1, flow)


@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_the_schedule_plans_only_its_own_rank_and_exec_order_stays_whole(transport):
    import torch

    from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.local import LocalCluster

    def body():
        rank = get_platform().rank
        stages = [PipelineStage(torch.nn.Linear(2, 2), rank + 2 * c, 4) for c in range(2)]
        schedule = ScheduleInterleaved1F1B(stages, 4, p2p_transport=transport)  # overlap_p2p: the default
        planned = schedule._lowered(schedule._training_metadata())
        return sorted(planned), dict(schedule._job_cache), schedule.exec_order, planned[rank]

    compute, placement = ScheduleInterleaved1F1B.generate(2, 2, 4), ScheduleInterleaved1F1B.stage_placement(2, 2)
    whole = lower(compute, placement, transport, metadata="first", prefetch=True)
    for rank, (planned, job_cache_at_build, exec_order, own) in enumerate(LocalCluster(2, platform="torch").run(body)):
        assert planned == [rank] and job_cache_at_build == {}  # built without the whole job
        assert exec_order == whole and own == whole[rank]


_BATCH_CHANGES = {  # what a broken batch lowering of rank 1 (ScheduleInterleaved1F1B, p=3, v=2, m=6) could give
    "drop a receive": ("BATCH[RECV_F.s1.m0+RECV_F.s1.m1]", "BATCH[RECV_F.s1.m1]"),
    "drop a send": (" BATCH[SEND_F.s1.m1] ", " "),
    "send before its maker": ("F.s1.m1 BATCH[SEND_F.s1.m1]", "BATCH[SEND_F.s1.m1] F.s1.m1"),
    "batches out of order": ("F.s1.m1 BATCH[SEND_F.s1.m1] F.s1.m2 BATCH[SEND_F.s1.m2]",
                             "F.s1.m1 F.s1.m2 BATCH[SEND_F.s1.m2] BATCH[SEND_F.s1.m1]"),
    "batch after a step of its level": ("BATCH[SEND_F.s4.m0+RECV_F.s4.m2] F.s4.m1",
                                        "F.s4.m1 BATCH[SEND_F.s4.m0+RECV_F.s4.m2]"),
    "shapes after their batch": ("RECV_META.s4.m0 BATCH[RECV_F.s4.m0+RECV_F.s4.m1]",
                                 "BATCH[RECV_F.s4.m0+RECV_F.s4.m1] RECV_META.s4.m0"),
    "shapes sent after the data": ("SEND_META.s1.m0 BATCH[SEND_F.s1.m0+RECV_F.s1.m2]",
                                   "BATCH[SEND_F.s1.m0+RECV_F.s1.m2] SEND_META.s1.m0"),
    "a wait for shapes before an earlier step": ("F.s1.m2 BATCH[SEND_F.s1.m2] RECV_META.s4.m0",
                                                 "RECV_META.s4.m0 F.s1.m2 BATCH[SEND_F.s1.m2]"),
    "receives of a channel swapped": ("BATCH[RECV_F.s1.m0+RECV_F.s1.m1]", "BATCH[RECV_F.s1.m1+RECV_F.s1.m0]"),
    "compute steps swapped": ("F.s1.m1 BATCH[SEND_F.s1.m1] F.s1.m2", "F.s1.m2 BATCH[SEND_F.s1.m1] F.s1.m1"),
    "a stranger's receive": ("BATCH[SEND_F.s1.m1]", "BATCH[SEND_F.s1.m1+RECV_F.s3.m0]"),
}


@pytest.mark.parametrize("change", sorted(_BATCH_CHANGES))
def test_the_batch_rank_check_refuses_lists_other_than_the_levels_shape(change):
    from hyper_parallel.core.pipeline_parallel.lowering.levels import rank_list

    compute, placement = ScheduleInterleaved1F1B.generate(3, 2, 6), ScheduleInterleaved1F1B.stage_placement(3, 2)
    flow = flow_of(compute, placement, 6, "none", False)
    level = flow.run(None, levels=True)
    own = rank_list(flow, 1, level, "first")
    rank_checks.check_levels_list(own, 1, flow, level, "first")  # the list as made passes
    text = " " + " ".join(map(str, own)) + " "
    old, new = _BATCH_CHANGES[change]
    assert text.count(old) == 1, change
    bad = [MetaStep.from_str(cell) for cell in text.replace(old, new).split()]
    with pytest.raises(ScheduleError, match="lowering of rank 1"):
        rank_checks.check_levels_list(bad, 1, flow, level, "first")


# ---------------------------------------------------------------------- review findings (issue 22)


def _fused(p=2, v=2, m=4):
    from hyper_parallel.core.pipeline_parallel.schedules.overlap_pairs import fuse_overlap_pairs

    placement = ScheduleInterleaved1F1B.stage_placement(p, v)
    return fuse_overlap_pairs(ScheduleInterleaved1F1B.generate(p, v, m), placement), placement


def test_a_batch_with_two_sends_to_one_peer_in_the_wrong_order_is_refused():
    # an OVERLAP step on the peer consumes both: the receiver expects them in the sender's order
    from hyper_parallel.core.pipeline_parallel.lowering.levels import rank_list

    compute, placement = _fused()
    flow = flow_of(compute, placement, 4, "none", False)
    level = flow.run(None, levels=True)
    own = rank_list(flow, 0, level, "none")
    k = next(k for k, s in enumerate(own) if s.meta_type is T.BATCH_SEND_RECV
             and [op.meta_type for op in s.comm_parts[:2]] == [T.BWD_SEND, T.FWD_SEND])
    ops = list(own[k].comm_parts)
    ops[0], ops[1] = ops[1], ops[0]
    bad = own[:k] + [MetaStep(None, T.BATCH_SEND_RECV, None, ops)] + own[k + 1:]
    with pytest.raises(ScheduleError, match="data sends to rank 1 are not in the order it receives them"):
        rank_checks.check_levels_list(bad, 0, flow, level, "none")


def test_shapes_sent_in_the_wrong_order_are_refused():
    from hyper_parallel.core.pipeline_parallel.lowering.levels import rank_list

    compute, placement = ScheduleInterleaved1F1B.generate(2, 2, 4), ScheduleInterleaved1F1B.stage_placement(2, 2)
    flow = flow_of(compute, placement, 4, "none", False)
    level = flow.run(None, levels=True)
    own = rank_list(flow, 0, level, "all")
    a, b = (k for k, s in enumerate(own) if str(s) in ("SEND_META.s0.m2", "SEND_META.s2.m1"))
    assert b == a + 1
    bad = own[:a] + [own[b], own[a]] + own[b + 1:]
    with pytest.raises(ScheduleError, match="metadata sends to rank 1 are not in the order it receives them"):
        rank_checks.check_levels_list(bad, 0, flow, level, "all")


def test_plain_sends_after_an_overlap_step_in_the_wrong_order_are_refused():
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import peer_rank

    compute, placement = _fused()
    flow = flow_of(compute, placement, 4, "none", False)
    own = plan_rank(compute, placement, 0, 4, prefetch=True)
    k = next(k for k in range(len(own) - 1) if own[k].meta_type.is_send and own[k + 1].meta_type.is_send
             and peer_rank(own[k], placement) == peer_rank(own[k + 1], placement))
    bad = own[:k] + [own[k + 1], own[k]] + own[k + 2:]
    with pytest.raises(ScheduleError, match="sends to rank 1 are not in the order it receives them"):
        rank_checks.check_plain_list(bad, 0, flow)


def test_plain_compute_steps_out_of_order_are_refused():
    compute, placement = Schedule1F1B.generate(2, 1, 2), Schedule1F1B.stage_placement(2, 1)
    flow = flow_of(compute, placement, 2, "none", False)
    own = plan_rank(compute, placement, 1, 2)
    assert [str(s) for s in own[:2]] == ["RECV_F.s1.m0", "F.s1.m0"]
    bad = [own[0], MetaStep(0, T.BWD, 1), MetaStep(0, T.FWD, 1), *[s for s in own[2:] if str(s) != "B.s1.m0"]]
    with pytest.raises(ScheduleError, match="B.s1.m0 is not this rank's next compute step"):
        rank_checks.check_plain_list(bad, 1, flow)


@pytest.mark.parametrize("num_micro, rank", [(2.0, 0), (True, 0), (0, 0), (None, 0), ("2", 0), (2, "0"), (2, [0])])
def test_bad_arguments_are_left_to_the_whole_job_path(num_micro, rank):
    compute, placement = Schedule1F1B.generate(2, 1, 2), Schedule1F1B.stage_placement(2, 1)
    for transport in ("plain", "batch"):
        assert plan_rank(compute, placement, rank, num_micro, transport, prefetch=True) is None


def test_a_stage_map_with_other_keys_is_left_to_the_whole_job_path():
    compute = Schedule1F1B.generate(2, 1, 2)
    assert plan_rank(compute, {0: 0, "1": 1}, 0, 2, prefetch=True) is None
    assert plan_rank(compute, {0: 0, 1: "1"}, 0, 2, "batch", prefetch=True) is None


def test_a_rank_without_stages_does_not_turn_the_levels_lowering_off():
    compute, placement = Schedule1F1B.generate(3, 1, 4), Schedule1F1B.stage_placement(3, 1)
    extra = {**compute, 3: []}
    lowered = lower(extra, placement, "batch", metadata="all", prefetch=True)
    assert lowered == {**lower(compute, placement, "batch", metadata="all", prefetch=True), 3: []}
    assert plan_rank(extra, placement, 1, 4, "batch", metadata="all", prefetch=True) == lowered[1]
    assert plan_rank({**compute, 3: [MetaStep(0, T.FWD, 0)]}, placement, 1, 4, "batch", prefetch=True) is None


def test_shapes_travel_with_the_first_message_sent_of_a_boundary_even_out_of_order():
    # rank 1 consumes micro-batch 1 first: levels send F.s0.m1 first, so its shapes lead ("first"),
    # else rank 1 would receive data of the boundary before any shapes (the runtime refuses that)
    compute = {0: [MetaStep.from_str(t) for t in "F.s0.m0 F.s0.m1 F.s0.m2 B.s0.m0 B.s0.m1 B.s0.m2".split()],
               1: [MetaStep.from_str(t) for t in "F.s1.m1 F.s1.m0 F.s1.m2 B.s1.m1 B.s1.m0 B.s1.m2".split()]}
    placement = Schedule1F1B.stage_placement(2, 1)
    own = plan_rank(compute, placement, 1, 3, "batch", metadata="first", prefetch=True)
    first_data = next(k for k, s in enumerate(own) if s.meta_type is T.BATCH_SEND_RECV)
    assert [str(s) for s in own[:first_data + 1]] == ["RECV_META.s1.m1", "BATCH[RECV_F.s1.m1+RECV_F.s1.m0]"]
    sender = plan_rank(compute, placement, 0, 3, "batch", metadata="first", prefetch=True)
    assert [str(s) for s in sender if s.meta_type is T.META_SEND] == ["SEND_META.s0.m1"]
    flow = flow_of(compute, placement, 3, "none", False)
    level = flow.run(None, levels=True)
    shapes_late = own[1:first_data + 1] + [MetaStep.from_str("RECV_META.s1.m0")] + own[first_data + 1:]
    with pytest.raises(ScheduleError, match="lowering of rank 1"):
        rank_checks.check_levels_list(shapes_late, 1, flow, level, "first")
