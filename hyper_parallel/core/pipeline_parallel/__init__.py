"""Pipeline parallelism: IR, schedule generators, lowering, validation, simulation, runtime."""

from hyper_parallel.core.pipeline_parallel.ir import (
    MetaStep,
    MetaStepType,
    format_schedule_csv,
    load_schedule_csv,
    parse_schedule_csv,
    save_schedule_csv,
)
from hyper_parallel.core.pipeline_parallel.microbatch import BatchDimSpec
from hyper_parallel.core.pipeline_parallel.schedule import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.validate import ScheduleError

__all__ = [
    "BatchDimSpec",
    "MetaStep",
    "MetaStepType",
    "PipelineSchedule",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleError",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "format_schedule_csv",
    "load_schedule_csv",
    "parse_schedule_csv",
    "save_schedule_csv",
]
