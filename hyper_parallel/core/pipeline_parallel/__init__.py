"""Pipeline parallelism: the schedule classes users construct, and the parts behind them.

The tree is the architecture (docs/architecture.md): ``ir`` (steps and their text/CSV forms) <-
``schedules`` (pure generators) and ``lowering`` (point-to-point steps, validation, the job model)
<- ``runtime`` (one rank's steps on tensors) <- ``schedule.py`` / ``zero_bubble_schedules.py`` (the
classes: generate -> lower -> validate -> run) <- ``features`` (plug in through ``add_feature``);
``simulation`` (the timing model) and ``tools`` (offline planning and inspection) sit beside and
above. Each sub-package's docstring says what it may import; nothing imports upwards.
"""

import importlib
from types import ModuleType

from hyper_parallel.core.pipeline_parallel import _moved_modules
from hyper_parallel.core.pipeline_parallel.features.mpipe.transpose import ScheduleMPipeTranspose
from hyper_parallel.core.pipeline_parallel.ir.schedule_csv import (
    format_schedule_csv,
    load_schedule_csv,
    parse_schedule_csv,
    save_schedule_csv,
)
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError, validate_lowered
from hyper_parallel.core.pipeline_parallel.runtime.executor import PeerError, StageError
from hyper_parallel.core.pipeline_parallel.runtime.microbatch import BatchDimSpec
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.schedule import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

# the features register themselves with the schedule classes (schedule.register_feature)
from hyper_parallel.core.pipeline_parallel import features  # noqa: E402,F401  isort: skip

_moved_modules.install()


def __getattr__(name: str) -> ModuleType:
    """The old flat modules as attributes of the package, as before (``pp.stage``, ``pp.simulate``)."""
    if name in _moved_modules.MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
