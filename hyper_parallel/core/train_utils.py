"""Training-loop helpers that span every rank of a pipeline x data-parallel job.

``clip_grad_norm_`` computes the norm of the gradient of the *whole* model — every pipeline stage,
every FSDP shard — counting each gradient once: a parameter replicated over the data-parallel ranks
counts once (not once per replica), a fully sharded one counts each shard once, and a weight tied
across stages (``shared_parameters``) counts once although each holder has the summed gradient. The
result equals ``torch.nn.utils.clip_grad_norm_`` on the non-pipelined model, and is the same number on
every rank, so a non-finite norm is seen everywhere and every rank skips the same step.

The ranks the norm is summed over: ``mesh=`` when given; else, for a schedule that
``data_parallel`` made a replica, the mesh given to ``data_parallel`` (either mesh, without a ``pp``
dimension and with a schedule: the pipeline group, then that mesh); else the schedule's pipeline
group (an iterable of parameters: the world), where every rank holds different parameters — a
sharded parameter there raises on every rank rather than count a shard as the whole, as does one
averaged over data-parallel replicas (an iterable of a replica's parameters) rather than count it
once per replica.

One all-reduce carries three numbers per rank: the rank's sum of ``|g| ** p`` (or its largest
``|g|``), a flag for a ``nan`` it saw, and a flag for a parameter whose shards the ranks summed over
cannot hold. ``nan`` travels in its flag because not every engine's ``max`` keeps it (gloo's drops it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.fully_shard import grad_sync
from hyper_parallel.core.fully_shard.data_parallel import data_parallel_state
from hyper_parallel.core.fully_shard.sharded import state_of
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import Group


@dataclass
class _Span:
    """Where a norm is reduced: over ``groups`` one after the other (together: every rank of the job),
    each pipeline stage held by ``replicas`` of those ranks; ``source`` says where that came from."""

    groups: list[Group]
    replicas: int
    source: str
    assumed: bool = False  # replicas is not known but assumed (1: every rank holds different parameters)


def _parameters(parameters: Any) -> tuple[list[Any], dict[int, int], Any]:
    """(parameters, {id: holders of its tie}, the schedule or None) of a schedule or an iterable of parameters."""
    from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule

    if isinstance(parameters, PipelineSchedule):
        ties: dict[int, int] = {}
        for name, holders in (parameters._holders or {}).items():
            for stage in parameters.stages:
                param = stage.shared_parameters.get(name)
                if param is not None:
                    ties[id(param)] = len(holders)
        return parameters._params(), ties, parameters
    if get_platform().is_tensor(parameters):
        return [parameters], {}, None
    return list(parameters), {}, None


def _mesh_span(mesh: DeviceMesh) -> tuple[Group, int]:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a hyper_parallel DeviceMesh, got {type(mesh).__name__}")
    p = get_platform()
    pp = mesh.size("pp") if "pp" in mesh.mesh_dim_names else 1
    if mesh.size() == p.world_size:
        group = p.world_group
    else:
        group = (mesh if mesh.ndim == 1 else mesh.flatten()).get_group()
    return group, mesh.size() // pp


def _span(mesh: DeviceMesh | None, schedule: Any) -> _Span:
    p = get_platform()
    pipeline = schedule.group if schedule is not None else None
    source = "the mesh given"
    state = data_parallel_state(schedule) if schedule is not None and mesh is None else None
    if state is not None:
        mesh, source = state.mesh, "the mesh given to data_parallel"
    if mesh is None:
        return _Span([pipeline or p.world_group], 1, "the pipeline group" if pipeline is not None else "the world",
                     assumed=True)
    group, replicas = _mesh_span(mesh)
    if "pp" in mesh.mesh_dim_names or pipeline is None or pipeline.size == 1:
        return _Span([group], replicas, source)
    # a mesh of the replicas only: sum over the pipeline, then over the replicas
    stages = sorted(set(mesh.ranks) & set(pipeline.ranks))
    if stages != [p.rank]:
        raise ValueError(f"rank {p.rank}: {source} has no 'pp' dimension but holds ranks {stages} of the pipeline "
                         f"{list(pipeline.ranks)}: pass the job's mesh with its 'pp' dimension")
    return _Span([pipeline, group], mesh.size(), f"the pipeline group and {source}")


def _shards(param: Any) -> int:
    state = state_of(param)
    if state is not None and any(e.param is param for e in state.sharded):
        return state.size
    return get_platform().native_shard_count(param)


def _replicas_of(param: Any) -> int:
    """How many data-parallel replicas average ``param``'s gradient (this library's DP and FSDP), else 1."""
    state = state_of(param)
    return state.size if state is not None else getattr(param, grad_sync.ATTR, 1)


def _reduce(values: list[float], op: str, span: _Span) -> list[float]:
    p = get_platform()
    buffer = p.tensor(values, "float64")
    for group in span.groups:
        buffer = p.all_reduce(buffer, op, group)
    return [float(v) for v in p.to_numpy(buffer)]


def _global_norm(params: list[Any], names: dict[int, str], ties: dict[int, int], span: _Span,
                 norm_type: float) -> float:
    p = get_platform()
    infinite = math.isinf(norm_type)
    local, saw_nan, misfit = 0.0, 0.0, None
    for param in params:
        grad = p.get_grad(param)
        if grad is None:
            continue
        shards = _shards(param)
        replicated = _replicas_of(param) if span.assumed and shards == 1 else 1
        if (span.replicas % shards or replicated > 1) and misfit is None:
            what = f"is cut into {shards} shards" if shards > 1 else f"is averaged over {replicated} data-parallel replicas"
            misfit = (f"rank {p.rank}: parameter {names.get(id(param), '?')!r} {what}, but "
                      f"clip_grad_norm_ sums over {span.source}, where each stage has {span.replicas} holder(s); "
                      "pass mesh= (the job's mesh, with its 'pp' and data-parallel dimensions)")
        value = p.norm_pow_sum([grad], norm_type)
        if value != value:  # nan: carried by its flag
            saw_nan = 1.0
        elif infinite:
            local = max(local, value)
        else:
            local += value / (span.replicas / shards * ties.get(id(param), 1))
    total, nans, misfits = _reduce([local, saw_nan, 0.0 if misfit is None else 1.0],
                                   "max" if infinite else "sum", span)
    if misfits:
        raise ValueError(misfit or f"rank {p.rank}: another rank holds a parameter cut into more shards than "
                                   f"{span.source} holds copies of its stage (its error names it); pass mesh=")
    if nans:
        return math.nan
    if infinite or not math.isfinite(total):
        return total
    return total ** (1.0 / norm_type)


def _names(parameters: Any) -> dict[int, str]:
    from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule

    if isinstance(parameters, PipelineSchedule):
        return {id(q): n for n, q in parameters.named_parameters().items()}
    return {}


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, *, mesh: DeviceMesh | None = None,
                    error_if_nonfinite: bool = False) -> float:
    """Scale every gradient in place so that the global gradient norm is at most ``max_norm``; returns
    that norm (before clipping) as a float, the same on every rank (``nan`` on every rank where any
    rank's gradient holds a ``nan``). A collective over the job.

    ``parameters`` is a pipeline schedule (its parameters; tied weights are counted once) or an
    iterable of parameters. ``mesh`` is the job's mesh: a ``"pp"`` dimension holds different stages,
    every other dimension replicas (or, for fully sharded parameters, shards) of the same ones.
    Without it, a schedule made a replica by ``data_parallel`` uses the mesh given there; any other
    schedule sums over its pipeline group (an iterable: the world), and a sharded parameter, or one
    averaged over data-parallel replicas, then raises ``ValueError`` on every rank. A non-finite norm leaves the gradients untouched (skip the
    step), or raises ``RuntimeError`` on every rank with ``error_if_nonfinite``.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive, got {norm_type}")
    params, ties, schedule = _parameters(parameters)
    span = _span(mesh, schedule)
    total = _global_norm(params, _names(parameters), ties, span, norm_type)
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
    """Whether every gradient on every rank of the job is finite; the same answer on every rank (a
    collective over the same ranks as :func:`clip_grad_norm_`)."""
    p = get_platform()
    params, _, schedule = _parameters(parameters)
    span = _span(mesh, schedule)
    grads = [g for g in (p.get_grad(q) for q in params) if g is not None]
    largest = p.norm_pow_sum(grads, math.inf) if grads else 0.0
    return _reduce([0.0 if math.isfinite(largest) else 1.0], "max", span)[0] == 0.0
