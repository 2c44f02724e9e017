"""Placements: how a tensor is laid out along one dimension of a device mesh.

A distributed tensor has one placement per mesh dimension:

* ``Shard(dim)`` — tensor dimension ``dim`` is cut into equal pieces, one per rank of that mesh
  dimension, in mesh-coordinate order;
* ``Replicate()`` — every rank of that mesh dimension holds the same values;
* ``Partial(op)`` — every rank holds a partial value; the tensor is the reduction (``op``) of
  them over that mesh dimension, still pending.

When several mesh dimensions shard the same tensor dimension, the lower mesh dimension is the
outer (coarser) split, as in ``torch.distributed.tensor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PARTIAL_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base class of :class:`Shard`, :class:`Replicate` and :class:`Partial`."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Tensor dimension ``dim`` is split evenly over the ranks of a mesh dimension.

    ``dim`` may be negative (counted from the end); it is resolved against the tensor's rank
    when the placement is used.
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"Shard(dim) needs an int tensor dimension, got {self.dim!r}")

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def normalized(self, ndim: int) -> Shard:
        """The same placement with ``dim`` in ``[0, ndim)``; ValueError when out of range."""
        if not -ndim <= self.dim < ndim:
            raise ValueError(f"Shard(dim={self.dim}) is out of range for a tensor with {ndim} dimensions")
        return Shard(self.dim % ndim)

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank of the mesh dimension holds the whole (local) tensor."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Partial(Placement):
    """Each rank holds a partial value; the tensor is their ``reduce_op`` over the mesh dimension.

    ``reduce_op`` is one of ``"sum"`` (default), ``"avg"``, ``"max"``, ``"min"``.
    """

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in PARTIAL_OPS:
            raise ValueError(f"Partial reduce_op must be one of {', '.join(PARTIAL_OPS)}, got {self.reduce_op!r}")

    def is_partial(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"


def check_placements(placements: Sequence[Placement], mesh_ndim: int, tensor_ndim: int) -> tuple[Placement, ...]:
    """Validate one placement per mesh dimension; returns them with Shard dims made non-negative."""
    if isinstance(placements, Placement):
        raise TypeError("placements must be a sequence with one Placement per mesh dimension, got a single Placement")
    out = tuple(placements)
    if len(out) != mesh_ndim:
        raise ValueError(f"{len(out)} placements {list(out)} given for a {mesh_ndim}-D mesh (one per mesh dimension)")
    for p in out:
        if not isinstance(p, Placement):
            raise TypeError(f"placements must be Shard, Replicate or Partial, got {p!r}")
    return tuple(p.normalized(tensor_ndim) if isinstance(p, Shard) else p for p in out)


def grad_placements_of(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """Placements the gradient of a tensor with ``placements`` has by default: Partial becomes Replicate."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)
