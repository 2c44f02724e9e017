"""Tied parameters across stages: values synced once, gradients summed after every run.

Every rank of the pipeline knows which stage holds which tie name (exchanged when the
schedule is built). The stage with the lowest index owns a tie: it sends its value to the
other holders, and after a run it gathers their gradients, sums them in stage order and
sends the sum back (once per rank), so every copy has the same value and the same gradient.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform.base import Platform

Holders = dict[str, list[tuple[int, int]]]  # tie name -> [(stage index, global rank)], sorted by stage


def collect_holders(
    stage_ties: list[list[tuple[int, list[str]]]],
    ranks: tuple[int, ...],
    declared: list[list[tuple[int, list[str]]]] | None = None,
) -> Holders:
    """Build the tie table from every pipeline rank's ``[(stage index, [tie names])]``.

    ``stage_ties`` lists each parameter object once per rank; ``declared`` (default: the same)
    lists every declaration, so a tie declared by one stage only can be refused. Ties whose
    holders are all one object need no syncing and are left out.
    """
    counts: dict[str, list[int]] = {}
    for stages in declared if declared is not None else stage_ties:
        for stage_index, names in stages:
            for name in names:
                counts.setdefault(name, []).append(stage_index)
    for name, stage_indices in counts.items():
        if len(stage_indices) < 2:
            raise ValueError(f"shared parameter {name!r} is held only by stage {stage_indices[0]}; a tie needs two stages")
    holders: Holders = {}
    for rank, stages in zip(ranks, stage_ties, strict=True):
        for stage_index, names in stages:
            for name in names:
                holders.setdefault(name, []).append((stage_index, rank))
    return {name: sorted(owners) for name, owners in holders.items() if len(owners) > 1}


def _local(stages: dict[int, PipelineStage], name: str, stage_index: int) -> Any:
    return stages[stage_index].shared_parameters[name]


def sync_values(p: Platform, stages: dict[int, PipelineStage], holders: Holders) -> None:
    """Copy the owner's value of every tie to the other holders."""
    me = p.rank
    for name in sorted(holders):
        (owner_stage, owner_rank), *others = holders[name]
        if owner_rank == me:
            value = p.param_data(_local(stages, name, owner_stage))
            for stage_index, rank in others:
                if rank == me:
                    p.assign_param(_local(stages, name, stage_index), value)
                else:
                    p.isend(p.clone(value), rank).wait()
        else:
            for stage_index, rank in others:
                if rank == me:
                    param = _local(stages, name, stage_index)
                    buf = p.empty_like(p.param_data(param))
                    p.irecv(buf, owner_rank).wait()
                    p.assign_param(param, buf)


def non_owner_params(p: Platform, stages: dict[int, PipelineStage], holders: Holders) -> list[Any]:
    """The tied parameters of this rank that are not their tie's owner: their gradient is rebuilt
    from the sum after every run, so a run starts them from no gradient."""
    me = p.rank
    out = []
    for name, owners in holders.items():
        owner = owners[0]
        for stage_index, rank in owners:
            if rank == me and (stage_index, rank) != owner:
                param = _local(stages, name, stage_index)
                if not (owner[1] == me and param is _local(stages, name, owner[0])):
                    out.append(param)
    return out


def _grad_or_zeros(p: Platform, param: Any) -> Any:
    grad = p.get_grad(param)
    return grad if grad is not None else p.zeros_like(p.param_data(param))


def sum_gradients(p: Platform, stages: dict[int, PipelineStage], holders: Holders) -> None:
    """Give every holder of a tie the sum (in stage order) of all holders' gradients."""
    me = p.rank
    for name in sorted(holders):
        owners = holders[name]
        owner_rank = owners[0][1]
        if owner_rank == me:
            parts = []
            for stage_index, rank in owners:
                if rank == me:
                    parts.append(_grad_or_zeros(p, _local(stages, name, stage_index)))
                else:
                    buf = p.empty_like(parts[0])
                    p.irecv(buf, rank).wait()
                    parts.append(buf)
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            sent: set[int] = set()
            for stage_index, rank in owners:
                if rank == me:
                    p.set_grad(_local(stages, name, stage_index), p.clone(total))
                elif rank not in sent:  # once per rank: that rank gives it to all its holders
                    sent.add(rank)
                    p.isend(total, rank).wait()
        else:
            mine = [s for s, r in owners if r == me]
            if not mine:
                continue
            # Several holders on one non-owner rank send one message each so the owner sums in stage order.
            for stage_index in mine:
                p.isend(_grad_or_zeros(p, _local(stages, name, stage_index)), owner_rank).wait()
            # The owner sends the sum once to this rank, whatever the number of holders here.
            total = p.empty_like(p.param_data(_local(stages, name, mine[0])))
            p.irecv(total, owner_rank).wait()
            for stage_index in mine:
                p.set_grad(_local(stages, name, stage_index), p.clone(total))
