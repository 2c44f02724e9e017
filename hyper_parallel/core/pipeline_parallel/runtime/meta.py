"""Tensor metadata that travels between neighbouring stages, packed into a list of ints.

It goes over the platform's metadata channel (``Platform.isend_meta`` / ``recv_meta``), in the
order lowering gives the SEND_META / RECV_META steps; there is no limit on the number of tensors.

A tensor that crossed the boundary as a ``DTensor`` carries its layout too (:class:`LayoutMeta`:
the mesh dimension names and sizes, which mesh dimensions split each tensor dimension, and which
are pending reductions), so the receiving stage rebuilds a DTensor with the same layout over its
own ranks (see ``dtensor_boundary.py``). The shape sent is always the local piece's shape.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

DTYPE_CODES = (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
)
PARTIAL_CODES = ("sum", "avg", "max", "min")
_REQUIRES_GRAD, _HAS_LAYOUT = 1, 2  # bits of the flags word


@dataclass(frozen=True)
class LayoutMeta:
    """The layout of a DTensor, independent of the ranks that hold it.

    ``shards[d]`` lists the mesh dimensions (indices into ``dim_names``) that split tensor dim
    ``d``, outer first; ``partial[m]`` is the pending reduction over mesh dim ``m`` (or ``None``).
    """

    mesh_shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    shards: tuple[tuple[int, ...], ...]
    partial: tuple[str | None, ...]

    def __post_init__(self) -> None:
        if len(self.mesh_shape) != len(self.dim_names) or len(self.partial) != len(self.dim_names):
            raise ValueError(f"inconsistent layout metadata {self!r}")
        for op in self.partial:
            if op is not None and op not in PARTIAL_CODES:
                raise ValueError(f"cannot send a pending reduction {op!r} between stages")

    def __str__(self) -> str:
        dims = []
        for mesh_dims in self.shards:
            names = [self.dim_names[m] for m in mesh_dims]
            dims.append("None" if not names else names[0] if len(names) == 1 else "(" + ",".join(names) + ")")
        text = f"[{', '.join(dims)}] over {dict(zip(self.dim_names, self.mesh_shape, strict=True))}"
        pending = {self.dim_names[m]: op for m, op in enumerate(self.partial) if op is not None}
        return text + (f" partial {pending}" if pending else "")


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether a gradient flows back through this tensor (plus a DTensor's layout)."""

    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    layout: LayoutMeta | None = None

    @property
    def differentiable(self) -> bool:
        return self.requires_grad

    def __str__(self) -> str:
        text = f"{self.dtype}{list(self.shape)}" + ("" if self.requires_grad else "(no grad)")
        return text + (f" DTensor {self.layout}" if self.layout is not None else "")


def _encode_name(name: str) -> list[int]:
    codes = [ord(c) for c in name]
    return [len(codes), *codes]


def _encode_layout(layout: LayoutMeta) -> list[int]:
    out = [len(layout.mesh_shape), *layout.mesh_shape]
    for name in layout.dim_names:
        out += _encode_name(name)
    for mesh_dims in layout.shards:
        out += [len(mesh_dims), *mesh_dims]
    out += [-1 if op is None else PARTIAL_CODES.index(op) for op in layout.partial]
    return out


def encode_meta(metas: Sequence[TensorMeta]) -> list[int]:
    """``[count, (dtype code, flags, ndim, *dims[, layout block]) per tensor]``.

    ``flags``: bit 0 requires grad, bit 1 a layout block follows:
    ``[mesh ndim, *mesh shape, (name length, *code points) per mesh dim,
    (count, *mesh dims) per tensor dim, partial code or -1 per mesh dim]``.
    """
    out = [len(metas)]
    for m in metas:
        if m.dtype not in DTYPE_CODES:
            raise TypeError(f"cannot send a tensor of dtype {m.dtype} between stages")
        flags = (_REQUIRES_GRAD if m.requires_grad else 0) | (_HAS_LAYOUT if m.layout is not None else 0)
        out += [DTYPE_CODES.index(m.dtype), flags, len(m.shape), *m.shape]
        if m.layout is not None:
            if len(m.layout.shards) != len(m.shape):
                raise ValueError(f"layout {m.layout} does not describe a {len(m.shape)}-D tensor")
            out += _encode_layout(m.layout)
    return out


def _decode_layout(read: Iterator[int], ndim: int) -> LayoutMeta:
    mesh_ndim = next(read)
    shape = tuple(next(read) for _ in range(mesh_ndim))
    names = tuple("".join(chr(next(read)) for _ in range(next(read))) for _ in range(mesh_ndim))
    shards = tuple(tuple(next(read) for _ in range(next(read))) for _ in range(ndim))
    partial = tuple(None if code < 0 else PARTIAL_CODES[code] for code in (next(read) for _ in range(mesh_ndim)))
    return LayoutMeta(shape, names, shards, partial)


def decode_meta(values: Sequence[int]) -> list[TensorMeta]:
    read = iter(int(v) for v in values)
    metas = []
    for _ in range(next(read)):
        dtype, flags, ndim = DTYPE_CODES[next(read)], next(read), next(read)
        shape = tuple(next(read) for _ in range(ndim))
        layout = _decode_layout(read, ndim) if flags & _HAS_LAYOUT else None
        metas.append(TensorMeta(shape, dtype, bool(flags & _REQUIRES_GRAD), layout))
    return metas


def describe(metas: Sequence[TensorMeta] | None) -> str:
    return "(nothing)" if metas is None else "(" + ", ".join(str(m) for m in metas) + ")"
