"""``fully_shard``: shard a module's parameters over the data-parallel ranks (FSDP), on both frameworks.

In a torch.distributed job this is torch's own FSDP2 (``torch.distributed.fsdp.fully_shard``, over the
mesh's torch groups). Elsewhere (MindSpore, and torch on a LocalCluster, where torch's FSDP has no
process groups) the parameters are sharded by :class:`~.sharded.ShardedModule` over the platform
collectives. Inside a pipeline, :func:`~.data_parallel.data_parallel` makes the schedule gather,
free and reduce them.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.fully_shard.sharded import ShardedModule, state_of
from hyper_parallel.platform import get_platform


def _shard_mesh(mesh: DeviceMesh | None, dim: str) -> DeviceMesh:
    p = get_platform()
    if mesh is None:
        return DeviceMesh(p.device_type, range(p.world_size), (p.world_size,), (dim,))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a hyper_parallel DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh
    if dim not in mesh.mesh_dim_names:
        raise ValueError(f"fully_shard shards over one mesh dimension: {dim!r} is not one of {list(mesh.mesh_dim_names)}")
    return mesh[dim]


def fully_shard(module: Any, mesh: DeviceMesh | None = None, *, dim: str = "dp",
                reshard_after_forward: bool = True) -> Any:
    """Shard ``module``'s parameters on dimension 0 over ``mesh`` (a 1-D mesh, or the ``dim`` dimension of
    a larger one; default: every rank) and return the module.

    Parameters are gathered before use and freed after it, and gradients are reduce-scattered and
    averaged over the mesh dimension, as torch's FSDP does. ``reshard_after_forward`` (outside a
    pipeline, torch's FSDP2 only) frees the gathered parameters between forward and backward.
    Shard the sub-modules first (e.g. each layer), then the whole module, as with torch's FSDP.
    """
    p = get_platform()
    shard_mesh = _shard_mesh(mesh, dim)
    native = p.native_fsdp()
    if native is not None:
        return native.fully_shard(module, shard_mesh.to_torch(), reshard_after_forward)
    ShardedModule(p, module, shard_mesh.get_group())
    return module


def sharded_states(module: Any) -> list[ShardedModule]:
    """The sharding states (of this library's implementation) that hold parameters of ``module``."""
    out: list[ShardedModule] = []
    for _, param in get_platform().named_parameters(module):
        state = state_of(param)
        if state is not None and all(state is not s for s in out):
            out.append(state)
    return out


def is_fully_sharded(module: Any) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or to one of its sub-modules."""
    native = get_platform().native_fsdp()
    return bool(sharded_states(module)) or (native is not None and native.is_sharded(module))


def unshard(module: Any) -> None:
    """Gather the parameters of a fully sharded module now."""
    native = get_platform().native_fsdp()
    if native is not None and native.is_sharded(module):
        native.unshard(module)
    for state in sharded_states(module):
        state.unshard()


def reshard(module: Any) -> None:
    """Free the gathered parameters of a fully sharded module."""
    native = get_platform().native_fsdp()
    if native is not None and native.is_sharded(module):
        native.reshard(module)
    for state in sharded_states(module):
        state.reshard()


def reduce_gradients(module: Any) -> None:
    """Outside a pipeline, with this library's implementation: reduce-scatter the gradients of the
    backward(s) since the last call and free the gathered parameters (torch's FSDP2 does this by
    itself during the backward, so there this does nothing)."""
    for state in sharded_states(module):
        state.reduce_grads()
        state.reshard()
