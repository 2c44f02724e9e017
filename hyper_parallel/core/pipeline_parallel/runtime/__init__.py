"""The runtime: what one rank does with its lowered list, on tensors, through the platform.

``stage`` (`PipelineStage`), ``microbatch`` (splitting and merging batches), ``executor``
(`PipelineRuntime`: walks a rank's lowered steps, posts and waits point-to-point, runs the
stage autograd, releases sent outputs), ``meta`` and ``dtensor_boundary`` (the shapes, dtypes and
DTensor layouts neighbours exchange), ``wait_watch`` (timeouts that name the step and the peer),
``grad_state`` (gradients a failed run puts back), ``agreement`` (every rank built the same
schedule), ``shared_params`` (tied weights across ranks), ``tracing`` (step records of a run).

May import: ``ir``, ``lowering``, the platform (``get_platform()``, ``platform.base``) and the
framework-neutral DTensor (``core.dtensor``, ``core.layout``); never
the schedule classes, the features or the tools, and never torch or MindSpore directly.
"""

from hyper_parallel.core.pipeline_parallel.runtime.executor import (
    P2P_TYPES,
    CustomFunction,
    Key,
    PeerError,
    PipelineRuntime,
    StageError,
    StepContext,
)
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage

__all__ = ["P2P_TYPES", "CustomFunction", "Key", "PeerError", "PipelineRuntime", "PipelineStage", "StageError", "StepContext"]
