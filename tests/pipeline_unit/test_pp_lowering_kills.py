"""Lowering helpers that the mutation audit found unchecked (benchmarks/results/mutation_audit.md)."""

from __future__ import annotations

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import counterpart

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


def test_batch_prefetch_lowers_by_levels_as_worked_out_by_hand():
    # 1F1B, p = 2, m = 2. Levels (levels.py): +1 along a rank, +2 from another rank's maker.
    # rank 0: F.s0.m0 0, F.s0.m1 1, B.s0.m0 5 (after B.s1.m0 at 3), B.s0.m1 7 (after B.s1.m1 at 5)
    # rank 1: F.s1.m0 2, B.s1.m0 3, F.s1.m1 4, B.s1.m1 5
    # boundary = consumer level - 1: F.s0.m0 1, F.s0.m1 3, G.s1.m0 4, G.s1.m1 6; each boundary goes
    # before the rank's first step of its level or above, one batch per gap
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
    from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
    from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b
    from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_lowered

    placement = looped_placement(2, 1)
    lowered = lower(generate_1f1b(2, 2), placement, "batch", prefetch=True)
    assert {r: " ".join(map(str, s)) for r, s in lowered.items()} == {
        0: "F.s0.m0 BATCH[SEND_F.s0.m0] F.s0.m1 BATCH[SEND_F.s0.m1+RECV_B.s0.m0] B.s0.m0 BATCH[RECV_B.s0.m1] B.s0.m1",
        1: "BATCH[RECV_F.s1.m0] F.s1.m0 BATCH[RECV_F.s1.m1] B.s1.m0 BATCH[SEND_B.s1.m0] F.s1.m1 B.s1.m1 "
        "BATCH[SEND_B.s1.m1]",
    }
    validate_lowered(lowered, placement, 2, "batch", engine="stream")


def _builtin(p: int, m: int):
    from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, v_placement
    from hyper_parallel.core.pipeline_parallel.schedules import (
        generate_1f1b,
        generate_dualpipe_v,
        generate_gpipe,
        generate_interleaved_1f1b,
        generate_interleaved_zero_bubble,
        generate_looped_bfs,
        generate_zbv_zero_bubble,
    )

    yield "gpipe", generate_gpipe(p, m), looped_placement(p, 1)
    yield "1f1b", generate_1f1b(p, m), looped_placement(p, 1)
    yield "interleaved", generate_interleaved_1f1b(p, 2, m), looped_placement(p, 2)
    yield "looped_bfs", generate_looped_bfs(p, 2, m), looped_placement(p, 2)
    yield "interleaved_zb", generate_interleaved_zero_bubble(p, 2, m), looped_placement(p, 2)
    yield "zbv", generate_zbv_zero_bubble(p, m), v_placement(p)
    if m >= 2 * p:
        yield "dualpipe_v", generate_dualpipe_v(p, m), v_placement(p)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("metadata, prefetch", [("none", False), ("none", True), ("all", False), ("all", True),
                                               ("first", False), ("first", True)])
def test_batch_lowering_never_deadlocks_on_a_stream_engine(p, metadata, prefetch):
    # On NCCL/HCCL a rank's batched groups run in order on one stream and a send completes only
    # when its receive is posted; the CPU tests run on the eager model, so the stream model is
    # checked here for every built-in schedule and micro-batch count up to 2p + 1.
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
    from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_lowered

    for m in range(1, 2 * p + 2):
        for name, compute, placement in _builtin(p, m):
            lowered = lower(compute, placement, "batch", metadata=metadata, prefetch=prefetch)
            try:
                validate_lowered(lowered, placement, m, "batch", engine="stream")
            except Exception as exc:
                raise AssertionError(f"{name} p={p} m={m} metadata={metadata} prefetch={prefetch}: {exc}") from exc
