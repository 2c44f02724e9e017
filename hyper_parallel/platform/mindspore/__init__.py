"""The MindSpore backend (PyNative or GRAPH_MODE; CPU here, Ascend/GPU in production).

Importing it selects the CPU device when nothing was chosen and this MindSpore build defaults
to the CPU (before any kernel runs, so a later ``ms.set_device("CPU")`` still succeeds).
"""

from hyper_parallel.platform.mindspore.platform import MindSporePlatform, ensure_device

ensure_device()

__all__ = ["MindSporePlatform"]
