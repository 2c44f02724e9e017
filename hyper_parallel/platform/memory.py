"""What a stage forward keeps in memory for its backward, where the framework can tell.

Kept apart from the `Platform` classes: only the profiler asks, and a backend that cannot
tell answers ``None``.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.platform.base import ForwardRecord, Platform


def saved_activation_bytes(platform: Platform, record: ForwardRecord) -> int | None:
    """Bytes of the tensors the forward of ``record`` saved for its backward and still holds
    (each storage once, parameters left out); ``None`` where the backend cannot tell (MindSpore)."""
    if platform.name == "torch":
        from hyper_parallel.platform.torch.memory import saved_bytes

        return saved_bytes(record)
    return None


def tensor_bytes(platform: Platform, values: Any) -> int:
    """Bytes of the tensors among ``values`` (a tensor, or a tuple/list of values)."""
    items = values if isinstance(values, (tuple, list)) else (values,)
    total = 0
    for item in items:
        if platform.is_tensor(item):
            total += platform.numel(item) * _itemsize(platform.dtype_name(item))
    return total


_SIZES = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
          "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def _itemsize(dtype: str) -> int:
    return _SIZES.get(dtype, 4)
