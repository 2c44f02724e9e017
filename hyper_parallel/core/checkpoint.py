"""Saving and resuming the state of a pipelined, (fully) sharded model and its optimizers.

``save_checkpoint(path, schedule, optimizer, extra=...)`` and ``load_checkpoint(path, schedule,
optimizer)`` are collectives: every rank of the job calls them. What is written:

* every parameter of the rank's stages, under a key that is the parameter's name in its stage module
  (``layers.3.weight``). A name two stages of the pipeline use for different parameters gets the
  stage as a prefix (``stage1.lin.weight``); the holders of one tied weight may share a name;
* each optimizer's state, per parameter (keyed like the parameter), with its group's options;
* ``extra``: any picklable object (the step number, the data loader's position...).

The format is the framework's: ``torch.distributed.checkpoint`` in a torch.distributed job (each rank
writes its pieces; loading reshards, so a checkpoint written with one pipeline x data-parallel split
loads into another, provided the parameter names are the same: build stage modules that keep the
whole model's names), one file per rank on MindSpore and on a LocalCluster (loads on the same split).
Restoring parameters and optimizer state exactly makes a resumed run continue bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import Group


def _stages_of(model: Any) -> tuple[list[Any], Group | None, dict[str, Any]] | None:
    from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule
    from hyper_parallel.core.pipeline_parallel.stage import PipelineStage

    if isinstance(model, PipelineSchedule):
        return list(model.stages), model.group, dict(model._holders or {})
    if isinstance(model, PipelineStage):
        return [model], model.group, {}
    if isinstance(model, (list, tuple)) and model and all(isinstance(s, PipelineStage) for s in model):
        return list(model), model[0].group, {}
    return None


def checkpoint_keys(model: Any) -> dict[str, Any]:
    """Key -> parameter for this rank (a collective over the pipeline group when ``model`` is a schedule
    or stages; see the module docstring for the keys)."""
    p = get_platform()
    found = _stages_of(model)
    if found is None:
        return dict(p.named_parameters(model))
    stages, group, _ = found
    entries: list[tuple[int, str, str | None, Any]] = []  # (stage, name, tie, parameter)
    seen: set[int] = set()
    for stage in stages:
        ties = {id(param): tie for tie, param in stage.shared_parameters.items()}
        for name, param in p.named_parameters(stage.submodule):
            if id(param) not in seen:
                seen.add(id(param))
                entries.append((stage.stage_index, name, ties.get(id(param)), param))
    mine = [(s, name, tie) for s, name, tie, _ in entries]
    everyone = [e for rank_entries in p.all_gather_object(mine, group) for e in rank_entries] if group else mine
    users: dict[str, set[tuple[int, str | None]]] = {}
    for s, name, tie in everyone:
        users.setdefault(name, set()).add((s, tie))
    clashing = set()
    for name, who in users.items():
        ties = {tie for _, tie in who}
        if len(who) > 1 and (len(ties) > 1 or None in ties):
            clashing.add(name)
    out: dict[str, Any] = {}
    for s, name, _, param in entries:
        out[f"stage{s}.{name}" if name in clashing else name] = param
    return out


def _optimizers(optimizers: Any) -> list[Any]:
    if optimizers is None:
        return []
    if isinstance(optimizers, Sequence):
        return list(optimizers)
    return [optimizers]


def save_checkpoint(path: str, model: Any, optimizers: Any = None, extra: Any = None) -> None:
    """Write the parameters of ``model`` (a pipeline schedule, its stages, or a module), the state of
    ``optimizers`` (one or a list) and ``extra`` under the folder ``path``; every rank calls it."""
    get_platform().save_checkpoint(str(path), checkpoint_keys(model), _optimizers(optimizers), extra)


def load_checkpoint(path: str, model: Any, optimizers: Any = None) -> Any:
    """Load what :func:`save_checkpoint` wrote into ``model`` and ``optimizers`` in place; returns
    ``extra``. Build the model (fully sharded as wanted) and the optimizers first; every rank calls it."""
    return get_platform().load_checkpoint(str(path), checkpoint_keys(model), _optimizers(optimizers))
