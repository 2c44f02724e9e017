"""The lowering pass that places FSDP_UNSHARD / FSDP_RESHARD / FSDP_REDUCE_GRAD (pure, no tensors)."""

from __future__ import annotations

import pytest

from hyper_parallel import MetaStep
from hyper_parallel.core.fully_shard.window import insert_all, insert_steps
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_lowered


def _steps(text: str) -> list[MetaStep]:
    return [MetaStep.from_str(t) for t in text.split()]


def _text(steps: list[MetaStep]) -> str:
    return " ".join(str(s) for s in steps)


def test_one_stage_per_rank_gathers_once_and_reduces_after_the_last_backward():
    steps = _steps("F.s0.m0 SEND_F.s0.m0 F.s0.m1 SEND_F.s0.m1 RECV_B.s0.m0 B.s0.m0 RECV_B.s0.m1 B.s0.m1")
    out = insert_steps(steps, sharded={0}, reduced={0}, lookahead=2, forward_only=False)
    assert _text(out) == ("FSDP_UNSHARD.s0 F.s0.m0 SEND_F.s0.m0 F.s0.m1 SEND_F.s0.m1 RECV_B.s0.m0 B.s0.m0 "
                          "RECV_B.s0.m1 B.s0.m1 FSDP_REDUCE_GRAD.s0 FSDP_RESHARD.s0")


def test_reduce_goes_behind_the_sends_of_the_last_backward_and_before_the_next_receives():
    steps = _steps("B.s1.m1 SEND_B.s1.m1 RECV_B.s0.m1 B.s0.m1")
    out = insert_steps(steps, sharded=set(), reduced={0, 1}, lookahead=2, forward_only=False)
    assert _text(out) == "B.s1.m1 SEND_B.s1.m1 FSDP_REDUCE_GRAD.s1 RECV_B.s0.m1 B.s0.m1 FSDP_REDUCE_GRAD.s0"


def test_a_window_of_one_stage_reshards_on_every_switch():
    steps = _steps("F.s0.m0 F.s2.m0 B.s2.m0 B.s0.m0")
    out = insert_steps(steps, sharded={0, 2}, reduced={0, 2}, lookahead=1, forward_only=False)
    assert _text(out) == ("FSDP_UNSHARD.s0 F.s0.m0 FSDP_RESHARD.s0 FSDP_UNSHARD.s2 F.s2.m0 B.s2.m0 "
                          "FSDP_REDUCE_GRAD.s2 FSDP_RESHARD.s2 FSDP_UNSHARD.s0 B.s0.m0 FSDP_REDUCE_GRAD.s0 "
                          "FSDP_RESHARD.s0")
    wide = insert_steps(steps, sharded={0, 2}, reduced={0, 2}, lookahead=2, forward_only=False)
    # stage 2 is freed as soon as no compute of it is left in the window
    assert _text(wide) == ("FSDP_UNSHARD.s0 FSDP_UNSHARD.s2 F.s0.m0 F.s2.m0 B.s2.m0 FSDP_REDUCE_GRAD.s2 "
                           "FSDP_RESHARD.s2 B.s0.m0 FSDP_REDUCE_GRAD.s0 FSDP_RESHARD.s0")


def test_forward_only_lists_get_the_window_but_no_reduction():
    out = insert_steps(_steps("F.s0.m0 F.s0.m1"), sharded={0}, reduced={0}, lookahead=2, forward_only=True)
    assert _text(out) == "FSDP_UNSHARD.s0 F.s0.m0 F.s0.m1 FSDP_RESHARD.s0"
    with pytest.raises(ValueError, match="lookahead must be >= 1, got 0"):
        insert_steps(_steps("F.s0.m0"), {0}, {0}, 0, False)


@pytest.mark.parametrize("cls,chunks", [(ScheduleGPipe, 1), (Schedule1F1B, 1), (ScheduleInterleaved1F1B, 2)])
@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_every_generated_schedule_stays_valid_and_each_stage_is_reduced_once(cls, chunks, lookahead):
    ranks, micro = 4, 8
    placement = cls.stage_placement(ranks, chunks)
    lowered = lower(cls.generate(ranks, chunks, micro), placement, "plain", metadata="first")
    stages = set(placement)
    out = insert_all(lowered, stages, stages, lookahead, forward_only=False)
    validate_lowered(out, placement, micro, "plain", False)
    for rank, steps in out.items():
        mine = {s for s, r in placement.items() if r == rank}
        reduces = [s.stage_index for s in steps if s.meta_type.name == "FSDP_REDUCE_GRAD"]
        assert sorted(reduces) == sorted(mine)
        gathered: set[int] = set()
        for step in steps:  # every compute runs on gathered parameters; the list ends with all freed
            kind = step.meta_type.name
            if kind == "FSDP_UNSHARD":
                assert step.stage_index not in gathered
                gathered.add(step.stage_index)
            elif kind == "FSDP_RESHARD":
                gathered.remove(step.stage_index)
            elif step.meta_type.is_compute:
                assert {p.stage_index for p in step.parts} <= gathered, (rank, str(step))
                assert len(gathered) <= max(lookahead, 1)
            elif kind == "FSDP_REDUCE_GRAD":
                later = steps[steps.index(step) + 1:]
                assert not any(p.stage_index == step.stage_index and p.meta_type.name in ("B", "I", "W")
                               for s in later for p in s.parts)
        assert not gathered
