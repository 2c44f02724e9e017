"""Launch a function on several local gloo processes through torch's own elastic launcher."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` processes of this machine; returns the results in rank order.

    ``fn`` must be importable by module path (the workers are spawned). Each worker gets
    ``HYPER_PARALLEL_PLATFORM=torch`` and the usual torchrun environment variables.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ["HYPER_PARALLEL_PLATFORM"] = "torch"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"hyper-parallel-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    results = elastic_launch(config, fn)(*args)
    return [results[r] for r in range(nproc)]


def device_count(device_type: str) -> int:
    """How many devices of ``device_type`` (``cuda`` or ``npu``) torch sees on this machine (0 when
    the framework support is missing or sees none)."""
    import importlib.util

    import torch

    if device_type == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            return 0
        import torch_npu  # noqa: F401  (registers torch.npu)
    module = getattr(torch, device_type, None)
    return int(module.device_count()) if module is not None and module.is_available() else 0


def select_local_device(device_type: str) -> None:
    """Give this process the device of its local rank (``LOCAL_RANK``), as every torchrun job on
    GPUs or NPUs does before it builds stages: without it every rank sits on device 0."""
    if device_type == "cpu":
        return
    import torch

    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    getattr(torch, device_type).set_device(int(os.environ.get("LOCAL_RANK", "0")))
