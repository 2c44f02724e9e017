"""Framework-neutral dtype names <-> MindSpore dtypes."""

from __future__ import annotations

from typing import Any

import mindspore as ms

_DTYPES: dict[str, Any] = {
    "float16": ms.float16,
    "bfloat16": ms.bfloat16,
    "float32": ms.float32,
    "float64": ms.float64,
    "int8": ms.int8,
    "int16": ms.int16,
    "int32": ms.int32,
    "int64": ms.int64,
    "uint8": ms.uint8,
    "bool": ms.bool_,
    "complex64": ms.complex64,
    "complex128": ms.complex128,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_FLOATING = ("float16", "bfloat16", "float32", "float64")


def ms_dtype(name: str) -> Any:
    """The MindSpore dtype of a framework-neutral dtype name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; valid names: {', '.join(_DTYPES)}") from None


def dtype_name_of(dtype: Any) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"MindSpore dtype {dtype} has no framework-neutral name") from None
