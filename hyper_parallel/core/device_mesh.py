"""DeviceMesh: ranks laid out on an n-dimensional grid with named dimensions.

Every rank builds the same mesh. At construction the communication group of every line along
every dimension is created, in the same order on every rank (torch requires it), and each rank
keeps the groups it belongs to; ``get_group(dim)`` returns them without creating anything.
``mesh["pp"]`` / ``mesh["pp", "dp"]`` are sub-meshes through this rank that share those groups;
``flatten()`` merges dimensions into one and creates the groups of the merged dimension once
(call it on every rank, like the constructor).

On torch the groups are real ``torch.distributed`` process groups: ``mesh.get_group("dp").native``
(or ``mesh.get_torch_group("dp")``) drops into any ``torch.distributed`` call, ``mesh.to_torch()``
gives a ``torch.distributed.device_mesh.DeviceMesh`` over the same groups (for FSDP2 and torch's
DTensor), and ``DeviceMesh.from_torch(torch_mesh)`` wraps one.

A communicator that cannot create a group (MindSpore's CPU build has only the world group) leaves
that dimension without one: the mesh is still built, and ``get_group`` on it raises with the reason.
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


def _flatten_nested(mesh: Any) -> tuple[list[int], tuple[int, ...]]:
    """Ranks and shape of a nested list (or anything with ``tolist()``) of ints."""
    if hasattr(mesh, "tolist"):
        mesh = mesh.tolist()
    if not isinstance(mesh, (list, tuple)):
        return [int(mesh)], ()
    if not mesh:
        raise ValueError("a device mesh needs at least one rank")
    parts = [_flatten_nested(m) for m in mesh]
    shapes = {s for _, s in parts}
    if len(shapes) != 1:
        raise ValueError(f"mesh {mesh!r} is ragged: its rows have shapes {sorted(shapes)}")
    return [r for ranks, _ in parts for r in ranks], (len(mesh), *shapes.pop())


class DeviceMesh:
    """A grid of global ranks.

    ``DeviceMesh(device_type, ranks, shape, mesh_dim_names)`` takes the ranks in row-major order;
    ``DeviceMesh(device_type, [[0, 1], [2, 3]], mesh_dim_names=...)`` takes them as nested lists.
    Constructing a mesh creates its groups: every rank of the world must construct it.
    """

    def __init__(
        self,
        device_type: str,
        ranks: Any,
        shape: Sequence[int] | None = None,
        mesh_dim_names: Sequence[str] | None = None,
        *,
        _groups: dict[int, Group] | None = None,
    ) -> None:
        if shape is None:
            flat, inferred = _flatten_nested(ranks)
            if not inferred:
                raise ValueError(f"a mesh given without shape must be a nested list of ranks, got {ranks!r}")
            ranks, shape = flat, inferred
        self._init_fields(device_type, ranks, shape, mesh_dim_names)
        # root state: groups through this rank keyed by the tuple of root dims they span
        self._root = self
        self._root_dims: tuple[tuple[int, ...], ...] = tuple((d,) for d in range(self.ndim))
        # a group, or (exception type, message) when this rank has none along those dims
        self._groups: dict[tuple[int, ...], Group | tuple[type[Exception], str]] = {}
        self._flat_names: dict[str, tuple[int, ...]] = {}
        for dim, group in (_groups or {}).items():
            self._adopt_group(dim, group)
        for dim in range(self.ndim):
            if (dim,) not in self._groups:
                self._create_groups((dim,))

    def _init_fields(self, device_type: str, ranks: Sequence[int], shape: Sequence[int],
                     names: Sequence[str] | None) -> None:
        self.device_type = device_type
        self.shape = tuple(int(s) for s in shape)
        self.ranks = tuple(int(r) for r in ranks)
        if not self.shape or any(s < 1 for s in self.shape) or _product(self.shape) != len(self.ranks):
            raise ValueError(f"mesh shape {list(self.shape)} does not hold {len(self.ranks)} ranks")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"mesh ranks must be distinct, got {list(self.ranks)}")
        if names is None:
            names = tuple(f"dim{i}" for i in range(len(self.shape)))
        if isinstance(names, str):
            raise TypeError(f"mesh_dim_names must be a sequence of names, got the string {names!r}")
        self.mesh_dim_names = tuple(names)
        if len(self.mesh_dim_names) != len(self.shape):
            raise ValueError(
                f"mesh_dim_names {list(self.mesh_dim_names)} does not match mesh shape {list(self.shape)}"
            )
        if len(set(self.mesh_dim_names)) != len(self.mesh_dim_names):
            raise ValueError(f"mesh_dim_names must be distinct, got {list(self.mesh_dim_names)}")
        self._platform = get_platform()
        self._rank = self._platform.rank
        self._native_mesh: Any = None

    @classmethod
    def _view(cls, root: DeviceMesh, root_dims: Sequence[tuple[int, ...]], names: Sequence[str]) -> DeviceMesh:
        """The mesh through this rank spanning ``root_dims`` (each entry: root dims merged, outer first)."""
        coord = root.get_coordinate()
        if coord is None:
            raise ValueError(f"rank {root._rank} is not part of mesh {list(root.ranks)}")
        shape = [_product([root.shape[d] for d in dims]) for dims in root_dims]
        ranks = []
        for sub in itertools.product(*(range(n) for n in shape)):
            full = list(coord)
            for dims, index in zip(root_dims, sub, strict=True):
                for d in reversed(dims):
                    full[d] = index % root.shape[d]
                    index //= root.shape[d]
            ranks.append(root._rank_at(full))
        out = object.__new__(cls)
        out._init_fields(root.device_type, ranks, shape, names)
        out._root = root
        out._root_dims = tuple(tuple(d) for d in root_dims)
        return out

    # ------------------------------------------------------------------ groups (root only)
    def _lines(self, dims: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every line of ranks spanning root ``dims`` (row-major over them), in a fixed order."""
        others = [range(n) if d not in dims else range(1) for d, n in enumerate(self.shape)]
        lines = []
        for start in itertools.product(*others):
            coord = list(start)
            line = []
            for sub in itertools.product(*(range(self.shape[d]) for d in dims)):
                for d, c in zip(dims, sub, strict=True):
                    coord[d] = c
                line.append(self._rank_at(coord))
            lines.append(tuple(line))
        return lines

    def _create_groups(self, dims: tuple[int, ...]) -> None:
        """Create the groups of every line along ``dims`` (same order on every rank); keep ours."""
        mine: Group | tuple[type[Exception], str] = (
            ValueError, f"rank {self._rank} is not part of mesh {list(self.ranks)}"
        )
        for line in self._lines(dims):
            reason = self._platform.group_unsupported_reason(line)
            group = None if reason else self._platform.new_group(line)
            if self._rank in line:
                mine = group if group is not None else (RuntimeError, f"no group for ranks {list(line)}: {reason}")
        self._groups[dims] = mine

    def _adopt_group(self, dim: int, group: Any) -> None:
        group = group if isinstance(group, Group) else self._platform.group_from_native(group)
        coord = self.get_coordinate()
        if coord is None:
            raise ValueError(f"rank {self._rank} is not part of mesh {list(self.ranks)}")
        line = self._line(dim, coord)
        if sorted(group.ranks) != sorted(line):
            raise ValueError(
                f"the group given for mesh dim {self.mesh_dim_names[dim]!r} has ranks {list(group.ranks)} but the "
                f"mesh line through rank {self._rank} is {list(line)}"
            )
        self._groups[(dim,)] = group

    def _group_of(self, dims: tuple[int, ...], name: str) -> Group:
        if dims not in self._groups:
            self._create_groups(dims)
        group = self._groups[dims]
        if isinstance(group, tuple):
            kind, message = group
            raise kind(f"mesh dim {name!r}: {message}")
        return group

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
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int):
            raise TypeError(f"a mesh dimension is a name or an int, got {mesh_dim!r}")
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dimension {mesh_dim} out of range for a {self.ndim}-D mesh")
        return mesh_dim % self.ndim

    def _one_dim(self, mesh_dim: int | str | None) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"a {self.ndim}-D mesh needs mesh_dim (one of {list(self.mesh_dim_names)})")
            return 0
        return self._dim(mesh_dim)

    def line(self, mesh_dim: int | str | None = None) -> tuple[int, ...]:
        """The ranks along ``mesh_dim`` through this rank, in mesh-coordinate order."""
        coord = self.get_coordinate()
        if coord is None:
            raise ValueError(f"rank {self._rank} is not part of mesh {list(self.ranks)}")
        return self._line(self._one_dim(mesh_dim), coord)

    def lines_ascending(self) -> bool:
        """Whether every line of every dimension lists its ranks in increasing order.

        A process group orders its ranks increasingly, so only then is a rank's coordinate along a
        dimension also its rank in that dimension's group (torch's DeviceMesh assumes it).
        """
        strides = _strides(self.shape)
        return all(
            self.ranks[i] < self.ranks[i + strides[d]]
            for d in range(self.ndim)
            for i in range(len(self.ranks))
            if (i // strides[d]) % self.shape[d] + 1 < self.shape[d]
        )

    # ------------------------------------------------------------------ queries
    def get_rank(self) -> int:
        return self._rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate in the mesh, or ``None`` if it is not part of it."""
        return self._coordinate_of(self._rank)

    def size(self, mesh_dim: int | str | None = None) -> int:
        return len(self.ranks) if mesh_dim is None else self.shape[self._dim(mesh_dim)]

    def get_group(self, mesh_dim: int | str | None = None) -> Group:
        """The group along ``mesh_dim`` that contains this rank (created with the mesh, then cached).

        ``group.native`` is the framework's object: a ``torch.distributed`` ProcessGroup on torch.
        """
        dim = self._one_dim(mesh_dim)
        return self._root._group_of(self._root_dims[dim], self.mesh_dim_names[dim])

    def get_torch_group(self, mesh_dim: int | str | None = None) -> Any:
        """The ``torch.distributed`` ProcessGroup along ``mesh_dim`` (torch processes only)."""
        return self._platform.native_process_group(self.get_group(mesh_dim))

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's coordinate along ``mesh_dim``."""
        coord = self.get_coordinate()
        if coord is None:
            raise ValueError(f"rank {self._rank} is not part of mesh {list(self.ranks)}")
        return coord[self._one_dim(mesh_dim)]

    def _resolve(self, name: str | int) -> tuple[int, ...]:
        """Root dims of one of this mesh's dims, or of a flattened dim registered on the root."""
        if isinstance(name, str) and name not in self.mesh_dim_names and name in self._root._flat_names:
            dims = self._root._flat_names[name]
            mine = {d for ds in self._root_dims for d in ds}
            if set(dims) <= mine:
                return dims
        return self._root_dims[self._dim(name)]

    def __getitem__(self, names: str | int | Sequence[str | int]) -> DeviceMesh:
        """The sub-mesh through this rank spanning the named dimensions (in the given order)."""
        wanted = (names,) if isinstance(names, (str, int)) else tuple(names)
        if not wanted:
            raise ValueError("select at least one mesh dimension")
        dims = [self._resolve(n) for n in wanted]
        flat = [d for ds in dims for d in ds]
        if len(set(flat)) != len(flat):
            raise ValueError(f"repeated mesh dimension in {list(wanted)}")
        labels = [n if isinstance(n, str) else self.mesh_dim_names[self._dim(n)] for n in wanted]
        return DeviceMesh._view(self._root, dims, labels)

    def flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """This mesh as one dimension (row-major over its dims), named ``mesh_dim_name``.

        The default name joins the dimension names with ``_``. Creates the merged dimension's groups
        the first time: call it on every rank. The root mesh then also answers ``mesh[name]``.
        """
        root = self._root
        dims = tuple(d for ds in self._root_dims for d in ds)
        name = mesh_dim_name if mesh_dim_name is not None else "_".join(self.mesh_dim_names)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a flattened dimension needs a non-empty name, got {name!r}")
        if name in root.mesh_dim_names and root._root_dims[root.mesh_dim_names.index(name)] != dims:
            raise ValueError(f"{name!r} already names a dimension of the mesh {list(root.mesh_dim_names)}")
        known = root._flat_names.get(name)
        if known is not None and known != dims:
            raise ValueError(f"{name!r} already names a flattened dimension spanning other dimensions")
        if len(dims) > 1:
            root._flat_names[name] = dims
        if dims not in root._groups:
            root._create_groups(dims)
        return DeviceMesh._view(root, [dims], [name])

    # ------------------------------------------------------------------ construction from groups
    @classmethod
    def from_group(
        cls,
        group: Any,
        device_type: str | None = None,
        mesh: Any = None,
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> DeviceMesh:
        """A mesh over existing groups (ours or the framework's): no group is created.

        One group gives a 1-D mesh (its ranks, or ``mesh`` when given, in that order). A list of
        groups, one per dimension (each the line through this rank), needs ``mesh`` (nested ranks).
        """
        platform = get_platform()
        device_type = device_type or platform.device_type
        if isinstance(group, (list, tuple)):
            groups = [g if isinstance(g, Group) else platform.group_from_native(g) for g in group]
            if mesh is None:
                raise ValueError("a mesh built from several groups needs mesh= (the nested ranks)")
            ranks, shape = _flatten_nested(mesh)
            if len(shape) != len(groups):
                raise ValueError(f"{len(groups)} groups given for a {len(shape)}-D mesh {mesh!r}")
        else:
            one = group if isinstance(group, Group) else platform.group_from_native(group)
            groups = [one]
            ranks = list(one.ranks) if mesh is None else _flatten_nested(mesh)[0]
            shape = (len(ranks),)
        return cls(device_type, ranks, shape, mesh_dim_names, _groups=dict(enumerate(groups)))

    # ------------------------------------------------------------------ torch interoperability
    def to_torch(self) -> Any:
        """A ``torch.distributed.device_mesh.DeviceMesh`` over this mesh's groups (torch processes only)."""
        if self._native_mesh is None:
            if not self.lines_ascending():
                raise ValueError(
                    f"{self!r} lists ranks in decreasing order along a dimension; torch's DeviceMesh needs every "
                    "line in increasing rank order (its group order)"
                )
            groups = [self.get_group(d) for d in range(self.ndim)]
            self._native_mesh = self._platform.native_device_mesh(
                self.device_type, self.mesh, groups, self.mesh_dim_names
            )
        return self._native_mesh

    @classmethod
    def from_torch(cls, torch_mesh: Any) -> DeviceMesh:
        """Wrap a ``torch.distributed.device_mesh.DeviceMesh``; its process groups are reused."""
        device_type, nested, names, groups = get_platform().mesh_from_native(torch_mesh)
        out = cls.from_group(list(groups), device_type, nested, mesh_dim_names=names)
        out._native_mesh = torch_mesh
        return out

    # ------------------------------------------------------------------ identity
    def _key(self) -> tuple[Any, ...]:
        return (self.device_type, self.ranks, self.shape, self.mesh_dim_names)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

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
