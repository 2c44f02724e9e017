"""What docs/running.md says ``overlap_p2p`` costs in memory: per rank, at most as many receive
buffers more alive at a time as one compute step consumes (one; two for DualPipeV, whose
overlapped forward+backward steps each consume two receives). Counted on the lowerings alone: a
receive's buffer lives from the step that posts it to the compute step that consumes it."""

from __future__ import annotations

import pytest
from test_pp_lowering_cross import VARIANTS, micro_counts

from hyper_parallel.core.pipeline_parallel.ir import MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower

_RECV = {MetaStepType.FWD_RECV: "F", MetaStepType.BWD_RECV: "B"}
_CONSUMES = {MetaStepType.FWD: "F", MetaStepType.BWD: "B", MetaStepType.BWD_INPUT: "B"}


def peak_live_receives(steps) -> int:
    live: set = set()
    peak = 0
    for step in steps:
        if step.meta_type.is_comm:
            for op in step.comm_parts:
                if op.meta_type in _RECV:
                    live.add((_RECV[op.meta_type], op.stage_index, op.micro_index))
            peak = max(peak, len(live))
        else:
            for part in step.parts:
                if part.meta_type in _CONSUMES:
                    live.discard((_CONSUMES[part.meta_type], part.stage_index, part.micro_index))
    return peak


@pytest.mark.parametrize("cls, v", VARIANTS, ids=[f"{c.__name__}-v{v}" for c, v in VARIANTS])
def test_overlap_p2p_keeps_at_most_one_compute_step_of_receives_more(cls, v):
    most = 0
    for p in (2, 3, 4):
        placement = cls.stage_placement(p, v)
        for m in micro_counts(cls, p, v):
            compute = cls.generate(p, v, m)
            for transport in ("plain", "batch"):
                off = lower(compute, placement, transport, metadata="first", prefetch=False)
                on = lower(compute, placement, transport, metadata="first", prefetch=True)
                for rank in off:
                    per_step = max(len(s.parts) for s in on[rank] if not s.meta_type.is_comm)
                    extra = peak_live_receives(on[rank]) - peak_live_receives(off[rank])
                    assert extra <= per_step  # batch repairs may even need fewer, (p, m, transport, rank, extra)
                    most = max(most, extra)
    assert most == (2 if cls.__name__ == "ScheduleDualPipeV" else 1)
