"""Issue 22: what planning reuses, and that reusing never lets a bad schedule through.

- validation skips its whole-job run only for lists equal to ones lowering's last run saw
  finish (``job_model.note_finished`` / ``known_to_finish``); any other list is run, and a
  deadlock is still reported with the stuck ranks marked;
- ``plan_cache`` hands out a plan only for equal compute lists, as fresh lists;
- the cyclic collector is paused while planning and restored after, also when planning fails.
"""

from __future__ import annotations

import gc
import threading

import pytest

from hyper_parallel.core.pipeline_parallel.lowering import plan_cache
from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc
from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.job_model import known_to_finish, note_finished
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B, ScheduleInterleaved1F1B
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError, validate_lowered

T = MetaStepType


def _lowered(transport="batch", cls=ScheduleInterleaved1F1B, p=3, v=2, m=6):
    # batch without prefetch: its lists come from lowering's job-model repairs, whose last run is
    # remembered (with prefetch they are free of deadlock by construction, levels.py)
    placement = cls.stage_placement(p, v)
    prefetch = transport == "plain"
    return lower(cls.generate(p, v, m), placement, transport, metadata="first", prefetch=prefetch), placement, m


def test_batch_lowering_proves_its_lists_in_the_stream_model_only_for_those_lists():
    lowered, placement, _ = _lowered()
    assert known_to_finish(lowered, placement, "stream")
    assert known_to_finish({r: list(s) for r, s in lowered.items()}, placement, "eager")  # equal lists
    moved = {r: list(s) for r, s in lowered.items()}
    moved[1].append(moved[1].pop(0))
    assert not known_to_finish(moved, placement, "stream")
    assert not known_to_finish(lowered, {**placement, 0: 1}, "stream")  # another placement


def test_plain_lowering_proves_nothing_and_an_eager_proof_does_not_cover_stream():
    lowered, placement, _ = _lowered("plain", Schedule1F1B, 4, 1, 9)
    assert not known_to_finish(lowered, placement, "eager")  # prefetch moved receives after its last run
    note_finished(lowered, placement, "eager")
    assert known_to_finish(lowered, placement, "eager")
    assert not known_to_finish(lowered, placement, "stream")


def test_a_deadlock_in_lists_close_to_proven_ones_is_still_reported():
    lowered, placement, m = _lowered()
    validate_lowered(lowered, placement, m, "batch")  # proven: fine
    # the same operations one by one, sends first: on one stream a send waits for its receive
    split = {
        rank: [op for step in steps for op in (
            sorted(step.comm_parts, key=lambda o: not o.meta_type.is_send) if step.meta_type is T.BATCH_SEND_RECV
            else (step,))]
        for rank, steps in lowered.items()
    }
    with pytest.raises(ScheduleError, match="deadlock: every unfinished rank is blocked") as info:
        validate_lowered(split, placement, m, "batch")
    assert {rank for rank, _ in info.value.marks} == {0, 1, 2}
    assert "rank 0 is stuck at" in str(info.value)


def test_the_plan_cache_only_answers_for_equal_compute_lists_with_fresh_lists():
    plan_cache.clear()
    compute = {0: [MetaStep(0, T.FWD, 0), MetaStep(0, T.BWD, 0)]}
    done = {0: [MetaStep(0, T.FWD, 0), MetaStep(0, T.BWD, 0)]}
    checks: set = set()
    plan_cache.remember("k", compute, done, checks)
    hit = plan_cache.lowered("k", {0: [MetaStep(0, T.FWD, 0), MetaStep(0, T.BWD, 0)]})
    assert hit is not None and hit[0] == done and hit[1] is checks
    hit[0][0].pop()  # the caller's lists are its own
    assert plan_cache.lowered("k", compute)[0] == done
    assert plan_cache.lowered("k", {0: [MetaStep(0, T.FWD, 0)]}) is None
    assert plan_cache.lowered("other", compute) is None
    plan_cache.clear()


def test_generate_gives_fresh_lists_of_the_same_steps():
    first = Schedule1F1B.generate(3, 1, 5)
    first[0].clear()
    again = Schedule1F1B.generate(3, 1, 5)
    assert again[0] and again == Schedule1F1B.generate(3, 1, 5)
    with pytest.raises(ValueError, match="needs at least"):
        ScheduleInterleaved1F1B.generate(4, 2, 0)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_while_planning_and_restored(enabled):
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        seen = []
        with paused_gc():
            seen.append(gc.isenabled())
            with paused_gc():
                seen.append(gc.isenabled())
            seen.append(gc.isenabled())
        assert seen == [False, False, False] and gc.isenabled() is enabled
        with pytest.raises(ValueError, match="unknown transport"):
            lower({0: []}, {0: 0}, "nccl")
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_threads_planning_together_leave_the_collector_on():
    assert gc.isenabled()
    inside = threading.Event()
    release = threading.Event()

    def planner():
        with paused_gc():
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=planner)
    thread.start()
    assert inside.wait(30)
    with paused_gc():
        pass
    assert not gc.isenabled()  # the other thread still plans
    release.set()
    thread.join(30)
    assert gc.isenabled()


def test_the_outside_contract_of_planning():
    """Issue 22, item 6: what outside checks import and call keeps its form."""
    import inspect

    import hyper_parallel.core.pipeline_parallel as pp
    from hyper_parallel.core.pipeline_parallel import lower as public_lower
    from hyper_parallel.core.pipeline_parallel import validate_lowered as public_validate

    assert public_lower is lower and public_validate is validate_lowered
    assert str(inspect.signature(lower)) == (
        "(compute: 'Schedule', stage_to_rank: 'dict[int, int]', transport: 'str' = 'plain', *, "
        "metadata: 'str' = 'none', prefetch: 'bool' = False) -> 'dict[int, list[MetaStep]]'")
    assert list(inspect.signature(validate_lowered).parameters) == [
        "lowered", "stage_to_rank", "num_microbatches", "transport", "forward_only", "engine"]
    for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                 "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
                 "ScheduleMPipeTranspose"):
        cls = getattr(pp, name)
        assert list(inspect.signature(cls.generate).parameters) == ["num_ranks", "num_chunks", "num_microbatches"]
        assert list(inspect.signature(cls.stage_placement).parameters) == ["num_ranks", "num_chunks"]


@pytest.mark.parametrize("args, error, text", [
    ((0, 1, 4), ValueError, "num_ranks must be an int >= 1, got 0"),
    ((2, 1, 0), ValueError, "Schedule1F1B with 2 ranks needs at least 1 micro-batches, got 0"),
    ((2, 1, 2.0), ValueError, "needs at least 1 micro-batches, got 2.0"),
    (("2", 1, 4), ValueError, "num_ranks must be an int >= 1, got '2'"),
])
def test_bad_sizes_are_still_refused_with_the_same_messages(args, error, text):
    with pytest.raises(error, match=text):
        Schedule1F1B.generate(*args)


def test_a_users_generator_is_asked_again_at_every_build():
    """A subclass's ``_generate`` may read what it is given between builds (a table, a CSV file):
    its lists are not kept, so an edited schedule is the one that runs (the library's generators are
    functions of (p, v, m) and are kept)."""

    def steps(text):
        return [MetaStep.from_str(word) for word in text.split()]

    first = {0: steps("F.s0.m0 F.s0.m1 B.s0.m0 B.s0.m1"), 1: steps("F.s1.m0 B.s1.m0 F.s1.m1 B.s1.m1")}
    edited = {0: steps("F.s0.m0 B.s0.m0 F.s0.m1 B.s0.m1"), 1: steps("F.s1.m0 B.s1.m0 F.s1.m1 B.s1.m1")}

    class FromTable(Schedule1F1B):
        table: dict = first

        @classmethod
        def _generate(cls, num_ranks, num_chunks, num_microbatches):
            return {rank: list(row) for rank, row in cls.table.items()}

    assert FromTable.generate(2, 1, 2) == first
    FromTable.table = edited
    assert FromTable.generate(2, 1, 2) == edited


@pytest.mark.parametrize("metadata", ["none", "first", "all"])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_lowering_that_cannot_repair_a_deadlock_proves_nothing(transport, prefetch, metadata):
    """Lowering's "its last run finished" is what lets validation skip its own run, so a compute
    schedule no placement of receives can save (each rank waits for the other's first micro-batch)
    must leave no proof behind: the lowered lists are still refused, both ranks marked."""

    def rows(*texts):
        return {rank: [MetaStep.from_str(word) for word in text.split()] for rank, text in enumerate(texts)}

    cycle = rows("F.s0.m0 B.s0.m0 F.s0.m1 B.s0.m1", "F.s1.m1 B.s1.m1 F.s1.m0 B.s1.m0")
    placement = {0: 0, 1: 1}
    lowered = lower(cycle, placement, transport, metadata=metadata, prefetch=prefetch)
    assert not known_to_finish(lowered, placement, "stream")
    for engine in ("eager", "stream"):
        with pytest.raises(ScheduleError, match="deadlock: every unfinished rank is blocked") as info:
            validate_lowered(lowered, placement, 2, transport, engine=engine)
        assert {rank for rank, _ in info.value.marks} == {0, 1}
        assert "rank 0 is stuck at B.s0.m0, waiting for a completed receive of B.s1.m0 or I.s1.m0 from rank 1" \
            in str(info.value)


@pytest.mark.timeout(120)
def test_a_features_pass_is_validated_even_when_the_same_plan_passed_before():
    """The plan cache reuses a validation only without lowering passes: a pass that breaks the lists
    (here one that drops rank 0's sends) is refused before any run, although a build of the same
    shape in this process validated the unchanged lists a moment ago."""
    import torch

    from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.local import LocalCluster

    def drop_sends(lowered, schedule, forward_only):
        return {rank: [s for s in steps if rank != 0 or not s.meta_type.is_send] for rank, steps in lowered.items()}

    def body():
        rank = get_platform().rank
        Schedule1F1B(PipelineStage(torch.nn.Linear(2, 2), rank, 2), 2).exec_order  # noqa: B018 (planned, validated)
        schedule = Schedule1F1B(PipelineStage(torch.nn.Linear(2, 2), rank, 2), 2)
        schedule.add_feature(lowering_pass=drop_sends)
        try:
            schedule.exec_order  # noqa: B018
        except ScheduleError as exc:
            return str(exc).splitlines()[0]
        return "accepted"

    plan_cache.clear()
    results = LocalCluster(2, platform="torch").run(body)
    assert results == ["RECV_META.s1.m0 has no matching SEND_META.s0.m0 on rank 0"] * 2


@pytest.mark.timeout(120)
def test_builds_of_one_shape_with_other_options_each_get_their_own_lowering():
    """(class, p, v, m) alike, the options differ (transport, overlap_p2p, dyn_shape's metadata,
    eval's forward-only lists), built one after another in one process: each plan is the lowering of
    its own options, not an earlier build's."""
    import torch

    from hyper_parallel.core.pipeline_parallel.schedule import _forwards_only
    from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.local import LocalCluster

    # each next to the one it differs from by one option (the cache keeps a few plans)
    options = [("plain", True, False), ("plain", True, True), ("batch", True, True), ("batch", False, True),
               ("batch", False, False)]

    def body():
        rank = get_platform().rank
        plans = []
        for transport, overlap, dyn in options:
            stages = [PipelineStage(torch.nn.Linear(2, 2), rank + 2 * c, 4, dyn_shape=dyn) for c in range(2)]
            schedule = ScheduleInterleaved1F1B(stages, 5, p2p_transport=transport, overlap_p2p=overlap)
            metadata = schedule._training_metadata()
            plans.append((schedule._lowered(metadata), schedule._lowered(metadata, forward_only=True)))
        return plans

    plan_cache.clear()
    compute, placement = ScheduleInterleaved1F1B.generate(2, 2, 5), ScheduleInterleaved1F1B.stage_placement(2, 2)
    for rank, plans in enumerate(LocalCluster(2, platform="torch").run(body)):
        for (training, forward), (transport, overlap, dyn) in zip(plans, options, strict=True):
            metadata = "all" if dyn else "first"
            # plain on gloo and batch with overlap_p2p plan this rank's list alone; batch without it every rank's
            expected = lower(compute, placement, transport, metadata=metadata, prefetch=overlap)
            expected_forward = lower(_forwards_only(compute), placement, transport, metadata=metadata, prefetch=overlap)
            if transport == "plain" or overlap:  # planned for this rank alone (rank_plan.py)
                expected, expected_forward = {rank: expected[rank]}, {rank: expected_forward[rank]}
            assert training == expected
            assert forward == expected_forward


def _child_collector_state(fork_inside: bool) -> int:
    """Fork while a planner holds the collector paused (another thread's, or, ``fork_inside``, the
    forking thread's own, which then leaves it in the child); the child's exit status says whether
    its collector is on once no planner of its own is left (0: on)."""
    import os

    inside, release = threading.Event(), threading.Event()

    def planner():
        with paused_gc():
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=planner)
    thread.start()
    try:
        assert inside.wait(30)
        if fork_inside:
            with paused_gc():
                pid = os.fork()
                if pid == 0 and gc.isenabled():
                    os._exit(9)  # the child still plans here: paused
        else:
            pid = os.fork()
        if pid == 0:
            with paused_gc():  # the child plans too: its lock is usable
                pass
            os._exit(0 if gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    finally:
        release.set()
        thread.join(30)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
@pytest.mark.parametrize("fork_inside", [False, True], ids=["other-thread", "own-thread"])
def test_a_child_forked_while_planning_gets_its_collector_back(fork_inside):
    """A process forked while a thread plans (a data loader's workers, a LocalCluster rank still
    planning): the planning thread does not exist in the child, so nothing there would resume the
    collector; the child's collector comes back once its own planners (if the forking thread was
    one) are done."""
    assert gc.isenabled()
    assert _child_collector_state(fork_inside) == 0
    assert gc.isenabled()
