"""The faster job model (branch batch-speed) finds exactly what it found before.

``_job_model_before.py`` is ``lowering/job_model.py`` as it was before the speed-ups, unchanged.
Over lowered lists of every library schedule (both transports, each metadata mode) and mutations
of them that deadlock or need forced posts (steps moved, swapped, dropped, doubled, operations
moved between groups, idle slots, steps the model does not know, operations without a message),
and over compute-only lists, ``run_job`` must give an outcome EQUAL to the old one in every field
(stuck ranks with their wait texts, pending operations, heads, send clocks, ranks, forced posts)
for both models, with and without ``wait_at_post``, ``force_posts``, ``track_clocks`` and
``lowered``, or raise the same error.
"""

from __future__ import annotations

import random

import _job_model_before

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.job_model import run_job
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.schedule import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.schedules.overlap_pairs import fuse_overlap_pairs
from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

_T = MetaStepType
CLASSES = [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
           ScheduleZBVZeroBubble, ScheduleDualPipeV]
FLAGS = [dict(model=model, wait_at_post=wait, force_posts=force, track_clocks=track)
         for model in ("eager", "stream") for wait in (False, True) for force in (False, True) for track in (False, True)]


def _outcome(function, lists, placement, **kw):
    try:
        result = function(lists, placement, **kw)
    except Exception as exc:  # any error: the same type and message from both
        return type(exc), str(exc)
    return (result.stuck, result.pending, result.heads, result.send_clocks, result.ranks, result.forced,
            result.finished)


def _assert_same(lists, placement, where, flags=FLAGS, lowered=(True, False)) -> bool:
    """Equal outcomes for every flag combination; True when some run did not finish."""
    stuck = False
    for low in lowered:
        for kw in flags:
            got = _outcome(run_job, lists, placement, lowered=low, **kw)
            want = _outcome(_job_model_before.run_job, lists, placement, lowered=low, **kw)
            assert got == want, (*where, low, kw)
            stuck |= len(want) > 2 and not want[-1]
    return stuck


def _mutated(lowered, rng):
    """The lists with one to three changes on random ranks: often a deadlock, sometimes still fine."""
    out = {rank: list(steps) for rank, steps in lowered.items()}
    for _ in range(rng.randint(1, 3)):
        steps = out[rng.choice(sorted(out))]
        comm = [k for k, step in enumerate(steps) if step is not None and step.meta_type.is_comm]
        change = rng.randrange(7)
        if len(steps) < 2:
            continue
        if change == 0:  # move any step
            a, b = rng.sample(range(len(steps)), 2)
            steps.insert(a, steps.pop(b))
        elif change == 1 and len(comm) >= 2:  # swap two communication steps
            a, b = rng.sample(comm, 2)
            steps[a], steps[b] = steps[b], steps[a]
        elif change == 2 and comm:  # drop or double one
            k = rng.choice(comm)
            if rng.random() < 0.5:
                del steps[k]
            else:
                steps.insert(rng.randrange(len(steps) + 1), steps[k])
        elif change == 3 and len(comm) >= 2:  # move one operation into another group
            a, b = rng.sample(comm, 2)
            ops_a, ops_b = list(steps[a].comm_parts), list(steps[b].comm_parts)
            op = ops_a.pop(rng.randrange(len(ops_a)))
            ops_b.insert(rng.randrange(len(ops_b) + 1), op)
            steps[a] = MetaStep(None, _T.BATCH_SEND_RECV, None, ops_a)
            steps[b] = MetaStep(None, _T.BATCH_SEND_RECV, None, ops_b)
        elif change == 4:  # idle slots and steps the model does not know
            steps.insert(rng.randrange(len(steps) + 1), None)
            steps.insert(rng.randrange(len(steps) + 1), MetaStep(None, _T.FSDP_UNSHARD, 0))
        elif change == 5 and comm:  # move a communication step some way up or down
            k = rng.choice(comm)
            step = steps.pop(k)
            steps.insert(max(0, min(len(steps), k + rng.randint(-6, 6))), step)
        elif change == 6:  # a compute step moved a little (a receive now too late or too early)
            k = rng.randrange(len(steps))
            step = steps.pop(k)
            steps.insert(max(0, min(len(steps), k + rng.randint(-4, 4))), step)
    return out


def _lowerings(cls, p, v, m):
    compute, placement = cls.generate(p, v, m), cls.stage_placement(p, v)
    if cls is ScheduleInterleaved1F1B:
        compute = fuse_overlap_pairs(compute, placement)  # OVERLAP steps (two parts each)
    yield compute, placement, "compute"
    for transport, metadata, prefetch in (("batch", "none", False), ("batch", "first", True), ("plain", "all", True),
                                          ("plain", "none", False), ("batch", "all", False)):
        yield lower(compute, placement, transport, metadata=metadata, prefetch=prefetch), placement, transport


def test_job_model_outcomes_equal_before_on_mutated_lists():
    rng = random.Random(2024)
    stuck = runs = 0
    for cls in CLASSES:
        v = 2 if cls.max_chunks >= 2 else 1
        for p in (2, 3, 4):
            m = max(2 * p, cls.min_microbatches(p, v))
            for lists, placement, what in _lowerings(cls, p, v, m):
                where = (cls.__name__, p, v, m, what)
                _assert_same(lists, placement, where)
                for k in range(3):
                    stuck += _assert_same(_mutated(lists, rng), placement, (*where, "mutated", k))
                    runs += 1
    assert stuck > runs // 3  # the mutations did reach the deadlock (and forced post) paths


def test_job_model_odd_inputs_equal_before():
    """Steps that carry no message, stages not placed, a rank without a list, ranks not in order."""
    step = MetaStep
    F, B = _T.FWD, _T.BWD
    placement = {0: 0, 1: 1}
    send, recv = step(0, _T.FWD_SEND, 0), step(0, _T.FWD_RECV, 1)
    cases = [
        ({0: [step(0, F, 0), step(None, _T.BATCH_SEND_RECV, None, [step(0, F, 0)])], 1: [recv, step(0, F, 1)]},
         placement),
        ({0: [step(0, F, 0), step(None, _T.FWD_SEND, 0)], 1: [recv, step(0, F, 1)]}, placement),
        ({0: [step(0, F, 0), send, step(0, F, 1)], 1: [recv, step(0, F, 1)]}, {0: 0}),
        ({1: [recv, step(0, F, 1), step(0, B, 1)], 0: [step(0, F, 0), send, step(0, B, 0)]}, placement),
        ({0: [step(0, F, 0), send, step(0, B, 0)]}, placement),
        ({0: [step(0, F, 0), send, send], 1: [recv, recv, step(0, F, 1)]}, placement),
        ({0: [step(0, F, 0), step(0, F, 3)], 1: [step(0, F, 2)]}, {0: 0, 2: 1, 3: 0}),
        ({0: [step(0, _T.META_SEND, 0), step(0, F, 0), send], 1: [step(0, _T.META_RECV, 1), recv, step(0, F, 1)]},
         placement),
        ({0: [step(0, F, 0), step(None, _T.BATCH_SEND_RECV, None, [send, step(0, _T.META_SEND, 0)])],
          1: [step(None, _T.BATCH_SEND_RECV, None, [recv, step(0, _T.META_RECV, 1)]), step(0, F, 1)]}, placement),
        ({0: [], 1: []}, placement),
    ]
    for k, (lists, where) in enumerate(cases):
        _assert_same(lists, where, ("odd", k))
    assert _outcome(run_job, {0: []}, {}, model="bogus") == _outcome(_job_model_before.run_job, {0: []}, {},
                                                                    model="bogus")
