"""hyper-parallel: pipeline-parallel training with one schedule code on PyTorch and MindSpore."""

from hyper_parallel.core.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.pipeline_parallel import (
    BatchDimSpec,
    MetaStep,
    MetaStepType,
    PipelineStage,
    Schedule1F1B,
    ScheduleError,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.platform import get_platform, set_platform

__version__ = "0.1.0"

__all__ = [
    "BatchDimSpec",
    "DeviceMesh",
    "MetaStep",
    "MetaStepType",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleError",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "__version__",
    "get_platform",
    "init_device_mesh",
    "set_platform",
]
