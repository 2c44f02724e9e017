"""The keys a checkpoint stores a rank's tensors under (see the package docstring)."""

from __future__ import annotations

from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import Group


def _stages_of(model: Any) -> tuple[list[Any], Group | None] | None:
    from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule
    from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage

    if isinstance(model, PipelineSchedule):
        return list(model.stages), model.group
    if isinstance(model, PipelineStage):
        return [model], model.group
    if isinstance(model, (list, tuple)) and model and all(isinstance(s, PipelineStage) for s in model):
        return list(model), model[0].group
    return None


def state_keys(model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Key -> parameter (trainable or frozen) and key -> persistent buffer for this rank (a collective
    over the pipeline group when ``model`` is a schedule or stages)."""
    p = get_platform()
    found = _stages_of(model)
    if found is None:
        params, buffers = p.checkpointed_tensors(model)
        return dict(params), dict(buffers)
    stages, group = found
    entries: list[tuple[int, str, str | None, Any, bool]] = []  # (stage, name, tie, tensor, is buffer)
    seen: set[int] = set()
    for stage in stages:
        ties = {id(param): tie for tie, param in stage.shared_parameters.items()}
        params, buffers = p.checkpointed_tensors(stage.submodule)
        for kind, named in ((False, params), (True, buffers)):
            for name, tensor in named:
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    entries.append((stage.stage_index, name, ties.get(id(tensor)), tensor, kind))
    mine = [(s, name, tie) for s, name, tie, _, _ in entries]
    everyone = [e for rank_entries in p.all_gather_object(mine, group) for e in rank_entries] if group else mine
    users: dict[str, set[tuple[int, str | None]]] = {}
    for s, name, tie in everyone:
        users.setdefault(name, set()).add((s, tie))
    clashing = set()
    for name, who in users.items():
        ties = {tie for _, tie in who}
        if len(who) > 1 and (len(ties) > 1 or None in ties):
            clashing.add(name)
    out: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    for s, name, _, tensor, is_buffer in entries:
        out[is_buffer][f"stage{s}.{name}" if name in clashing else name] = tensor
    return out


def checkpoint_keys(model: Any) -> dict[str, Any]:
    """Key -> parameter (trainable or frozen) for this rank; :func:`state_keys` adds the buffers."""
    return state_keys(model)[0]
