"""Lowering helpers that the mutation audit found unchecked (benchmarks/results/mutation_audit.md)."""

from __future__ import annotations

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering import counterpart

_T = MetaStepType


@pytest.mark.parametrize("kind, other, shift", [
    (_T.FWD_SEND, _T.FWD_RECV, 1), (_T.FWD_RECV, _T.FWD_SEND, -1),
    (_T.META_SEND, _T.META_RECV, 1), (_T.META_RECV, _T.META_SEND, -1),
    (_T.BWD_SEND, _T.BWD_RECV, -1), (_T.BWD_RECV, _T.BWD_SEND, 1),
])
def test_counterpart_of_every_send_and_receive(kind, other, shift):
    step = MetaStep(3, kind, 2)
    assert counterpart(step) == MetaStep(3, other, 2 + shift)
    assert counterpart(counterpart(step)) == step


def test_counterpart_refuses_compute_and_stageless_steps():
    with pytest.raises(ValueError, match="is not a send/recv step"):
        counterpart(MetaStep(0, _T.FWD, 1))
    with pytest.raises(ValueError, match="has no stage"):
        counterpart(MetaStep(0, _T.FWD_SEND, None))


def test_batch_prefetch_survives_the_stream_model_repair_by_hand():
    # With prefetch the batch lowering first moves receives one compute early, then uncrosses the
    # groups of both ranks; without the uncrossing the repair puts rank 1's RECV_F.s1.m1 back
    # behind B.s1.m0 and the prefetch is lost (still valid, one beat slower).
    from hyper_parallel.core.pipeline_parallel.lowering import lower
    from hyper_parallel.core.pipeline_parallel.placement import looped_placement
    from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b
    from hyper_parallel.core.pipeline_parallel.validate import validate_lowered

    placement = looped_placement(2, 1)
    lowered = lower(generate_1f1b(2, 2), placement, "batch", prefetch=True)
    assert {r: " ".join(map(str, s)) for r, s in lowered.items()} == {
        0: "F.s0.m0 BATCH[SEND_F.s0.m0] F.s0.m1 BATCH[SEND_F.s0.m1+RECV_B.s0.m0+RECV_B.s0.m1] B.s0.m0 B.s0.m1",
        1: "BATCH[RECV_F.s1.m0] F.s1.m0 BATCH[RECV_F.s1.m1] B.s1.m0 BATCH[SEND_B.s1.m0] F.s1.m1 B.s1.m1 "
        "BATCH[SEND_B.s1.m1]",
    }
    validate_lowered(lowered, placement, 2, "batch", engine="stream")
