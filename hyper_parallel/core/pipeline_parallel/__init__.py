"""Pipeline parallelism: IR, schedule generators, lowering, validation, simulation, runtime."""

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering import lower
from hyper_parallel.core.pipeline_parallel.microbatch import BatchDimSpec
from hyper_parallel.core.pipeline_parallel.mpipe import ScheduleMPipeTranspose
from hyper_parallel.core.pipeline_parallel.runtime import PeerError, StageError
from hyper_parallel.core.pipeline_parallel.schedule import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.schedule_csv import (
    format_schedule_csv,
    load_schedule_csv,
    parse_schedule_csv,
    save_schedule_csv,
)
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.validate import ScheduleError, validate_lowered
from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

__all__ = [
    "BatchDimSpec",
    "MetaStep",
    "MetaStepType",
    "PeerError",
    "PipelineSchedule",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleError",
    "StageError",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleMPipeTranspose",
    "ScheduleZBVZeroBubble",
    "format_schedule_csv",
    "load_schedule_csv",
    "lower",
    "parse_schedule_csv",
    "save_schedule_csv",
    "validate_lowered",
]
