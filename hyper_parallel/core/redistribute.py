"""Moving a distributed tensor's local piece from one layout to another.

A layout says, per tensor dimension, which mesh dimensions split it (outer first) and, per mesh
dimension, whether the values are a pending reduction. :func:`plan` turns a pair of layouts into a
list of steps, each on one mesh dimension:

* ``gather``  — all-gather pieces along a tensor dim (Shard -> Replicate),
* ``all_to_all`` — swap which tensor dim a mesh dim splits (Shard(i) -> Shard(j)),
* ``all_reduce`` — finish a pending reduction (Partial -> Replicate),
* ``reduce_scatter`` — finish it and keep this rank's piece (Partial -> Shard),
* ``slice``   — keep this rank's piece of a replicated dim (Replicate -> Shard, no communication).

A tensor dim split over several mesh dims can only be gathered innermost-first and split
outermost-first, so the mesh dims two layouts share as a common outer prefix stay untouched and the
rest is gathered (inner first) and then split again (outer first). Redistributing *to* a pending
reduction is refused (as torch does): nothing produces a Partial except the user's own computation.

Pending reductions of different kinds on several mesh dims (``Partial(sum)`` over ``dp``,
``Partial(max)`` over ``tp``) mean nothing without an order when the kinds do not commute (the sum
of maxima is not the maximum of sums): a move that finishes such reductions together is refused
(:func:`check_finishable`); finishing them one move at a time says the order. ``sum`` and ``avg``
commute (both linear), as does any kind with itself.

:func:`run` executes a plan with the platform collectives, or hands the whole move to the
framework's own distributed tensor when the platform has one (torch jobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hyper_parallel.core.layout import Layout
from hyper_parallel.core.placement_types import Partial, Shard

if TYPE_CHECKING:
    from hyper_parallel.core.device_mesh import DeviceMesh
    from hyper_parallel.platform.base import Group, Platform


@dataclass(frozen=True)
class Step:
    """One move on mesh dim ``mesh_dim``: ``kind`` with tensor dims ``dim`` (and ``to_dim``) and ``op``."""

    kind: str
    mesh_dim: int
    dim: int = -1
    to_dim: int = -1
    op: str = "sum"


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k


def check_compatible(src: Layout, dst: Layout) -> None:
    if src.mesh_shape != dst.mesh_shape or src.rank_list != dst.rank_list or src.alias_name != dst.alias_name:
        raise ValueError(
            f"cannot redistribute between different meshes: {src.mesh_shape} {src.alias_name} ranks "
            f"{list(src.rank_list)} vs {dst.mesh_shape} {dst.alias_name} ranks {list(dst.rank_list)}"
        )
    if src.ndim != dst.ndim:
        raise ValueError(f"the target layout describes {dst.ndim} tensor dims, the tensor has {src.ndim}")


_LINEAR_OPS = frozenset({"sum", "avg"})


def check_finishable(src: Layout, dst: Layout) -> None:
    """Refuse a move that finishes pending reductions whose kinds do not commute (see the module docstring)."""
    finished = {src.alias_name[m]: a for m, (a, b) in enumerate(zip(src._partial, dst._partial, strict=True))
                if a is not None and b is None}
    kinds = set(finished.values())
    if len(kinds) > 1 and not kinds <= _LINEAR_OPS:
        which = ", ".join(f"Partial({op}) over {name!r}" for name, op in finished.items())
        raise ValueError(
            f"cannot finish {which} in one redistribute: these reductions do not commute, so the result "
            "would depend on their order; finish one mesh dim at a time (e.g. keep the others Partial) "
            "in the order you mean"
        )


def plan(src: Layout, dst: Layout) -> list[Step]:
    """The steps that move a local piece from layout ``src`` to ``dst`` (see the module docstring)."""
    check_compatible(src, dst)
    src_partial, dst_partial = src._partial, dst._partial
    for m, (a, b) in enumerate(zip(src_partial, dst_partial, strict=True)):
        if b is not None and a != b:
            have = f"Partial({a})" if a else "not partial"
            raise ValueError(
                f"cannot redistribute to Partial({b}) on mesh dim {src.alias_name[m]!r} (the tensor is {have}): "
                "a pending reduction only comes from local computation (use DTensor.from_local)"
            )
    check_finishable(src, dst)
    gathers: list[tuple[int, int]] = []  # (mesh dim, tensor dim), in execution order
    slices: dict[int, list[int]] = {}  # tensor dim -> mesh dims to split it over, outer first
    for d, (s, t) in enumerate(zip(src.shard_dims, dst.shard_dims, strict=True)):
        k = _common_prefix(s, t)
        gathers.extend((m, d) for m in reversed(s[k:]))
        if t[k:]:
            slices[d] = list(t[k:])
    steps: list[Step] = []
    swaps: list[Step] = []
    gathered_dims = {d for _, d in gathers}
    for m, i in list(gathers):
        # Shard(i) -> Shard(j) on mesh dim m as one all_to_all when m is the only change on both dims
        if [g for g in gathers if g[1] == i] != [(m, i)]:
            continue
        for j, ms in slices.items():
            if j != i and ms == [m] and j not in gathered_dims:
                swaps.append(Step("all_to_all", m, i, j))
                gathers.remove((m, i))
                del slices[j]
                break
    steps.extend(Step("gather", m, d) for m, d in gathers)
    steps.extend(swaps)
    sliced = {m for ms in slices.values() for m in ms}
    for m, op in enumerate(src_partial):
        if op is not None and dst_partial[m] is None and m not in sliced:
            steps.append(Step("all_reduce", m, op=op))
    for d, ms in slices.items():
        for m in ms:
            op = src_partial[m]
            steps.append(Step("reduce_scatter", m, d, op=op) if op else Step("slice", m, d))
    return steps


def grad_layout(layout: Layout) -> Layout:
    """The layout a gradient of ``layout`` has by default: pending reductions become replicated."""
    return layout._derive(layout._shards, (None,) * len(layout.mesh_shape))


def placement_descs(layout: Layout) -> tuple[tuple[Any, ...], ...]:
    """Placements as the platform boundary's tuples."""
    out: list[tuple[Any, ...]] = []
    for p in layout.to_placements():
        if isinstance(p, Shard):
            out.append(("shard", p.dim))
        elif isinstance(p, Partial):
            out.append(("partial", p.reduce_op))
        else:
            out.append(("replicate",))
    return tuple(out)


def _native_ok(platform: Platform, mesh: DeviceMesh, src: Layout, dst: Layout) -> bool:
    if not platform.native_dtensor_available() or not mesh.lines_ascending():
        return False
    if len({op for op in src._partial if op is not None}) > 1:
        return False  # torch refuses (or, in some versions, miscomputes) mixed kinds: ours does them
    for layout in (src, dst):
        if any(list(dims) != sorted(dims) for dims in layout.shard_dims):
            return False
    return True


class _Executor:
    """Runs steps with the platform collectives; every group is checked before anything is sent."""

    def __init__(self, platform: Platform, mesh: DeviceMesh, steps: Sequence[Step]) -> None:
        self.p = platform
        self.mesh = mesh
        self.steps: list[tuple[Step, str]] = []
        for step in steps:
            if mesh.size(step.mesh_dim) == 1:
                continue  # one rank along this dim: every move is the identity
            kind = step.kind
            if kind != "slice":
                group = mesh.get_group(step.mesh_dim)  # raises when the dim has no group
                kind = self._runnable(step, group)
            self.steps.append((step, kind))

    def _runnable(self, step: Step, group: Group) -> str:
        """The step's kind, or a fallback the engine can run; RuntimeError when none can."""
        p, kind = self.p, step.kind
        fallback = {"reduce_scatter": "all_reduce", "all_to_all": "all_gather"}.get(kind)
        native_op = {"gather": "all_gather"}.get(kind, kind)
        reason = p.collective_unsupported_reason(native_op, group)
        if reason is None:
            return kind
        if fallback is not None and p.collective_unsupported_reason(fallback, group) is None:
            return f"{kind}_via_{fallback}"
        name = self.mesh.mesh_dim_names[step.mesh_dim]
        raise RuntimeError(f"cannot redistribute over mesh dim {name!r}: {reason}")

    def _pieces_in_mesh_order(self, pieces: Sequence[Any], group: Group, m: int) -> list[Any]:
        return [pieces[group.group_rank(r)] for r in self.mesh.line(m)]

    def _to_group_order(self, pieces: Sequence[Any], group: Group, m: int) -> list[Any]:
        out: list[Any] = [None] * group.size
        for piece, r in zip(pieces, self.mesh.line(m), strict=True):
            out[group.group_rank(r)] = piece
        return out

    def run(self, x: Any) -> Any:
        p, mesh = self.p, self.mesh
        for step, kind in self.steps:
            m = step.mesh_dim
            n, me = mesh.size(m), mesh.get_local_rank(m)
            if kind == "slice":
                x = p.chunk(x, n, step.dim)[me]
                continue
            group = mesh.get_group(m)
            if kind in ("gather", "all_to_all_via_all_gather"):
                x = p.cat(self._pieces_in_mesh_order(p.all_gather(x, group), group, m), step.dim)
                if kind != "gather":
                    x = p.chunk(x, n, step.to_dim)[me]
            elif kind == "all_to_all":
                sent = self._to_group_order(p.chunk(x, n, step.to_dim), group, m)
                x = p.cat(self._pieces_in_mesh_order(p.all_to_all(sent, group), group, m), step.dim)
            elif kind in ("all_reduce", "reduce_scatter_via_all_reduce"):
                x = p.all_reduce(p.clone(x), step.op, group)
                if kind != "all_reduce":
                    x = p.chunk(x, n, step.dim)[me]
            elif kind == "reduce_scatter":
                x = p.reduce_scatter(self._to_group_order(p.chunk(x, n, step.dim), group, m), step.op, group)
            else:  # pragma: no cover - plan() makes no other kind
                raise AssertionError(kind)
        return x


def run(platform: Platform, mesh: DeviceMesh, local: Any, src: Layout, dst: Layout, shape: Sequence[int]) -> Any:
    """``local`` (this rank's piece under ``src``) moved to ``dst``; no autograd is recorded.

    Everything that can fail locally (layouts, shapes, missing groups or collectives) fails before
    any communication.
    """
    steps = plan(src, dst)
    dst.local_shape(shape)  # uneven target pieces raise here
    if not steps:
        return local
    if _native_ok(platform, mesh, src, dst):
        return platform.native_redistribute(local, mesh.to_torch(), placement_descs(src), placement_descs(dst), shape)
    return _Executor(platform, mesh, steps).run(local)
