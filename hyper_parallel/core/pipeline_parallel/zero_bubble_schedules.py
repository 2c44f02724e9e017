"""Zero-bubble schedule classes: every backward split into an input step (I) and a weight step (W).

- ``ScheduleInterleavedZeroBubble``: ZB-H1 style over looped placement (stage ``c * p + r`` on
  rank r), one or more stages per rank, any number of micro-batches;
- ``ScheduleZBVZeroBubble``: ZB-V, exactly two stages per rank in a V (stages r and 2p-1-r on
  rank r), any number of micro-batches;
- ``ScheduleDualPipeV``: DualPipeV, the same V placement, overlapped backward/forward pairs of
  two micro-batches (``OVERLAP_B_F`` steps), at least 2p micro-batches.

The generators live in ``schedules/``; see ``docs/zero_bubble.md`` for orders, memory and bubbles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.pipeline_parallel.ir.placement import v_placement
from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule, Schedule
from hyper_parallel.core.pipeline_parallel.schedules import (
    generate_dualpipe_v,
    generate_interleaved_zero_bubble,
    generate_zbv_zero_bubble,
)
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage

__all__ = ["ScheduleDualPipeV", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"]


class ScheduleInterleavedZeroBubble(PipelineSchedule):
    """ZB-H1 style zero bubble over looped chunks (stage ``c * p + r`` on rank r), v >= 1 stages per
    rank, any m >= 1. Peak in flight: ``v * min(p, m)`` (stage, micro-batch) activations per rank,
    i.e. p micro-batches of the rank's layers; idle time per rank ``(p - 1)(F + I - W)``."""

    placement = "looped"
    min_chunks, max_chunks = 1, 64

    def __init__(self, stages: PipelineStage | Sequence[PipelineStage], micro_batch_num: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(stages, micro_batch_num, **kwargs)

    @classmethod
    def _generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_interleaved_zero_bubble(num_ranks, num_chunks, num_microbatches)


class _VSchedule(PipelineSchedule):
    """Two stages per rank in a V: rank r holds stages r and ``2p - 1 - r`` (of ``2p``)."""

    placement = "v"
    min_chunks, max_chunks = 2, 2

    def __init__(self, stages: Sequence[PipelineStage], micro_batch_num: int | None = None, **kwargs: Any) -> None:
        super().__init__(stages, micro_batch_num, **kwargs)

    def _check_stages(self, stages: PipelineStage | Sequence[PipelineStage]) -> list[PipelineStage]:
        name = type(self).__name__
        count = len(stages) if isinstance(stages, (list, tuple)) else 1
        if isinstance(stages, (PipelineStage, list, tuple)) and count != 2:
            raise ValueError(
                f"{name} runs exactly 2 stages per rank (rank r holds stages r and 2p-1-r), got {count}"
            )
        return super()._check_stages(stages)

    def _place(self) -> dict[int, int]:
        p, r = self.num_ranks, self.pp_rank
        got = sorted(stage.stage_index for stage in self.stages)
        totals = sorted({stage.stage_num for stage in self.stages})
        if totals != [2 * p] or got != [r, 2 * p - 1 - r]:
            raise ValueError(
                f"{type(self).__name__} uses V placement: with {p} pipeline rank{'s' if p != 1 else ''} there are {2 * p} stages and "
                f"rank {r} holds stages {[r, 2 * p - 1 - r]}, but it was given stages {got} of stage_num "
                f"{totals[0] if len(totals) == 1 else totals}"
            )
        self.stages.sort(key=lambda st: st.stage_index)
        return v_placement(p)


class ScheduleZBVZeroBubble(_VSchedule):
    """ZB-V: exactly two stages per rank in a V (stages r and 2p-1-r on rank r), any m >= 1. Peak in
    flight: ``2 min(p, m)`` (stage, micro-batch) activations per rank, i.e. p micro-batches of the
    rank's layers; the only idle time is the ramp, ``p - 1`` chunk forwards per rank."""

    @classmethod
    def _generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_zbv_zero_bubble(num_ranks, num_microbatches)


class ScheduleDualPipeV(_VSchedule):
    """DualPipeV: two stages per rank in a V (stages r and 2p-1-r on rank r), m >= 2p. In the middle
    of the schedule a backward of one micro-batch and a forward of another form one ``OVERLAP_B_F``
    step. Peak in flight: ``2p + 1`` (stage, micro-batch) activations per rank (p + 1/2 micro-batches
    of the rank's layers). Extra keyword arguments go to the base class unchanged."""

    @classmethod
    def min_microbatches(cls, num_ranks: int, num_chunks: int) -> int:
        return 2 * num_ranks

    @classmethod
    def _generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        return generate_dualpipe_v(num_ranks, num_microbatches)
