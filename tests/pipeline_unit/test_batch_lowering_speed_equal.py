"""The faster batch lowering without prefetch (branch batch-speed) makes the very lists it made before.

``_p2p_before.py`` (the lowering before the last speed-ups) runs here with ``_job_model_before.py``
(the job model before this branch's), so both the repairs and the job model they ask are the old
ones. Over every library schedule, p <= 5, v <= 3, several m, every metadata mode, and compute
lists shuffled so that the repairs must work (forced posts) or the job deadlocks, ``lower(..., "batch",
prefetch=False)`` must give lists EQUAL to the old ones, element by element, or the same error.
"""

from __future__ import annotations

import random

import _job_model_before
import _p2p_before
import pytest

from hyper_parallel.core.pipeline_parallel.lowering import p2p
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

CLASSES = [ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble,
           ScheduleZBVZeroBubble, ScheduleDualPipeV]
METADATA = ("none", "first", "all")


@pytest.fixture(autouse=True)
def _old_job_model(monkeypatch):
    monkeypatch.setattr(_p2p_before, "run_job", _job_model_before.run_job)


def _outcome(lowering, compute, placement, metadata):
    try:
        return lowering(compute, placement, "batch", metadata=metadata, prefetch=False)
    except Exception as exc:  # any error: the same type and message from both
        return type(exc), str(exc)


def _assert_same(compute, placement, where):
    for metadata in METADATA:
        got = _outcome(lower, compute, placement, metadata)
        want = _outcome(_p2p_before.lower, compute, placement, metadata)
        assert type(got) is type(want), (*where, metadata)
        if isinstance(want, dict):
            assert list(got) == list(want), (*where, metadata)
        assert got == want, (*where, metadata)


def _configs(cls):
    for p in range(1, 6):
        for v in range(1, 4):
            if not cls.min_chunks <= v <= cls.max_chunks:
                continue
            low = cls.min_microbatches(p, v)
            for m in sorted({low, 2 * p + 1}):
                if m >= low:
                    yield p, v, m


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_batch_lowering_without_prefetch_as_before(cls):
    rng = random.Random(5)
    for p, v, m in _configs(cls):
        compute, placement = cls.generate(p, v, m), cls.stage_placement(p, v)
        _assert_same(compute, placement, (cls.__name__, p, v, m))
        if v > 1:
            _assert_same(fuse_overlap_pairs(compute, placement), placement, (cls.__name__, p, v, m, "fused"))
        if p > 1:
            for k in range(2):
                _assert_same(_shuffled(compute, rng), placement, (cls.__name__, p, v, m, "shuffled", k))


def _shuffled(compute, rng):
    """A few compute steps moved on one or two ranks: receives posted too early or too late."""
    out = {rank: list(steps) for rank, steps in compute.items()}
    for _ in range(rng.randint(1, 2)):
        steps = out[rng.choice(sorted(out))]
        if len(steps) > 1:
            k = rng.randrange(len(steps))
            steps.insert(max(0, min(len(steps) - 1, k + rng.randint(-3, 3))), steps.pop(k))
    return out


def test_the_repairs_are_reached(monkeypatch):
    """The configurations above do need the repairs: the job model posts receives (forced posts).
    (Sends moved ahead of metadata receives are not reached by these lists.)"""
    seen = {"forced": 0}
    real = p2p.run_job

    def spy(lists, placement, **kw):
        outcome = real(lists, placement, **kw)
        seen["forced"] += len(outcome.forced)
        return outcome

    monkeypatch.setattr(p2p, "run_job", spy)
    rng = random.Random(5)
    for cls in CLASSES:
        for p, v, m in _configs(cls):
            compute, placement = cls.generate(p, v, m), cls.stage_placement(p, v)
            for lists in (compute, _shuffled(compute, rng)):
                plans = {r: p2p._plan_rank(r, steps, placement) for r, steps in sorted(lists.items())}
                p2p._add_metadata(plans, "first")
                p2p._number_fifo(plans)
                p2p._use_dependencies(plans, placement, p2p._emit_plain, "eager", False)
                p2p._uncross(plans)
                p2p._repair(plans, placement)
    assert seen["forced"] > 0, seen
