"""DTensors crossing pipeline stage boundaries.

A stage may take and return :class:`~hyper_parallel.core.dtensor.DTensor` values (e.g. the
activations of a tensor-parallel layer). Only local pieces travel between ranks: the sending stage's
DTensor outputs are unwrapped to their local tensors (the autograd roots and the data sent), and their
layout goes with the shapes on the metadata channel (:class:`~.meta.LayoutMeta`). The receiving stage
gets ``DTensor.from_local(piece, layout)`` with the same layout, over the mesh dimensions of the same
names in its own mesh: the mesh given to ``PipelineStage(..., mesh=...)`` (e.g. the ``"tp"`` line of a
``("pp", "tp")`` mesh through the receiving rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.core.layout import Layout
from hyper_parallel.core.pipeline_parallel.runtime.meta import LayoutMeta, TensorMeta


def layout_meta(layout: Layout) -> LayoutMeta:
    """The rank-independent description of a DTensor's layout."""
    pending = layout.partial
    return LayoutMeta(
        tuple(layout.mesh_shape),
        tuple(layout.alias_name),
        tuple(tuple(dims) for dims in layout.shard_dims),
        tuple(pending.get(name) for name in layout.alias_name),
    )


def resolve_layout(meta: LayoutMeta, stage: Any) -> Layout:
    """The layout ``meta`` describes, over the receiving stage's own mesh dimensions of those names."""
    mesh = getattr(stage, "mesh", None)
    where = f"stage {stage.stage_index} received a DTensor laid out as {meta}"
    if mesh is None:
        raise ValueError(
            f"{where}, but it has no device mesh to rebuild it on: build it with "
            f"PipelineStage(..., mesh=mesh) where the mesh has the dimensions {list(meta.dim_names)}"
        )
    try:
        sub = mesh[list(meta.dim_names)]
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{where}, but its mesh {mesh} cannot provide those dimensions: {exc}") from None
    if tuple(sub.shape) != tuple(meta.mesh_shape):
        raise ValueError(
            f"{where}, but its own mesh has sizes {dict(zip(meta.dim_names, sub.shape, strict=True))} "
            "for those dimensions"
        )
    base = Layout.from_device_mesh(sub)
    aliases = []
    for dims in meta.shards:
        names = tuple(meta.dim_names[m] for m in dims)
        aliases.append("None" if not names else names[0] if len(names) == 1 else names)
    layout = base(*aliases)
    for m, op in enumerate(meta.partial):
        if op is not None:
            layout = layout.with_partial(meta.dim_names[m], reduce_op=op)
    return layout


def with_layouts(metas: Sequence[TensorMeta], layouts: Sequence[LayoutMeta | None]) -> list[TensorMeta]:
    """``metas`` with the layouts of the outputs that were DTensors."""
    if not layouts:
        return list(metas)
    return [m if lay is None else replace(m, layout=lay) for m, lay in zip(metas, layouts, strict=True)]


def local_call(fn: Callable[..., Any], stage: Any, in_metas: Sequence[TensorMeta] | None,
               unwrap_outputs: bool) -> tuple[Callable[..., Any], list[LayoutMeta | None]]:
    """``fn`` taking local pieces and returning local pieces; the second value is filled, when it
    runs, with the layout of each output (``None`` for a plain tensor).

    Positional arguments whose metadata carries a layout are wrapped into DTensors before ``fn``
    sees them; with ``unwrap_outputs`` DTensor outputs are replaced by their local pieces.
    """
    layouts = [None if m.layout is None else resolve_layout(m.layout, stage) for m in in_metas or ()]
    if not any(layouts) and not unwrap_outputs:
        return fn, []
    out_layouts: list[LayoutMeta | None] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if any(layouts):
            args = tuple(
                DTensor.from_local(a, layouts[i]) if i < len(layouts) and layouts[i] is not None else a
                for i, a in enumerate(args)
            )
        result = fn(*args, **kwargs)
        if not unwrap_outputs:
            return result
        items = result if isinstance(result, (tuple, list)) else (result,)
        out_layouts[:] = [layout_meta(o.layout) if isinstance(o, DTensor) else None for o in items]
        if not any(out_layouts):
            return result
        local = [o.to_local() if isinstance(o, DTensor) else o for o in items]
        return local if isinstance(result, list) else tuple(local) if isinstance(result, tuple) else local[0]

    call.__wrapped__ = fn  # type: ignore[attr-defined]  # lets backends see the module
    return call, out_layouts
