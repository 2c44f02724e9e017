"""torch's own device mesh and DTensor behind the library's DeviceMesh / DTensor.

Placements cross the platform boundary as plain tuples (``platform/`` imports nothing from
``core/``): ``("shard", dim)``, ``("replicate",)``, ``("partial", reduce_op)``.

* groups: our :class:`Group` wraps a ``ProcessGroup`` in ``native``;
* meshes: ``torch.distributed.device_mesh.DeviceMesh.from_group`` over those groups, so a torch mesh
  and ours share every process group (nothing is created twice);
* redistribution: a torch ``DTensor`` is built around the local tensor and redistributed by torch
  (no autograd here: the library's DTensor wraps it in :func:`custom_function`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.platform.base import Group

PlacementDesc = tuple[Any, ...]


def group_from_native(native: Any) -> Group:
    if not isinstance(native, dist.ProcessGroup):
        raise TypeError(f"expected a torch.distributed ProcessGroup, got {type(native).__name__}")
    return Group(tuple(dist.get_process_group_ranks(native)), native=native)


def native_process_group(group: Group) -> Any:
    if not isinstance(group.native, dist.ProcessGroup):
        raise TypeError(
            f"group {list(group.ranks)} has no torch.distributed ProcessGroup (native={group.native!r}): "
            "only groups of a real torch.distributed job have one, not those of a LocalCluster"
        )
    return group.native


def native_device_mesh(device_type: str, nested: Any, groups: Sequence[Group], names: Sequence[str]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    pgs = [native_process_group(g) for g in groups]
    if len(pgs) == 1:
        return DeviceMesh.from_group(pgs[0], device_type, mesh=nested, mesh_dim_names=tuple(names))
    return DeviceMesh.from_group(pgs, device_type, mesh=nested, mesh_dim_names=tuple(names))


def mesh_from_native(native: Any) -> tuple[str, list[Any], tuple[str, ...], list[Group]]:
    """``(device_type, nested ranks, dim names, this rank's group per dim)`` of a torch DeviceMesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(native, DeviceMesh):
        raise TypeError(f"expected a torch.distributed.device_mesh.DeviceMesh, got {type(native).__name__}")
    names = native.mesh_dim_names or tuple(f"dim{i}" for i in range(native.ndim))
    groups = [group_from_native(native.get_group(i)) for i in range(native.ndim)]
    return native.device_type, native.mesh.tolist(), tuple(names), groups


def to_torch_placements(descs: Sequence[PlacementDesc]) -> tuple[Any, ...]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for desc in descs:
        if desc[0] == "shard":
            out.append(Shard(desc[1]))
        elif desc[0] == "replicate":
            out.append(Replicate())
        elif desc[0] == "partial":
            out.append(Partial(desc[1]))
        else:
            raise ValueError(f"unknown placement {desc!r}")
    return tuple(out)


def from_torch_placements(placements: Sequence[Any]) -> tuple[PlacementDesc, ...]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    out: list[PlacementDesc] = []
    for p in placements:
        if type(p) is Shard:
            out.append(("shard", p.dim))
        elif isinstance(p, Replicate):
            out.append(("replicate",))
        elif isinstance(p, Partial):
            out.append(("partial", p.reduce_op))
        else:
            raise ValueError(f"torch placement {p!r} has no equivalent here (only Shard, Replicate, Partial)")
    return tuple(out)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def native_dtensor(local: Any, mesh: Any, placements: Sequence[PlacementDesc], shape: Sequence[int]) -> Any:
    """A torch DTensor over ``local`` (differentiable, as torch's ``DTensor.from_local`` is)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, mesh, to_torch_placements(placements), run_check=False,
        shape=torch.Size(tuple(shape)), stride=_contiguous_stride(shape),
    )


def dtensor_from_native(native: Any) -> tuple[Any, Any, tuple[PlacementDesc, ...], tuple]:
    """``(local tensor, torch mesh, placements, global shape)`` of a torch DTensor (``to_local`` is differentiable)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(native, DTensor):
        raise TypeError(f"expected a torch.distributed.tensor.DTensor, got {type(native).__name__}")
    return native.to_local(), native.device_mesh, from_torch_placements(native.placements), tuple(native.shape)


def native_redistribute(
    local: Any, mesh: Any, src: Sequence[PlacementDesc], dst: Sequence[PlacementDesc], shape: Sequence[int]
) -> Any:
    """Redistribute a local tensor with torch's DTensor (no autograd is recorded)."""
    with torch.no_grad():
        dt = native_dtensor(local.detach(), mesh, src, shape)
        return dt.redistribute(mesh, to_torch_placements(dst)).to_local()


class _CustomGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: Callable[[Any], Any], backward: Callable[[Any], Any]) -> Any:
        ctx.backward_fn = backward
        out = forward(x)
        if out is x:
            return x.view_as(x)
        if out.numel() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            out = out.clone()  # a piece of the input: give autograd a tensor of its own
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        return ctx.backward_fn(grad.contiguous()), None, None


def custom_function(forward: Callable[[Any], Any], backward: Callable[[Any], Any], tensor: Any) -> Any:
    """``forward(tensor)`` recorded for autograd with ``backward`` as its gradient."""
    return _CustomGrad.apply(tensor, forward, backward)
