"""Backend selection. The only package of the library that imports torch or MindSpore."""

from __future__ import annotations

import importlib.util
import logging
import os
import threading

from hyper_parallel.platform.base import (
    CompletedHandle,
    Communicator,
    ForwardRecord,
    Group,
    Handle,
    P2POp,
    Platform,
)
from hyper_parallel.platform.thread_binding import bind_thread_platform, thread_platform

PLATFORM_NAMES = ("torch", "mindspore")
_logger = logging.getLogger("hyper_parallel")
_global_platform: Platform | None = None
_running_local_clusters = 0  # LocalCluster.run calls in progress (see get_platform)
_count_lock = threading.Lock()


_INSTALL_HINTS = {
    "torch": "pip install 'hyper-parallel[torch]' (CPU-only wheels: "
             "pip install torch --index-url https://download.pytorch.org/whl/cpu)",
    "mindspore": "pip install 'hyper-parallel[mindspore]'",
}


def platform_class(name: str) -> type[Platform]:
    """The Platform subclass of a backend name (imports that framework).

    Raises ImportError naming the extra to install when the framework is missing.
    """
    if name not in PLATFORM_NAMES:
        raise ValueError(f"unknown platform {name!r}; valid platforms: {', '.join(PLATFORM_NAMES)}")
    try:
        if name == "torch":
            from hyper_parallel.platform.torch import TorchPlatform

            return TorchPlatform
        from hyper_parallel.platform.mindspore import MindSporePlatform

        return MindSporePlatform
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != name:
            raise
        framework = {"torch": "PyTorch", "mindspore": "MindSpore"}[name]
        raise ImportError(
            f"the {name} platform needs {framework}, which could not be imported ({exc}); install it with "
            f"{_INSTALL_HINTS[name]}"
        ) from exc


def _create(name: str) -> Platform:
    return platform_class(name)()


def _choose_name() -> tuple[str, str]:
    requested = os.environ.get("HYPER_PARALLEL_PLATFORM", "").strip().lower()
    if requested:
        if requested not in PLATFORM_NAMES:
            raise ValueError(
                f"HYPER_PARALLEL_PLATFORM={requested!r} is not a platform; valid platforms: "
                f"{', '.join(PLATFORM_NAMES)}"
            )
        return requested, "HYPER_PARALLEL_PLATFORM"
    for name in PLATFORM_NAMES:
        if importlib.util.find_spec(name) is not None:
            return name, "installed"
    raise RuntimeError("neither torch nor mindspore is installed: pip install 'hyper-parallel[torch]'")


def get_platform() -> Platform:
    """The platform of the calling rank (a LocalCluster rank's own, else the process-wide one)."""
    local = thread_platform()
    if local is not None:
        return local
    if _running_local_clusters and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "get_platform() was called from a thread that is not a LocalCluster rank while a LocalCluster "
            "runs: hand the rank's platform to that thread with "
            "hyper_parallel.platform.bind_thread_platform(platform)"
        )
    global _global_platform
    if _global_platform is None:
        name, why = _choose_name()
        _global_platform = _create(name)
        _logger.info("hyper_parallel: using the %s platform (chosen by %s)", name, why)
    return _global_platform


def set_platform(platform: str | Platform | None) -> Platform | None:
    """Choose the process-wide platform by name (``"torch"`` | ``"mindspore"``) or instance.

    ``None`` forgets the choice so the next :func:`get_platform` chooses again.
    """
    global _global_platform
    if platform is None:
        _global_platform = None
        return None
    if isinstance(platform, str):
        platform = _create(platform.strip().lower())
    if not isinstance(platform, Platform):
        raise TypeError(f"set_platform expects a name or a Platform, got {type(platform).__name__}")
    _global_platform = platform
    return platform


def local_cluster_running(delta: int) -> None:
    """LocalCluster.run announces its start (+1) and end (-1)."""
    global _running_local_clusters
    with _count_lock:
        _running_local_clusters += delta


__all__ = [
    "PLATFORM_NAMES",
    "CompletedHandle",
    "Communicator",
    "ForwardRecord",
    "Group",
    "Handle",
    "P2POp",
    "Platform",
    "bind_thread_platform",
    "get_platform",
    "platform_class",
    "set_platform",
]
