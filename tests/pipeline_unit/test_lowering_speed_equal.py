"""The faster whole-job lowering (branch lower-speed) makes the very lists it made before.

``_p2p_before.py`` is ``lowering/p2p.py`` as it was before the speed-ups, unchanged. Over every
library schedule (and the fused overlap pairs, forward-only lists, schedules shuffled into
deadlock, odd placements), p 1-5, v 1-3, several m, both transports, every metadata mode,
prefetch on and off, ``lower`` must give lists EQUAL to the old ones, element by element, and
the same error where the old one raised.
"""

from __future__ import annotations

import random

import _p2p_before
import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.comm_steps import comm_step
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.schedule import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    _forwards_only,
)
from hyper_parallel.core.pipeline_parallel.schedules.overlap_pairs import fuse_overlap_pairs
from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

CLASSES = [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
           ScheduleZBVZeroBubble, ScheduleDualPipeV]
OPTIONS = [(transport, metadata, prefetch) for transport in ("plain", "batch") for metadata in ("none", "first", "all")
           for prefetch in (False, True)]


def _configs(cls):
    for p in range(1, 6):
        for v in range(1, 4):
            if not cls.min_chunks <= v <= cls.max_chunks:
                continue
            low = cls.min_microbatches(p, v)
            for m in sorted({low, low + 1, 2 * p + 1, 3 * p}):
                if m >= low:
                    yield p, v, m


def _outcome(lowering, compute, placement, transport, metadata, prefetch):
    try:
        return lowering(compute, placement, transport, metadata=metadata, prefetch=prefetch)
    except Exception as exc:  # any error: the same type and message from both (review: AttributeError too)
        return type(exc), str(exc)


def _assert_same(compute, placement, where, options=OPTIONS):
    for transport, metadata, prefetch in options:
        got = _outcome(lower, compute, placement, transport, metadata, prefetch)
        want = _outcome(_p2p_before.lower, compute, placement, transport, metadata, prefetch)
        assert type(got) is type(want), (*where, transport, metadata, prefetch)
        if isinstance(want, dict):  # element by element, and the ranks in the same order
            assert list(got) == list(want), (*where, transport, metadata, prefetch)
        assert got == want, (*where, transport, metadata, prefetch)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_library_schedules_lower_as_before(cls):
    checked = 0
    for p, v, m in _configs(cls):
        compute, placement = cls.generate(p, v, m), cls.stage_placement(p, v)
        _assert_same(compute, placement, (cls.__name__, p, v, m))
        _assert_same(_forwards_only(compute), placement, (cls.__name__, p, v, m, "forward only"))
        if v > 1:
            _assert_same(fuse_overlap_pairs(compute, placement), placement, (cls.__name__, p, v, m, "fused"))
        checked += 1
    assert checked >= 10


def _shuffled(compute, rng):
    out = {rank: list(steps) for rank, steps in compute.items()}
    for _ in range(rng.randint(1, 3)):
        steps = out[rng.choice(sorted(out))]
        if len(steps) > 1:
            a, b = sorted(rng.sample(range(len(steps)), 2))
            steps.insert(a, steps.pop(b))
    return out


def test_shuffled_schedules_lower_as_before():
    """Moved compute steps: lists that deadlock or need the batch repairs, lowered the same."""
    rng = random.Random(7)
    for cls in CLASSES:
        v = max(cls.min_chunks, 2) if cls.max_chunks >= 2 else 1
        for p in (2, 3, 4):
            m = max(2 * p, cls.min_microbatches(p, v))
            compute, placement = cls.generate(p, v, m), cls.stage_placement(p, v)
            for k in range(4):
                _assert_same(_shuffled(compute, rng), placement, (cls.__name__, p, v, m, "shuffle", k))


def test_odd_inputs_lower_or_fail_as_before():
    """Idle slots, a rank with no steps, a stage on a rank other than its placement, a step
    without a micro-batch, a stage not placed, a communication step: the same lists or errors."""
    step = MetaStep
    F, B, W = MetaStepType.FWD, MetaStepType.BWD, MetaStepType.BWD_WEIGHT
    placement = {0: 0, 1: 1, 2: 0}
    cases = [
        {0: [step(0, F, 0), None, step(0, F, 2), step(0, B, 2), None, step(0, B, 0)], 1: [None, step(0, F, 1),
                                                                                             step(0, B, 1)]},
        {0: [step(0, F, 0), step(0, F, 1), step(0, B, 1), step(0, B, 0)], 1: []},  # stage 1 run on rank 0
        {0: [step(0, F, 0), step(None, W, 0)], 1: [step(0, F, 1)]},
        {0: [step(0, F, 0), step(0, F, 7)], 1: [step(0, F, 1)]},
        {0: [step(0, F, 0), step(0, MetaStepType.FWD_SEND, 0)], 1: [step(0, F, 1)]},
        {0: [step(0, F, 0), step(1, F, 0), step(1, B, 0)], 1: [step(1, F, 1), step(0, F, 1), step(1, B, 1)]},
    ]
    for k, compute in enumerate(cases):
        _assert_same(compute, placement, ("odd", k))
    # stages that are not 0 to n - 1: the job model looks up a stage that is not there
    gappy = {0: 0, 2: 1, 3: 0}
    compute = {0: [step(0, F, 0), step(0, F, 3), step(0, B, 3), step(0, B, 0)], 1: [step(0, F, 2), step(0, B, 2)]}
    _assert_same(compute, gappy, ("stages not 0 to n - 1",))


def test_comm_step_equals_the_checked_step():
    """``comm_step`` skips ``MetaStep``'s checks only: equal, same hash, same fields, same text."""
    for micro, kind, stage in [(0, MetaStepType.FWD_SEND, 3), (5, MetaStepType.BWD_RECV, 0),
                               (None, MetaStepType.META_RECV, 2)]:
        fast, checked = comm_step(micro, kind, stage), MetaStep(micro, kind, stage)
        assert fast == checked and hash(fast) == hash(checked) and str(fast) == str(checked)
        assert vars(fast) == vars(checked) and list(vars(fast)) == list(vars(checked))
