"""How many CPU threads a framework's kernels use, and setting it (for the profiler).

torch: ``torch.get_num_threads`` / ``torch.set_num_threads`` (intra-op threads), changeable at
any time. MindSpore: the CPU kernels' thread count (``runtime_num_threads``) is read; it is
fixed when MindSpore starts (``mindspore.device_context.cpu.op_tuning.threads_num`` before the
first operator), so `set_num_threads` cannot change it and says so.
"""

from __future__ import annotations


def num_threads(platform_name: str) -> int | None:
    """The thread count the framework's CPU kernels use now (None: it cannot tell)."""
    if platform_name == "torch":
        import torch

        return int(torch.get_num_threads())
    if platform_name == "mindspore":
        import mindspore

        try:
            return int(mindspore.get_context("runtime_num_threads"))
        except (ValueError, TypeError, RuntimeError):
            return None
    return None


def set_num_threads(platform_name: str, threads: int) -> str | None:
    """Use ``threads`` CPU threads from now on; returns None when done, else why it was not
    (the framework keeps its count)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    if platform_name == "torch":
        import torch

        torch.set_num_threads(threads)
        return None
    if platform_name == "mindspore":
        now = num_threads(platform_name)
        if now == threads:
            return None
        return (f"MindSpore's CPU thread count is fixed when it starts (now {now}); set it with "
                "mindspore.device_context.cpu.op_tuning.threads_num before the first operator")
    return f"the {platform_name} platform has no thread count to set"
