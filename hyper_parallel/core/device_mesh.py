"""DeviceMesh: ranks laid out on an n-dimensional grid with named dimensions.

Every rank builds the same mesh. At construction the communication group of every line
along every dimension is created, in the same order on every rank (as torch requires),
and the mesh keeps the groups its own rank belongs to. ``mesh["pp"]`` is the 1-D sub-mesh
through this rank along ``pp``; it shares the parent's groups.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import Group


def _product(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


class DeviceMesh:
    """A grid of global ranks. ``ranks`` is the row-major flattening of a grid of ``shape``."""

    def __init__(
        self,
        device_type: str,
        ranks: Sequence[int],
        shape: Sequence[int],
        mesh_dim_names: Sequence[str] | None = None,
        *,
        _groups: dict[int, Group] | None = None,
    ) -> None:
        self.device_type = device_type
        self.shape = tuple(int(s) for s in shape)
        self.ranks = tuple(int(r) for r in ranks)
        if any(s < 1 for s in self.shape) or _product(self.shape) != len(self.ranks):
            raise ValueError(f"mesh shape {list(self.shape)} does not hold {len(self.ranks)} ranks")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"mesh ranks must be distinct, got {list(self.ranks)}")
        if mesh_dim_names is None:
            mesh_dim_names = tuple(f"dim{i}" for i in range(len(self.shape)))
        self.mesh_dim_names = tuple(mesh_dim_names)
        if len(self.mesh_dim_names) != len(self.shape):
            raise ValueError(
                f"mesh_dim_names {list(self.mesh_dim_names)} does not match mesh shape {list(self.shape)}"
            )
        if len(set(self.mesh_dim_names)) != len(self.mesh_dim_names):
            raise ValueError(f"mesh_dim_names must be distinct, got {list(self.mesh_dim_names)}")
        self._platform = get_platform()
        self._rank = self._platform.rank
        self._groups = _groups if _groups is not None else self._create_groups()

    # ------------------------------------------------------------------ layout
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def mesh(self) -> list[Any]:
        """The ranks as nested lists of ``shape``."""

        def build(offset: int, dim: int) -> Any:
            if dim == self.ndim:
                return self.ranks[offset]
            stride = _strides(self.shape)[dim]
            return [build(offset + i * stride, dim + 1) for i in range(self.shape[dim])]

        return build(0, 0)

    def _coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        if rank not in self.ranks:
            return None
        flat = self.ranks.index(rank)
        return tuple((flat // s) % n for s, n in zip(_strides(self.shape), self.shape, strict=True))

    def _rank_at(self, coordinate: Sequence[int]) -> int:
        return self.ranks[sum(c * s for c, s in zip(coordinate, _strides(self.shape), strict=True))]

    def _line(self, dim: int, through: Sequence[int]) -> tuple[int, ...]:
        coord = list(through)
        line = []
        for i in range(self.shape[dim]):
            coord[dim] = i
            line.append(self._rank_at(coord))
        return tuple(line)

    def _dim(self, mesh_dim: int | str) -> int:
        if isinstance(mesh_dim, str):
            if mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"mesh has no dimension {mesh_dim!r}; dimensions: {list(self.mesh_dim_names)}")
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dimension {mesh_dim} out of range for a {self.ndim}-D mesh")
        return mesh_dim % self.ndim

    def _create_groups(self) -> dict[int, Group]:
        mine: dict[int, Group] = {}
        my_coord = self._coordinate_of(self._rank)
        for dim in range(self.ndim):
            others = [range(n) if d != dim else range(1) for d, n in enumerate(self.shape)]
            for start in itertools.product(*others):
                line = self._line(dim, start)
                group = self._platform.new_group(line)
                if my_coord is not None and self._rank in line:
                    mine[dim] = group
        return mine

    # ------------------------------------------------------------------ queries
    def get_rank(self) -> int:
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate in the mesh, or ``None`` if it is not part of it."""
        return self._coordinate_of(self._rank)

    def size(self, mesh_dim: int | str | None = None) -> int:
        return len(self.ranks) if mesh_dim is None else self.shape[self._dim(mesh_dim)]

    def get_group(self, mesh_dim: int | str | None = None) -> Group:
        """The group along ``mesh_dim`` that contains this rank."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"a {self.ndim}-D mesh needs mesh_dim (one of {list(self.mesh_dim_names)})")
            mesh_dim = 0
        dim = self._dim(mesh_dim)
        if dim not in self._groups:
            raise ValueError(f"rank {self._rank} is not part of mesh {list(self.ranks)}")
        return self._groups[dim]

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"a {self.ndim}-D mesh needs mesh_dim (one of {list(self.mesh_dim_names)})")
            mesh_dim = 0
        coord = self.get_coordinate()
        if coord is None:
            raise ValueError(f"rank {self._rank} is not part of mesh {list(self.ranks)}")
        return coord[self._dim(mesh_dim)]

    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh through this rank spanning the named dimensions (in the given order)."""
        wanted = (names,) if isinstance(names, str) else tuple(names)
        dims = [self._dim(n) for n in wanted]
        if len(set(dims)) != len(dims):
            raise ValueError(f"repeated mesh dimension in {list(wanted)}")
        coord = self.get_coordinate()
        if coord is None:
            raise ValueError(f"rank {self._rank} is not part of mesh {list(self.ranks)}")
        sub_shape = [self.shape[d] for d in dims]
        sub_ranks = []
        for sub_coord in itertools.product(*(range(n) for n in sub_shape)):
            full = list(coord)
            for d, c in zip(dims, sub_coord, strict=True):
                full[d] = c
            sub_ranks.append(self._rank_at(full))
        groups = {i: self._groups[d] for i, d in enumerate(dims) if d in self._groups}
        return DeviceMesh(self.device_type, sub_ranks, sub_shape, wanted, _groups=groups)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.shape, strict=True))
        return f"DeviceMesh({self.device_type!r}, {dims}, ranks={list(self.ranks)})"


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """A mesh over all ranks of the world, laid out row-major in ``mesh_shape``."""
    shape = tuple(mesh_shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"mesh_shape must be a non-empty sequence of positive ints, got {mesh_shape!r}")
    world = get_platform().world_size
    if _product(shape) != world:
        raise ValueError(f"mesh_shape {list(shape)} has {_product(shape)} ranks but the world size is {world}")
    return DeviceMesh(device_type, range(world), shape, mesh_dim_names)
