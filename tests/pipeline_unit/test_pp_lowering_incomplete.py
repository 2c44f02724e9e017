"""Incomplete hand-written compute schedules lower without a crash and fail validation clearly.

A custom schedule (a CSV, a dict, a ``PipelineSchedule`` subclass) is lowered before it is
validated, so lowering must get through a receive whose send is missing, or a rank with no list
at all, and leave the report to ``validate_lowered``: a ``ScheduleError`` that names the missing
step, never a ``KeyError`` from the batch lowering's repairs or the stream model.
"""

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b, generate_interleaved_1f1b
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError, validate_lowered

CASES = [("plain", "none", False), ("batch", "none", False), ("batch", "none", True), ("batch", "first", True),
         ("batch", "all", False), ("batch", "all", True)]


def _check(compute, placement, m, transport, metadata, prefetch, missing):
    lowered = lower(compute, placement, transport, metadata=metadata, prefetch=prefetch)
    with pytest.raises(ScheduleError, match=missing):
        validate_lowered(lowered, placement, m, transport)


@pytest.mark.parametrize(("transport", "metadata", "prefetch"), CASES)
@pytest.mark.parametrize("v", [1, 2])
def test_a_rank_without_a_list_is_a_validation_error(transport, metadata, prefetch, v):
    compute = generate_1f1b(4, 4) if v == 1 else generate_interleaved_1f1b(4, 2, 4)
    del compute[2]
    _check(compute, looped_placement(4, v), 4, transport, metadata, prefetch, r"F\.s2\.m0 is missing")


@pytest.mark.parametrize(("transport", "metadata", "prefetch"), CASES)
def test_a_receive_without_its_send_is_a_validation_error(transport, metadata, prefetch):
    # two ranks, looped: the pair is neighbours both ways; rank 0 never runs F.s2.m1, so rank 1's
    # RECV_F.s3.m1 has no send (and an idle slot stands where it was)
    compute = generate_interleaved_1f1b(2, 2, 4)
    gone = MetaStep(1, MetaStepType.FWD, 2)
    compute[0] = [None if step == gone else step for step in compute[0]]
    _check(compute, looped_placement(2, 2), 4, transport, metadata, prefetch, r"F\.s2\.m1 is missing|before its forward F\.s2\.m1")
