"""Small building blocks shared by the schedule generators."""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.ir.placement import check_count
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType, unchecked_step
from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc  # generators: a million objects, no cycle

__all__ = ["check_count", "fwd", "bwd", "paused_gc", "one_f_one_b"]

_FWD, _BWD = MetaStepType.FWD, MetaStepType.BWD


def fwd(stage: int, micro: int) -> MetaStep:
    """Forward of ``micro`` on ``stage`` (plain ints the generator made: not checked again)."""
    return unchecked_step(micro, _FWD, stage)


def bwd(stage: int, micro: int) -> MetaStep:
    """Full backward of ``micro`` on ``stage`` (plain ints the generator made: not checked again)."""
    return unchecked_step(micro, _BWD, stage)


def one_f_one_b(forwards: list[MetaStep], backwards: list[MetaStep], warmup: int) -> list[MetaStep]:
    """``warmup`` (>= 0) forwards, then pairs (next forward, next backward), then the remaining
    backwards. Forwards and backwards keep their given order."""
    if len(forwards) != len(backwards):
        raise ValueError(f"{len(forwards)} forwards but {len(backwards)} backwards")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    warmup = min(warmup, len(forwards))
    paired = len(forwards) - warmup
    steady: list[MetaStep] = [None] * (2 * paired)  # type: ignore[list-item]
    steady[0::2] = forwards[warmup:]
    steady[1::2] = backwards[:paired]
    return forwards[:warmup] + steady + backwards[paired:]
