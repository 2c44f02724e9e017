"""Tensor metadata that travels between neighbouring stages, packed into a fixed-size int tensor.

Sending metadata as an ordinary (small) tensor message keeps it in the same ordered stream
as the data, so every transport (gloo, NCCL, HCCL, LocalCluster) matches it the same way and
no blocking object exchange is needed in the middle of a schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

META_LEN = 128
DTYPE_CODES = (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
)


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether a gradient flows back through this tensor."""

    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool

    @property
    def differentiable(self) -> bool:
        return self.requires_grad

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}" + ("" if self.requires_grad else "(no grad)")


def encode_meta(metas: Sequence[TensorMeta]) -> list[int]:
    """``[count, (dtype code, requires grad, ndim, *dims) per tensor]`` padded to META_LEN."""
    out = [len(metas)]
    for m in metas:
        if m.dtype not in DTYPE_CODES:
            raise TypeError(f"cannot send a tensor of dtype {m.dtype} between stages")
        out += [DTYPE_CODES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
    if len(out) > META_LEN:
        raise ValueError(f"stage boundary metadata {[str(m) for m in metas]} does not fit in {META_LEN} ints")
    return out + [0] * (META_LEN - len(out))


def decode_meta(values: Sequence[int]) -> list[TensorMeta]:
    values = [int(v) for v in values]
    count, pos, metas = values[0], 1, []
    for _ in range(count):
        dtype, requires_grad, ndim = DTYPE_CODES[values[pos]], bool(values[pos + 1]), values[pos + 2]
        metas.append(TensorMeta(tuple(values[pos + 3 : pos + 3 + ndim]), dtype, requires_grad))
        pos += 3 + ndim
    return metas


def describe(metas: Sequence[TensorMeta] | None) -> str:
    return "(nothing)" if metas is None else "(" + ", ".join(str(m) for m in metas) + ")"
