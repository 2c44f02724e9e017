"""hyper-parallel: pipeline-parallel training with one schedule code on PyTorch and MindSpore."""

from hyper_parallel.core.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor import DTensor, distribute_tensor
from hyper_parallel.core.layout import Layout
from hyper_parallel.core.placement_types import Partial, Replicate, Shard
from hyper_parallel.core.pipeline_parallel import (
    BatchDimSpec,
    MetaStep,
    MetaStepType,
    PipelineStage,
    Schedule1F1B,
    PeerError,
    PipelineSchedule,
    ScheduleError,
    StageError,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleMPipeTranspose,
    ScheduleZBVZeroBubble,
)
from hyper_parallel.platform import get_platform, set_platform

__version__ = "0.1.0"

__all__ = [
    "BatchDimSpec",
    "DeviceMesh",
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
    "__version__",
    "get_platform",
    "init_device_mesh",
    "set_platform",
]

# distributed tensors (meshes are listed above)
__all__ += ["DTensor", "Layout", "Partial", "Replicate", "Shard", "distribute_tensor"]

# data parallelism, FSDP, checkpoints and training-loop helpers
from hyper_parallel.core.checkpoint import (  # noqa: E402
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from hyper_parallel.core.fully_shard import data_parallel, fully_shard  # noqa: E402
from hyper_parallel.core.train_utils import clip_grad_norm_, grads_are_finite  # noqa: E402

__all__ += ["CheckpointError", "clip_grad_norm_", "data_parallel", "fully_shard", "grads_are_finite",
            "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

# overlapping communication with compute (the overlap_b_f hooks)
from hyper_parallel.core.pipeline_parallel.features.overlap import (  # noqa: E402
    CommComputeOverlap,
    HookCoordinator,
    HookRole,
    OverlapError,
)

__all__ += ["CommComputeOverlap", "HookCoordinator", "HookRole", "OverlapError"]
