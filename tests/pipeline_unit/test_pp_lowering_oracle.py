"""Issue 22: the faster planning gives the very lists of the lowering it replaced.

``_lowering_oracle.py`` / ``_job_model_oracle.py`` are the lowering and the job model as they
were before the planning speed-ups, unchanged. The batch lowering with prefetch is made by
levels now (``levels.py``): its lists are compared as valid and equivalent (same compute order,
same messages, the job finishes on both engines), every other lowering as equal. Over every library schedule, small p, v and m,
both transports, prefetch on and off, each metadata mode, training and forward-only, the
lowered lists of ``lower`` must EQUAL the oracle's (equal lists: the runtime executes the same
steps in the same order, so every run is bitwise the same). The job model is checked the same
way on schedules that deadlock (the outcome drives lowering's repairs and validation's message).
"""

from __future__ import annotations

import random

import _job_model_oracle
import _lowering_oracle
import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.job_model import run_job
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_lowered
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

# (class, chunk counts, fuse overlap_b_f pairs); MPipe lowers ScheduleInterleaved1F1B's / 1F1B's lists
SCHEDULES = [
    (ScheduleGPipe, (1,), False),
    (Schedule1F1B, (1,), False),
    (ScheduleInterleaved1F1B, (2, 3), False),
    (ScheduleInterleaved1F1B, (2,), True),
    (ScheduleLoopedBFS, (1, 2), False),
    (ScheduleInterleavedZeroBubble, (1, 2), False),
    (ScheduleZBVZeroBubble, (2,), False),
    (ScheduleDualPipeV, (2,), False),
]
RANKS = (1, 2, 3, 4, 6)
# (forward_only, prefetch, metadata): the defaults with each metadata mode, no prefetch, eval
OPTIONS = [(False, True, "first"), (False, True, "none"), (False, True, "all"), (False, False, "first"),
           (False, False, "all"), (True, True, "first"), (True, False, "none")]


def _configs(cls, chunks):
    for p in RANKS:
        for v in chunks:
            low = cls.min_microbatches(p, v)
            for m in sorted({low, low + 1, 2 * p, 2 * p + 3, 3 * p + 1} - {0}):
                if m >= low and (p < 6 or m <= 2 * p + 3):
                    yield p, v, m


def _compute(cls, p, v, m, fuse):
    compute = cls.generate(p, v, m)
    placement = cls.stage_placement(p, v)
    return (fuse_overlap_pairs(compute, placement) if fuse else compute), placement


@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("cls,chunks,fuse", SCHEDULES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_lowered_lists_equal_the_oracle(cls, chunks, fuse, transport):
    checked = 0
    for p, v, m in _configs(cls, chunks):
        compute, placement = _compute(cls, p, v, m, fuse)
        for forward_only, prefetch, metadata in OPTIONS:
            lists = _forwards_only(compute) if forward_only else compute
            got = lower(lists, placement, transport, metadata=metadata, prefetch=prefetch)
            want = _lowering_oracle.lower(lists, placement, transport, metadata=metadata, prefetch=prefetch)
            where = (cls.__name__, p, v, m, transport, metadata, prefetch, forward_only)
            if transport == "batch" and prefetch:  # lowered by levels now (levels.py): valid and equivalent
                _assert_equivalent(got, want, lists, placement, m, forward_only, where)
            else:
                assert got == want, where
            checked += 1
    assert checked >= 60


def _ops(steps) -> list:
    return [op for step in steps if step.meta_type.is_comm for op in step.comm_parts]


def _assert_equivalent(got, want, compute, placement, m, forward_only, where):
    """The same compute steps in the same order on every rank, the same messages (data and shapes)
    sent and received, each channel in one order on both sides, and the job finishes on both
    engines (``validate_lowered``): every run executes the same computation."""
    assert got.keys() == want.keys(), where
    for rank in got:
        assert [s for s in got[rank] if not s.meta_type.is_comm] == [s for s in compute[rank] if s is not None], where
        assert sorted(map(str, _ops(got[rank]))) == sorted(map(str, _ops(want[rank]))), where
    for engine in ("stream", "eager"):
        validate_lowered(got, placement, m, "batch", forward_only, engine=engine)


def _outcome(result) -> tuple:
    return (result.stuck, result.pending, result.heads, result.send_clocks, result.ranks, result.forced)


def _shuffled(lowered, rng):
    """The lists with a few steps of one rank moved: often a deadlock, sometimes still fine."""
    out = {rank: list(steps) for rank, steps in lowered.items()}
    for _ in range(rng.randint(1, 3)):
        rank = rng.choice(sorted(out))
        steps = out[rank]
        if len(steps) < 2:
            continue
        a, b = sorted(rng.sample(range(len(steps)), 2))
        steps.insert(a, steps.pop(b))
    return out


@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_job_model_outcomes_equal_the_oracle(transport):
    rng = random.Random(22)
    stuck = 0
    for cls, chunks, fuse in SCHEDULES:
        for p, v, m in [(2, chunks[0], None), (3, chunks[-1], None), (4, chunks[0], None)]:
            m = max(2 * p, cls.min_microbatches(p, v))
            compute, placement = _compute(cls, p, v, m, fuse)
            lowered = lower(compute, placement, transport, metadata="first", prefetch=True)
            cases = [lowered] + [_shuffled(lowered, rng) for _ in range(6)]
            for case in cases:
                for model in ("eager", "stream"):
                    for force in (False, True):
                        for track in (False, True):
                            kw = dict(model=model, force_posts=force, track_clocks=track)
                            got = run_job(case, placement, **kw)
                            want = _job_model_oracle.run_job(case, placement, **kw)
                            assert _outcome(got) == _outcome(want), (cls.__name__, p, v, m, kw)
                            stuck += not got.finished
            wait = lower(compute, placement, transport, metadata="none", prefetch=False)
            got = run_job(wait, placement, wait_at_post=True)
            assert _outcome(got) == _outcome(_job_model_oracle.run_job(wait, placement, wait_at_post=True))
            got = run_job(compute, placement, lowered=False)
            assert _outcome(got) == _outcome(_job_model_oracle.run_job(compute, placement, lowered=False))
    assert stuck > 20  # the shuffles did reach the deadlock paths


def test_kinds_covered():
    """The matrix above holds every compute kind the generators make (F, B, I, W, OVERLAP_B_F)."""
    kinds = set()
    for cls, chunks, fuse in SCHEDULES:
        compute, _ = _compute(cls, 3, chunks[0], max(6, cls.min_microbatches(3, chunks[0])), fuse)
        kinds |= {step.meta_type for steps in compute.values() for step in steps if step is not None}
    assert {MetaStepType.FWD, MetaStepType.BWD, MetaStepType.BWD_INPUT, MetaStepType.BWD_WEIGHT,
            MetaStepType.OVERLAP_B_F} <= kinds
