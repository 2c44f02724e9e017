"""Training-loop helpers that span every rank of a pipeline x data-parallel job.

``clip_grad_norm_`` computes the norm of the gradient of the *whole* model — every pipeline stage,
every FSDP shard — counting each gradient once: a parameter replicated over the data-parallel ranks
counts once (not once per replica), a fully sharded one counts each shard once, and a weight tied
across stages (``shared_parameters``) counts once although each holder has the summed gradient. The
result equals ``torch.nn.utils.clip_grad_norm_`` on the non-pipelined model, and is the same number on
every rank, so a non-finite norm is seen everywhere and every rank skips the same step.
"""

from __future__ import annotations

import math
from typing import Any

from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.fully_shard.sharded import state_of
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import Group


def _parameters(parameters: Any) -> tuple[list[Any], dict[int, int], Group | None]:
    """(parameters, {id: holders of its tie}, pipeline group) of a schedule or an iterable of parameters."""
    from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule

    if isinstance(parameters, PipelineSchedule):
        ties: dict[int, int] = {}
        for name, holders in (parameters._holders or {}).items():
            for stage in parameters.stages:
                param = stage.shared_parameters.get(name)
                if param is not None:
                    ties[id(param)] = len(holders)
        return parameters._params(), ties, parameters.group
    if get_platform().is_tensor(parameters):
        return [parameters], {}, None
    return list(parameters), {}, None


def _group_and_replicas(mesh: DeviceMesh | None, pipeline: Group | None) -> tuple[Group, int]:
    """The group over which the norm is summed, and how many of its ranks hold each pipeline stage."""
    p = get_platform()
    if mesh is None:
        return (pipeline or p.world_group), 1
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a hyper_parallel DeviceMesh, got {type(mesh).__name__}")
    pp = mesh.size("pp") if "pp" in mesh.mesh_dim_names else 1
    if mesh.size() == p.world_size:
        group = p.world_group
    else:
        group = (mesh if mesh.ndim == 1 else mesh.flatten()).get_group()
    return group, mesh.size() // pp


def _shards(param: Any) -> int:
    state = state_of(param)
    if state is not None and any(e.param is param for e in state.sharded):
        return state.size
    return get_platform().native_shard_count(param)


def _global_norm(params: list[Any], ties: dict[int, int], group: Group, replicas: int, norm_type: float) -> float:
    p = get_platform()
    local = 0.0
    for param in params:
        grad = p.get_grad(param)
        if grad is None:
            continue
        value = p.norm_pow_sum([grad], norm_type)
        if math.isinf(norm_type):
            local = value if value != value else max(local, value)
            continue
        copies = replicas / _shards(param) * ties.get(id(param), 1)
        local += value / copies
    op = "max" if math.isinf(norm_type) else "sum"
    total = float(p.to_numpy(p.all_reduce(p.tensor([local], "float64"), op, group))[0])
    if math.isinf(norm_type) or not math.isfinite(total):
        return total
    return total ** (1.0 / norm_type)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, *, mesh: DeviceMesh | None = None,
                    error_if_nonfinite: bool = False) -> float:
    """Scale every gradient in place so that the global gradient norm is at most ``max_norm``; returns
    that norm (before clipping) as a float, the same on every rank. A collective over ``mesh``.

    ``parameters`` is a pipeline schedule (its parameters; tied weights are counted once) or an
    iterable of parameters. ``mesh`` is the job's mesh: a ``"pp"`` dimension holds different stages,
    every other dimension replicas (or, for fully sharded parameters, shards) of the same ones;
    without it the sum runs over the schedule's pipeline group. A non-finite norm leaves the gradients
    untouched (skip the step), or raises ``RuntimeError`` on every rank with ``error_if_nonfinite``.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive, got {norm_type}")
    params, ties, pipeline = _parameters(parameters)
    group, replicas = _group_and_replicas(mesh, pipeline)
    total = _global_norm(params, ties, group, replicas, norm_type)
    if not math.isfinite(total):
        if error_if_nonfinite:
            raise RuntimeError(f"the total norm of order {norm_type:g} of the gradients is {total}: some gradient is "
                               "not finite (every rank raises)")
        return total
    coefficient = float(max_norm) / (total + 1e-6)
    if coefficient < 1.0:
        get_platform().scale_grads([q for q in params if get_platform().get_grad(q) is not None], coefficient)
    return total


def grads_are_finite(parameters: Any, *, mesh: DeviceMesh | None = None) -> bool:
    """Whether every gradient on every rank of ``mesh`` is finite; the same answer on every rank (a collective)."""
    p = get_platform()
    params, _, pipeline = _parameters(parameters)
    group, _ = _group_and_replicas(mesh, pipeline)
    grads = [g for g in (p.get_grad(q) for q in params) if g is not None]
    largest = p.norm_pow_sum(grads, math.inf) if grads else 0.0
    bad = 0.0 if math.isfinite(largest) else 1.0
    return float(p.to_numpy(p.all_reduce(p.tensor([bad], "float64"), "max", group))[0]) == 0.0

