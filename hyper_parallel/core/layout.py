"""Layout: a device matrix with named dimensions plus a tensor map (MindSpore's way to say placements).

``Layout((2, 2), ("dp", "tp"))`` describes 4 ranks on a 2x2 grid. Calling it with one alias per
tensor dimension gives the layout of a tensor::

    layout = Layout((2, 2), ("dp", "tp"))
    x_layout = layout("dp", "None")          # rows split over dp, replicated over tp
    w_layout = layout("None", ("dp", "tp"))  # columns split over dp (outer) then tp (inner)

A tensor dimension sharded by a tuple of aliases is split by the first alias first (outer, coarser
pieces), then each piece by the next. ``layout.with_partial("tp")`` marks the tensor as a pending
sum over ``tp``. A layout converts to and from placements: a mesh dimension that shards tensor
dimension ``d`` is ``Shard(d)``, a partial one ``Partial(op)``, any other ``Replicate()``.

The :class:`~hyper_parallel.core.device_mesh.DeviceMesh` of a layout is created the first time it is
needed (``layout.mesh``, or a DTensor built from it) — like every mesh creation, on every rank.
Layouts derived from one layout (by calling it) share that mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hyper_parallel.core.placement_types import PARTIAL_OPS, Partial, Placement, Replicate, Shard, check_placements

if TYPE_CHECKING:
    from hyper_parallel.core.device_mesh import DeviceMesh

NONE = "None"


def _product(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


class _MeshHolder:
    """The DeviceMesh of a device matrix, created on first use and shared by derived layouts."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...], ranks: tuple[int, ...],
                 mesh: DeviceMesh | None = None) -> None:
        self.shape, self.names, self.ranks = shape, names, ranks
        self.mesh = mesh

    def get(self) -> DeviceMesh:
        if self.mesh is None:
            from hyper_parallel.core.device_mesh import DeviceMesh
            from hyper_parallel.platform import get_platform

            self.mesh = DeviceMesh(get_platform().device_type, self.ranks, self.shape, self.names)
        return self.mesh


class Layout:
    """A device matrix (``mesh_shape`` with ``alias_name`` per dimension) and, once called, a tensor map.

    ``rank_list`` lists the global ranks of the matrix in row-major order (default ``0..n-1``).
    """

    def __init__(self, mesh_shape: Sequence[int], alias_name: Sequence[str], rank_list: Sequence[int] | None = None):
        shape = tuple(mesh_shape)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"mesh_shape must be a non-empty sequence of positive ints, got {mesh_shape!r}")
        if isinstance(alias_name, str):
            raise TypeError(f"alias_name must be a sequence of names, got the string {alias_name!r}")
        names = tuple(alias_name)
        if len(names) != len(shape):
            raise ValueError(f"alias_name {list(names)} has {len(names)} names for mesh_shape {list(shape)}")
        for n in names:
            if not isinstance(n, str) or not n or n == NONE:
                raise ValueError(f"alias names must be non-empty strings other than 'None', got {n!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"alias names must be distinct, got {list(names)}")
        ranks = tuple(range(_product(shape))) if rank_list is None else tuple(int(r) for r in rank_list)
        if len(ranks) != _product(shape) or len(set(ranks)) != len(ranks):
            raise ValueError(f"rank_list {list(ranks)} must hold {_product(shape)} distinct ranks for {list(shape)}")
        self._holder = _MeshHolder(shape, names, ranks)
        self._shards: tuple[tuple[int, ...], ...] | None = None
        self._partial: tuple[str | None, ...] = (None,) * len(shape)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh) -> Layout:
        """A layout (no tensor map yet) over an existing mesh; its dims are the mesh's dim names."""
        out = cls(mesh.shape, mesh.mesh_dim_names, mesh.ranks)
        out._holder.mesh = mesh
        return out

    @classmethod
    def from_placements(cls, mesh: DeviceMesh, placements: Sequence[Placement], ndim: int) -> Layout:
        """The layout of an ``ndim``-D tensor placed on ``mesh`` by ``placements``."""
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 0:
            raise ValueError(f"ndim must be a non-negative int, got {ndim!r}")
        placements = check_placements(placements, mesh.ndim, ndim)
        out = cls.from_device_mesh(mesh)
        shards: list[list[int]] = [[] for _ in range(ndim)]
        partial: list[str | None] = [None] * mesh.ndim
        for m, p in enumerate(placements):
            if isinstance(p, Shard):
                shards[p.dim].append(m)
            elif isinstance(p, Partial):
                partial[m] = p.reduce_op
        out._shards = tuple(tuple(s) for s in shards)
        out._partial = tuple(partial)
        return out

    def _derive(self, shards: tuple[tuple[int, ...], ...] | None, partial: tuple[str | None, ...]) -> Layout:
        out = object.__new__(Layout)
        out._holder = self._holder
        out._shards = shards
        out._partial = partial
        return out

    def _mesh_dim(self, alias: str) -> int:
        if alias not in self.alias_name:
            raise ValueError(f"alias {alias!r} is not a dimension of the device matrix {list(self.alias_name)}")
        return self.alias_name.index(alias)

    def __call__(self, *alias_tensor_map: str | Sequence[str]) -> Layout:
        """The layout of a tensor: one alias, ``"None"`` or a tuple of aliases per tensor dimension."""
        shards: list[tuple[int, ...]] = []
        used: dict[int, int] = {}
        for tdim, entry in enumerate(alias_tensor_map):
            aliases = (entry,) if isinstance(entry, str) else tuple(entry)
            if not isinstance(entry, str) and any(a == NONE for a in aliases):
                raise ValueError(f"tensor dim {tdim}: 'None' cannot appear inside a tuple of aliases {entry!r}")
            mesh_dims = []
            for alias in aliases:
                if alias == NONE:
                    continue
                if not isinstance(alias, str):
                    raise TypeError(f"tensor dim {tdim}: aliases are strings, got {alias!r}")
                m = self._mesh_dim(alias)
                if m in used:
                    raise ValueError(
                        f"alias {alias!r} shards tensor dims {used[m]} and {tdim}; each alias may be used once"
                    )
                used[m] = tdim
                mesh_dims.append(m)
            shards.append(tuple(mesh_dims))
        for m, op in enumerate(self._partial):
            if op is not None and m in used:
                raise ValueError(f"alias {self.alias_name[m]!r} cannot shard a tensor dim and be partial")
        return self._derive(tuple(shards), self._partial)

    def with_partial(self, *aliases: str, reduce_op: str = "sum") -> Layout:
        """The same layout marked as a pending ``reduce_op`` over the given aliases."""
        if reduce_op not in PARTIAL_OPS:
            raise ValueError(f"reduce_op must be one of {', '.join(PARTIAL_OPS)}, got {reduce_op!r}")
        partial = list(self._partial)
        sharding = {m for dims in (self._shards or ()) for m in dims}
        for alias in aliases:
            m = self._mesh_dim(alias)
            if m in sharding:
                raise ValueError(f"alias {alias!r} shards a tensor dim; it cannot also be partial")
            partial[m] = reduce_op
        return self._derive(self._shards, tuple(partial))

    # ------------------------------------------------------------------ the device matrix
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self._holder.shape

    @property
    def alias_name(self) -> tuple[str, ...]:
        return self._holder.names

    @property
    def rank_list(self) -> tuple[int, ...]:
        return self._holder.ranks

    @property
    def mesh(self) -> DeviceMesh:
        """The DeviceMesh of the device matrix (created on first use, on every rank)."""
        return self._holder.get()

    # ------------------------------------------------------------------ the tensor map
    def _require_map(self) -> tuple[tuple[int, ...], ...]:
        if self._shards is None:
            raise ValueError(
                f"{self!r} has no tensor map yet: call it with one alias (or 'None') per tensor dimension, "
                "e.g. layout('dp', 'None')"
            )
        return self._shards

    @property
    def has_tensor_map(self) -> bool:
        return self._shards is not None

    @property
    def ndim(self) -> int:
        """Number of tensor dimensions the tensor map describes."""
        return len(self._require_map())

    @property
    def shard_dims(self) -> tuple[tuple[int, ...], ...]:
        """Per tensor dimension, the mesh dimensions that split it, outer first (empty: not split)."""
        return self._require_map()

    @property
    def alias_tensor_map(self) -> tuple[str | tuple[str, ...], ...]:
        """The tensor map in aliases: ``"None"``, one alias, or a tuple of aliases per tensor dimension."""
        out: list[str | tuple[str, ...]] = []
        for dims in self._require_map():
            names = tuple(self.alias_name[m] for m in dims)
            out.append(NONE if not names else names[0] if len(names) == 1 else names)
        return tuple(out)

    @property
    def tensor_map(self) -> tuple[int | tuple[int, ...], ...]:
        """MindSpore's tensor map: device-matrix dims counted from the right (last = 0), ``-1`` = not split."""
        n = len(self.mesh_shape)
        out: list[int | tuple[int, ...]] = []
        for dims in self._require_map():
            ids = tuple(n - 1 - m for m in dims)
            out.append(-1 if not ids else ids[0] if len(ids) == 1 else ids)
        return tuple(out)

    @property
    def partial(self) -> dict[str, str]:
        """``{alias: reduce_op}`` of the mesh dimensions where the tensor is a pending reduction."""
        return {self.alias_name[m]: op for m, op in enumerate(self._partial) if op is not None}

    def to_placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dimension.

        Placements split a tensor dimension over several mesh dims in mesh-dim order (lower = outer);
        a tensor map that splits in another order, e.g. ``(("tp", "dp"),)`` on a ``("dp", "tp")``
        matrix, has no placements and raises ``ValueError``.
        """
        shards = self._require_map()
        out: list[Placement] = [Replicate()] * len(self.mesh_shape)
        for tdim, dims in enumerate(shards):
            if list(dims) != sorted(dims):
                names = tuple(self.alias_name[m] for m in dims)
                raise ValueError(
                    f"tensor dim {tdim} is split over {names} (outer first), which is not the device matrix order "
                    f"{self.alias_name}: placements cannot express it; use the layout itself"
                )
            for m in dims:
                out[m] = Shard(tdim)
        for m, op in enumerate(self._partial):
            if op is not None:
                out[m] = Partial(op)
        return tuple(out)

    # ------------------------------------------------------------------ shapes
    def split_counts(self) -> tuple[int, ...]:
        """Per tensor dimension, how many pieces it is cut into."""
        return tuple(_product([self.mesh_shape[m] for m in dims]) for dims in self._require_map())

    def local_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of each rank's piece; ValueError when a dimension does not divide evenly."""
        shape = tuple(global_shape)
        if len(shape) != self.ndim:
            raise ValueError(f"shape {list(shape)} has {len(shape)} dims but the layout describes {self.ndim}")
        out = []
        for tdim, (size, count) in enumerate(zip(shape, self.split_counts(), strict=True)):
            if size % count:
                names = tuple(self.alias_name[m] for m in self.shard_dims[tdim])
                raise ValueError(
                    f"tensor dim {tdim} of size {size} cannot be split evenly over {names} ({count} pieces); "
                    "uneven shards are not supported"
                )
            out.append(size // count)
        return tuple(out)

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the whole tensor whose pieces have ``local_shape``."""
        shape = tuple(local_shape)
        if len(shape) != self.ndim:
            raise ValueError(f"local shape {list(shape)} has {len(shape)} dims but the layout describes {self.ndim}")
        return tuple(s * c for s, c in zip(shape, self.split_counts(), strict=True))

    # ------------------------------------------------------------------ identity
    def _key(self) -> tuple[Any, ...]:
        return (self.mesh_shape, self.alias_name, self.rank_list, self._shards, self._partial)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        text = f"Layout(mesh_shape={self.mesh_shape}, alias_name={self.alias_name}"
        if self._shards is not None:
            text += f", tensor_map={self.alias_tensor_map}"
        if self.partial:
            text += f", partial={self.partial}"
        return text + ")"
