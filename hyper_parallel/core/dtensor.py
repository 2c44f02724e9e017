"""DTensor: a tensor laid out over a device mesh, on torch and MindSpore alike.

A DTensor is this rank's local piece plus its layout (mesh + placements) and the global shape. It
does not dispatch operators: compute on ``to_local()`` pieces and move data with ``redistribute``.

Shards must be even: every sharded tensor dimension divides by the number of pieces, else
``ValueError`` names the dimension and the sizes. ``from_local`` trusts that every rank passes a
piece of the same shape (nothing is exchanged to check it).

Gradients (see docs/parallelism.md). The gradient of a DTensor is laid out like the
DTensor, except that a pending reduction (``Partial``) gets a replicated gradient — the rule of
``torch.distributed.tensor``. So the backward of ``redistribute`` moves the gradient back from the
target's gradient layout to the source's: Shard->Replicate (all-gather) backward keeps each rank's
piece of the replicated gradient; Partial->Replicate (all-reduce) backward passes it through. When
each rank's gradient of a replicated result is only its own contribution (the result fed
rank-specific computation), say so with ``to_local(grad_placements=[Partial()])``: the gradients are
then summed, and the backward of an all-gather becomes a reduce-scatter. The same holds on MindSpore
(PyNative; the moves are recorded through tensor hooks, see ``platform/mindspore/dtensor.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core import redistribute as _redistribute
from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.layout import Layout
from hyper_parallel.core.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.platform import get_platform


def _as_layout(mesh_or_layout: DeviceMesh | Layout, placements: Sequence[Placement] | None, ndim: int) -> Layout:
    if isinstance(mesh_or_layout, Layout):
        if placements is not None:
            raise TypeError("give either a Layout or a mesh with placements, not both")
        if mesh_or_layout.ndim != ndim:
            raise ValueError(
                f"layout {mesh_or_layout.alias_tensor_map} describes {mesh_or_layout.ndim} dims, the tensor has {ndim}"
            )
        return mesh_or_layout
    if not isinstance(mesh_or_layout, DeviceMesh):
        raise TypeError(f"expected a DeviceMesh or a Layout, got {type(mesh_or_layout).__name__}")
    if placements is None:
        placements = [Replicate()] * mesh_or_layout.ndim
    return Layout.from_placements(mesh_or_layout, placements, ndim)


class DTensor:
    """This rank's piece of a tensor laid out over a mesh. Build it with :meth:`from_local`.

    The constructor takes the piece, its layout (with a tensor map) and the global shape as given,
    without checks; ``from_local`` and ``distribute_tensor`` are the checked ways in.
    """

    def __init__(self, local: Any, layout: Layout, shape: Sequence[int]) -> None:
        self._local = local
        self._layout = layout
        self._shape = tuple(int(s) for s in shape)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_local(
        cls,
        local: Any,
        mesh_or_layout: DeviceMesh | Layout,
        placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        """Wrap this rank's piece: ``mesh`` with ``placements`` (default all ``Replicate``), or a ``Layout``.

        Every rank calls it with a piece of the same shape. No communication; differentiable.
        """
        p = get_platform()
        if not p.is_tensor(local):
            raise TypeError(f"from_local needs a {p.name} tensor, got {type(local).__name__}")
        local_shape = p.shape(local)
        layout = _as_layout(mesh_or_layout, placements, len(local_shape))
        return cls(local, layout, layout.global_shape(local_shape))

    @classmethod
    def from_torch(cls, native: Any) -> DTensor:
        """Wrap a ``torch.distributed.tensor.DTensor`` (same local piece, mesh over the same groups)."""
        local, torch_mesh, descs, shape = get_platform().dtensor_from_native(native)
        placements = [Shard(d[1]) if d[0] == "shard" else Partial(d[1]) if d[0] == "partial" else Replicate()
                      for d in descs]
        out = cls.from_local(local, DeviceMesh.from_torch(torch_mesh), placements)
        if out.shape != tuple(shape):
            raise ValueError(f"torch DTensor of shape {list(shape)} has uneven shards; only even shards are supported")
        return out

    # ------------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape."""
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._layout.to_placements()

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._layout.mesh

    @property
    def dtype(self) -> str:
        """The dtype name (``"float32"``, ``"bfloat16"``...)."""
        return get_platform().dtype_name(self._local)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(get_platform().shape(self._local))

    # ------------------------------------------------------------------ conversions
    def to_local(self, grad_placements: Sequence[Placement] | Layout | None = None) -> Any:
        """This rank's piece (differentiable).

        ``grad_placements`` says how the gradients arriving at the returned tensor are laid out when
        that differs from the default (this DTensor's placements with Partial made Replicate), e.g.
        ``[Partial()]`` when each rank's gradient is only its own contribution.
        """
        if grad_placements is None:
            return self._local
        p = get_platform()
        if isinstance(grad_placements, Layout):
            given = grad_placements
        else:
            given = Layout.from_placements(self._layout.mesh, grad_placements, self.ndim)
        target = _redistribute.grad_layout(self._layout)
        steps = _redistribute.plan(given, target)  # validates before anything runs
        if given.local_shape(self._shape) != self.local_shape:
            raise ValueError(
                f"grad_placements {list(given.to_placements())} give gradient pieces of shape "
                f"{list(given.local_shape(self._shape))}, but the local tensor has shape {list(self.local_shape)}"
            )
        if not steps:
            return self._local
        mesh, shape = self._layout.mesh, self._shape
        return p.custom_function(
            lambda x: x,
            lambda g: _redistribute.run(get_platform(), mesh, g, given, target, shape),
            self._local,
        )

    def redistribute(
        self,
        device_mesh: DeviceMesh | Layout | None = None,
        placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        """The same tensor laid out by ``placements`` (or by a ``Layout``) on the same mesh (differentiable)."""
        if isinstance(device_mesh, Layout):
            target = _as_layout(device_mesh, placements, self.ndim)
        else:
            mesh = self._layout.mesh if device_mesh is None else device_mesh
            if mesh != self._layout.mesh:
                raise ValueError(f"redistribute cannot change the mesh: {self._layout.mesh} -> {mesh}")
            if placements is None:
                raise TypeError("redistribute needs placements (or a Layout)")
            target = Layout.from_placements(self._layout.mesh, placements, self.ndim)
        source = self._layout
        if target == source:
            return self
        _redistribute.plan(source, target)  # validates before anything runs
        target.local_shape(self._shape)
        mesh, shape = source.mesh, self._shape
        grad_src, grad_dst = _redistribute.grad_layout(target), _redistribute.grad_layout(source)
        local = get_platform().custom_function(
            lambda x: _redistribute.run(get_platform(), mesh, x, source, target, shape),
            lambda g: _redistribute.run(get_platform(), mesh, g, grad_src, grad_dst, shape),
            self._local,
        )
        return DTensor(local, source._derive(target._shards, target._partial), shape)

    def full_tensor(self, grad_placements: Sequence[Placement] | None = None) -> Any:
        """The whole tensor on every rank (differentiable; see :meth:`to_local` for ``grad_placements``)."""
        replicated = self.redistribute(self._layout.mesh, [Replicate()] * self._layout.mesh.ndim)
        return replicated.to_local(grad_placements)

    def to_torch(self) -> Any:
        """A ``torch.distributed.tensor.DTensor`` with this piece, on ``device_mesh.to_torch()`` (torch jobs)."""
        layout = self._layout
        return get_platform().native_dtensor(
            self._local, layout.mesh.to_torch(), _redistribute.placement_descs(layout), self._shape
        )

    def __repr__(self) -> str:
        try:
            where: Any = self.placements
        except ValueError:
            where = self._layout.alias_tensor_map
        return f"DTensor(shape={self._shape}, dtype={self.dtype}, placements={where}, mesh={self._layout.mesh})"


def distribute_tensor(
    tensor: Any, mesh_or_layout: DeviceMesh | Layout, placements: Sequence[Placement] | None = None
) -> DTensor:
    """Cut the same full ``tensor`` (given on every rank) into this rank's piece. No communication.

    ``Partial`` placements are refused: a pending reduction only comes from local computation.
    """
    p = get_platform()
    if not p.is_tensor(tensor):
        raise TypeError(f"distribute_tensor needs a {p.name} tensor, got {type(tensor).__name__}")
    shape = p.shape(tensor)
    target = _as_layout(mesh_or_layout, placements, len(shape))
    if target.partial:
        raise ValueError(f"distribute_tensor cannot create Partial placements ({target.partial})")
    replicated = target._derive(tuple(() for _ in shape), (None,) * len(target.mesh_shape))
    return DTensor(tensor, replicated, shape).redistribute(target)
