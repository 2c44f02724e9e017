"""Autograd of DTensor moves, against a dense numpy gradient (one rank's view).

Framework-neutral: the gradient is taken with the platform's stage autograd (the path a pipeline
stage uses), so the same checks run on torch and on MindSpore.

Two gradient conventions are checked:

* default — the gradient of a result is laid out like the result (Partial -> Replicate): every rank
  weights its piece of the result with its piece of one global weight ``W``; the global gradient is
  ``W`` and the source's gradient is its piece of ``W``;
* ``to_local(grad_placements=...)`` with Partial where the result is replicated — every rank weights
  its piece with ``(rank + 1) * W``; the global gradient is the sum of every rank's contribution put
  in its place (built densely below), and the source's gradient is its piece of that sum.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from dtensor_checks import global_array, make_local, ref_piece, shard_lists
from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor import DTensor
from hyper_parallel.core.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.platform import get_platform


def _summed_gradient(weight: np.ndarray, mesh: DeviceMesh, dst: Sequence[Placement]) -> np.ndarray:
    """Sum over ranks of (rank + 1) * that rank's piece of ``weight`` under ``dst``, placed in full."""
    total = np.zeros(weight.shape, np.float64)
    shards = shard_lists(dst, weight.ndim)
    for coord in itertools.product(*(range(n) for n in mesh.shape)):
        rank = mesh.mesh
        for c in coord:
            rank = rank[c]
        piece = ref_piece(weight, mesh.shape, coord, shards)
        index = []
        for d, dims in enumerate(shards):
            count, block = 1, 0
            for m in dims:
                block = block * mesh.shape[m] + coord[m]
                count *= mesh.shape[m]
            size = weight.shape[d] // count
            index.append(slice(block * size, (block + 1) * size))
        total[tuple(index)] += (rank + 1) * piece
    return total.astype(np.float32)


def _gradient(loss_fn, x: np.ndarray) -> np.ndarray | None:
    """d loss_fn(x) / dx on this rank, through the platform's stage autograd."""
    p = get_platform()
    record = p.stage_forward(loss_fn, (p.from_numpy(x),), {}, (), (True,))
    (grad,) = p.stage_backward(record, (p.ones_like(record.outputs[0]),))
    return None if grad is None else p.to_numpy(grad)


def _close(got: np.ndarray | None, want: np.ndarray) -> bool:
    return got is not None and got.shape == want.shape and np.allclose(got, want, rtol=1e-5, atol=1e-5)


def check_grads(mesh: DeviceMesh, pairs: Sequence[tuple[tuple, tuple]]) -> list[str]:
    p = get_platform()
    full, weight = global_array(0), global_array(7)
    coord = mesh.get_coordinate()
    me = mesh.get_rank()
    failures = []
    for src, dst in pairs:
        x = make_local(full, mesh, src)
        w_piece = p.from_numpy(ref_piece(weight, mesh.shape, coord, shard_lists(dst, full.ndim)))

        def default_loss(t, src=src, dst=dst, w=w_piece):
            return (DTensor.from_local(t, mesh, list(src)).redistribute(mesh, list(dst)).to_local() * w).sum()

        want = ref_piece(weight, mesh.shape, coord, shard_lists(src, full.ndim))
        if not _close(_gradient(default_loss, x), want):
            failures.append(f"{src} -> {dst}: default gradient differs from the reference")

        grad_placements = [Partial() if isinstance(q, Replicate) else q for q in dst]
        if grad_placements == list(dst):
            continue

        def partial_loss(t, src=src, dst=dst, w=w_piece, gp=grad_placements):
            y = DTensor.from_local(t, mesh, list(src)).redistribute(mesh, list(dst)).to_local(gp)
            return (y * w * float(me + 1)).sum()

        summed = _summed_gradient(weight, mesh, dst)
        want = ref_piece(summed, mesh.shape, coord, shard_lists(src, full.ndim))
        if not _close(_gradient(partial_loss, x), want):
            failures.append(f"{src} -> {dst} with grad_placements {grad_placements}: gradient differs")
    return failures


def check_full_tensor_grad(mesh: DeviceMesh) -> list[str]:
    """full_tensor()'s backward with Partial grads is a reduce-scatter: each rank gets the summed piece."""
    p = get_platform()
    full, weight = global_array(0), global_array(7)
    coord = mesh.get_coordinate()
    src: list[Placement] = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    w = p.from_numpy(weight)

    def loss(t):
        y = DTensor.from_local(t, mesh, src).full_tensor(grad_placements=[Partial()] * mesh.ndim)
        return (y * w * float(mesh.get_rank() + 1)).sum()

    world = len(mesh.ranks)
    want = ref_piece(weight * (world * (world + 1) / 2), mesh.shape, coord, shard_lists(src, full.ndim))
    if not _close(_gradient(loss, make_local(full, mesh, src)), want):
        return ["full_tensor(grad_placements=Partial) backward is not the summed piece"]
    return []
