"""DTensor checks that run inside one rank (LocalCluster thread or torchrun process).

The oracle is numpy: a dense global array, cut into pieces by ``ref_piece`` — written here from
the definition of a layout (a tensor dim split over mesh dims, outer first, block index row-major
over those mesh coordinates), not with the code under test. Each check returns a list of failure
messages so a test can show every mismatch at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from hyper_parallel.core.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.core.layout import Layout
from hyper_parallel.core.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.platform import get_platform

GLOBAL_SHAPE = (4, 8)


def global_array(seed: int = 0, shape: Sequence[int] = GLOBAL_SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def shard_lists(placements: Sequence[Placement], ndim: int) -> list[list[int]]:
    """Per tensor dim, the mesh dims that shard it, in mesh-dim order (placements' convention)."""
    out: list[list[int]] = [[] for _ in range(ndim)]
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            out[p.dim % ndim].append(m)
    return out


def ref_piece(full: np.ndarray, mesh_shape: Sequence[int], coord: Sequence[int],
              shards: Sequence[Sequence[int]]) -> np.ndarray:
    """The piece of ``full`` a rank at ``coord`` holds when tensor dim d is split over ``shards[d]``."""
    index = []
    for d, dims in enumerate(shards):
        count, block = 1, 0
        for m in dims:  # outer first: row-major block index
            block = block * mesh_shape[m] + coord[m]
            count *= mesh_shape[m]
        size = full.shape[d] // count
        index.append(slice(block * size, (block + 1) * size))
    return full[tuple(index)]


def partial_piece(piece: np.ndarray, placements: Sequence[Placement], mesh_shape: Sequence[int],
                  coord: Sequence[int]) -> np.ndarray:
    """Rank-specific values whose reduction over every Partial mesh dim gives ``piece``."""
    out = piece.astype(np.float64)
    for m, p in enumerate(placements):
        if not isinstance(p, Partial):
            continue
        n, c = mesh_shape[m], coord[m]
        if p.reduce_op == "sum":
            out = out * (c + 1) / (n * (n + 1) / 2)
        elif p.reduce_op == "avg":
            out = out * 2 * (c + 1) / (n + 1)
        elif p.reduce_op == "max":
            out = out - c
        else:
            out = out + c
    return out.astype(np.float32)


def make_local(full: np.ndarray, mesh: DeviceMesh, placements: Sequence[Placement]) -> np.ndarray:
    coord = mesh.get_coordinate()
    piece = ref_piece(full, mesh.shape, coord, shard_lists(placements, full.ndim))
    return partial_piece(piece, placements, mesh.shape, coord)


def placement_set(with_partial: Sequence[str] = ("sum",)) -> list[Placement]:
    return [Shard(0), Shard(1), Replicate(), *(Partial(op) for op in with_partial)]


def all_pairs(mesh_ndim: int, with_partial: Sequence[str] = ("sum",)) -> list[tuple[tuple, tuple]]:
    """Every source combination against every target without a pending reduction."""
    srcs = list(itertools.product(placement_set(with_partial), repeat=mesh_ndim))
    dsts = list(itertools.product(placement_set(()), repeat=mesh_ndim))
    return [(s, d) for s in srcs for d in dsts]


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and np.allclose(got, want, rtol=1e-5, atol=1e-6)


def check_redistribute(mesh: DeviceMesh, pairs: Sequence[tuple[tuple, tuple]], seed: int = 0) -> list[str]:
    """``redistribute``, ``to_local``, ``full_tensor``, ``shape`` and ``placements`` for each pair."""
    p = get_platform()
    full = global_array(seed)
    coord = mesh.get_coordinate()
    failures = []
    for src, dst in pairs:
        dt = DTensor.from_local(p.from_numpy(make_local(full, mesh, src)), mesh, list(src))
        out = dt.redistribute(mesh, list(dst))
        want = ref_piece(full, mesh.shape, coord, shard_lists(dst, full.ndim))
        got = p.to_numpy(out.to_local())
        if not _close(got, want):
            failures.append(f"{src} -> {dst}: local piece {got.shape} differs from the reference {want.shape}")
        if out.placements != tuple(dst) or out.shape != full.shape:
            failures.append(f"{src} -> {dst}: got placements {out.placements}, shape {out.shape}")
        if not _close(p.to_numpy(dt.full_tensor()), full):
            failures.append(f"{src}: full_tensor differs from the reference")
    return failures


def check_layouts(mesh: DeviceMesh, seed: int = 1) -> list[str]:
    """Layout-built DTensors, including a tensor dim split in non-mesh order (no placements exist)."""
    p = get_platform()
    full = global_array(seed, (8, 4))
    coord = mesh.get_coordinate()
    base = Layout.from_device_mesh(mesh)
    a, b = mesh.mesh_dim_names
    layouts = [base(a, "None"), base((b, a), "None"), base((a, b), "None"), base("None", (b, a)), base(b, a),
               base("None", "None")]
    failures = []
    for src in layouts:
        src_shards = [list(x) for x in src.shard_dims]
        local = p.from_numpy(ref_piece(full, mesh.shape, coord, src_shards))
        dt = DTensor.from_local(local, src)
        for dst in layouts:
            got = p.to_numpy(dt.redistribute(dst).to_local())
            want = ref_piece(full, mesh.shape, coord, [list(x) for x in dst.shard_dims])
            if not _close(got, want):
                failures.append(f"{src.alias_tensor_map} -> {dst.alias_tensor_map}: wrong local piece")
    return failures


def check_errors(mesh: DeviceMesh) -> list[str]:
    """Bad inputs raise the documented errors before any communication."""
    p = get_platform()
    ok: list[str] = []
    local = p.zeros((2, 4))
    dt = DTensor.from_local(local, mesh, [Shard(0), Replicate()])
    cases = [
        (lambda: DTensor.from_local(p.zeros((3, 4)), mesh, [Replicate(), Replicate()]).redistribute(
            mesh, [Shard(0), Replicate()]), ValueError, "tensor dim 0 of size 3 cannot be split evenly"),
        (lambda: dt.redistribute(mesh, [Partial(), Replicate()]), ValueError, "cannot redistribute to Partial"),
        (lambda: dt.redistribute(mesh, [Shard(0)]), ValueError, "1 placements"),
        (lambda: dt.redistribute(mesh, [Shard(2), Replicate()]), ValueError, r"Shard\(dim=2\) is out of range"),
        (lambda: DTensor.from_local(local, mesh, [Shard(0), Shard(0)], ).to_local(grad_placements=[Replicate(),
                                                                                                    Shard(0)]),
         ValueError, "gradient pieces of shape"),
        (lambda: DTensor.from_local([1.0], mesh), TypeError, "from_local needs"),
        (lambda: dt.redistribute(mesh["dp"] if "dp" in mesh.mesh_dim_names else mesh, [Replicate()]),
         ValueError, "cannot change the mesh"),
    ]
    import re

    for call, kind, pattern in cases:
        try:
            call()
        except kind as exc:
            if not re.search(pattern, str(exc)):
                ok.append(f"{kind.__name__} message {str(exc)!r} does not match {pattern!r}")
            continue
        except Exception as exc:  # noqa: BLE001 - reported as a failure
            ok.append(f"expected {kind.__name__} ({pattern}), got {type(exc).__name__}: {exc}")
            continue
        ok.append(f"expected {kind.__name__} ({pattern}), nothing raised")
    return ok


def check_distribute(mesh: DeviceMesh) -> list[str]:
    """distribute_tensor cuts the same full tensor locally; Partial and uneven targets are refused."""
    from hyper_parallel.core.dtensor import distribute_tensor

    p = get_platform()
    full = global_array(5)
    coord = mesh.get_coordinate()
    failures = []
    for placements in itertools.product(placement_set(()), repeat=mesh.ndim):
        dt = distribute_tensor(p.from_numpy(full), mesh, list(placements))
        want = ref_piece(full, mesh.shape, coord, shard_lists(placements, full.ndim))
        if not _close(p.to_numpy(dt.to_local()), want) or dt.placements != tuple(placements):
            failures.append(f"distribute_tensor {placements}: wrong piece")
    layout = Layout.from_device_mesh(mesh)(mesh.mesh_dim_names, "None")
    dt = distribute_tensor(p.from_numpy(full), layout)
    if not _close(p.to_numpy(dt.to_local()), ref_piece(full, mesh.shape, coord, [list(range(mesh.ndim)), []])):
        failures.append("distribute_tensor with a layout: wrong piece")
    if not repr(dt).startswith(f"DTensor(shape=(4, 8), dtype=float32, placements={dt.placements}, mesh=DeviceMesh("):
        failures.append(f"unexpected repr {dt!r}")
    for bad, kind in (([Partial()] * mesh.ndim, "cannot create Partial"), ([Shard(0)] * mesh.ndim, None)):
        try:
            distribute_tensor(p.from_numpy(global_array(5, (3, 8))), mesh, bad)
        except ValueError as exc:
            if kind is None and "tensor dim 0 of size 3 cannot be split evenly" not in str(exc):
                failures.append(f"uneven distribute_tensor: unexpected message {exc}")
            if kind is not None and kind not in str(exc):
                failures.append(f"Partial distribute_tensor: unexpected message {exc}")
            continue
        failures.append(f"distribute_tensor {bad} of a 3x8 tensor did not raise")
    return failures


def mesh_2x2() -> DeviceMesh:
    return init_device_mesh(get_platform().device_type, (2, 2), mesh_dim_names=("dp", "tp"))


def mesh_1d(n: int) -> DeviceMesh:
    return init_device_mesh(get_platform().device_type, (n,), mesh_dim_names=("x",))


def mesh_reversed() -> DeviceMesh:
    """A 2x2 mesh whose lines list ranks in decreasing order: group order differs from mesh order."""
    return DeviceMesh(get_platform().device_type, [[3, 2], [1, 0]], mesh_dim_names=("dp", "tp"))


# ------------------------------------------------------------------ pending reductions of several kinds
_NP_REDUCE = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}
ALL_OPS = ("sum", "avg", "max", "min")


def commute(ops: Sequence[str]) -> bool:
    """Whether reductions of these kinds give the same result in any order (written from their definition)."""
    kinds = set(ops)
    return len(kinds) <= 1 or kinds <= {"sum", "avg"}


def _rank_values(mesh: DeviceMesh, seed: int) -> np.ndarray:
    """Values of shape mesh.shape + GLOBAL_SHAPE: every rank's local piece, none derived from another
    (so reductions of different kinds over the two mesh dims give different results in either order)."""
    return np.random.default_rng(seed).standard_normal((*mesh.shape, *GLOBAL_SHAPE)).astype(np.float32)


def check_mixed_partials(mesh: DeviceMesh, seed: int = 5) -> list[str]:
    """Every source with a pending reduction (any kinds, 2-D mesh) to every target without one: moves
    that finish reductions which do not commute raise ValueError (before any communication, on every
    rank); the others give the reference. Then the same reductions finished one mesh dim at a time,
    in each order, with rank values that make the order matter: the result is that order's."""
    p = get_platform()
    failures: list[str] = []
    plain = [Shard(0), Shard(1), Replicate()]
    srcs = [s for s in itertools.product([*plain, *(Partial(op) for op in ALL_OPS)], repeat=2)
            if any(isinstance(x, Partial) for x in s)]
    full = global_array(seed)
    coord = mesh.get_coordinate()
    for src in srcs:
        ops = [x.reduce_op for x in src if isinstance(x, Partial)]
        for dst in itertools.product(plain, repeat=2):
            dt = DTensor.from_local(p.from_numpy(make_local(full, mesh, src)), mesh, list(src))
            try:
                got = p.to_numpy(dt.redistribute(mesh, list(dst)).to_local())
            except ValueError as exc:
                if commute(ops) or "do not commute" not in str(exc):
                    failures.append(f"{src} -> {dst}: {exc}")
                continue
            if not commute(ops):
                failures.append(f"{src} -> {dst}: finished reductions that do not commute without an error")
            elif not _close(got, ref_piece(full, mesh.shape, coord, shard_lists(dst, full.ndim))):
                failures.append(f"{src} -> {dst}: local piece differs from the reference")
    values = _rank_values(mesh, seed)
    mine = values[tuple(coord)]
    for a, b in itertools.product(ALL_OPS, repeat=2):
        if commute([a, b]):
            continue
        src = (Partial(a), Partial(b))
        for first in (0, 1):  # the mesh dim finished first
            other = 1 - first
            ref = _NP_REDUCE[src[other].reduce_op](_NP_REDUCE[src[first].reduce_op](values, axis=first), axis=0)
            for middle_kind in (Replicate(), Shard(0)):
                middle = [None, None]
                middle[first], middle[other] = middle_kind, src[other]
                for dst in ((Replicate(), Replicate()), (Shard(0), Shard(1)), (Shard(1), Replicate())):
                    dt = DTensor.from_local(p.from_numpy(mine.copy()), mesh, list(src))
                    try:
                        out = dt.redistribute(mesh, middle).redistribute(mesh, list(dst))
                        got = p.to_numpy(out.to_local())
                    except Exception as exc:  # noqa: BLE001 - reported as a failure
                        failures.append(f"{src} -> {middle} -> {dst}: {type(exc).__name__}: {exc}")
                        continue
                    want = ref_piece(ref.astype(np.float32), mesh.shape, coord, shard_lists(dst, full.ndim))
                    if not _close(got, want):
                        failures.append(f"{src} -> {middle} -> {dst}: differs from mesh dim {first} reduced first")
    return failures
