"""Data parallelism and FSDP inside a pipeline: ``data_parallel(schedule, mesh)``.

Every pipeline rank has ``dp`` replicas (the ``dp`` dimension of the mesh), each running the same
schedule on its own part of the batch. ``data_parallel`` adds to the schedule, through its extension
points (``schedule.add_feature``):

* a lowering pass (``window.py``): ``FSDP_UNSHARD`` / ``FSDP_RESHARD`` around the computes of each
  fully sharded stage (a look-ahead window), ``FSDP_REDUCE_GRAD`` after the last backward of every
  stage;
* handlers: unshard / reshard through torch's FSDP2 or this library's implementation; the reduction
  reduce-scatters the sharded parameters' gradients and starts the all-reduce of the others (one
  bucket per stage); the last reduction of the run on a rank waits for those, so they overlap the
  rank's remaining backwards, and everything is in place before tied gradients are summed;
* a run hook: at the start of a run, gradient sync is switched off (backwards only accumulate) and
  the gradients held before the run are kept aside (a run adds its average to them); on failure, what
  was gathered or accumulated is dropped (the schedule restores the gradients).

Gradients: each micro-batch's loss gradient is ``1/micro_batch_num`` (the schedule's ``scale_grads``)
and the reduction averages over ``dp``, so a replica's gradients are those of the mean loss over
all micro-batches of all replicas, as with ``DistributedDataParallel``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.fully_shard import window
from hyper_parallel.core.fully_shard.api import sharded_states
from hyper_parallel.core.fully_shard.grad_sync import GradBucket
from hyper_parallel.core.fully_shard.sharded import ShardedModule, state_of
from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule, RunHook

_T = MetaStepType


@dataclass
class _StageSync:
    """How one local stage is kept in sync over ``dp``."""

    module: Any
    native: bool  # sharded by torch's FSDP2
    own: list[ShardedModule] = field(default_factory=list)  # sharded by this library
    bucket: GradBucket | None = None  # the parameters nobody shards

    @property
    def sharded(self) -> bool:
        return self.native or bool(self.own)


class DataParallel(RunHook):
    """The state ``data_parallel`` adds to one schedule (see the module docstring)."""

    def __init__(self, schedule: PipelineSchedule, dp_mesh: DeviceMesh, lookahead: int, gather: str = "stage",
                 mesh: DeviceMesh | None = None) -> None:
        p = schedule.platform
        self.schedule = schedule
        self.p = p
        self.mesh = mesh if mesh is not None else dp_mesh  # as given to data_parallel (clip_grad_norm_ uses it)
        self.dp_mesh = dp_mesh
        self.group = dp_mesh.get_group()
        self.lookahead = lookahead
        self.gather = gather
        self.fsdp = p.native_fsdp()
        self.local: dict[int, _StageSync] = {}
        for stage in schedule.stages:
            self.local[stage.stage_index] = self._classify(stage)
        mine = {
            "dp": self.group.size,
            "sharded": sorted(s for s, sync in self.local.items() if sync.sharded),
            "stages": sorted(self.local),
        }
        everyone = p.all_gather_object(mine, schedule.group)
        for pp_rank, theirs in enumerate(everyone):
            if theirs["dp"] != mine["dp"]:
                raise ValueError(
                    f"data_parallel: rank {schedule.group.ranks[0]} has {everyone[0]['dp']} data-parallel replicas "
                    f"but rank {schedule.group.ranks[pp_rank]} has {theirs['dp']}"
                )
        # with gather="layer" torch's FSDP2 gathers each module around its own forward and backward
        self.sharded_stages = {s for t in everyone for s in t["sharded"]} if gather == "stage" else set()
        self.all_stages = {s for t in everyone for s in t["stages"]}
        self.reduced = 0  # FSDP_REDUCE_GRAD steps run in the current run

    def _classify(self, stage: Any) -> _StageSync:
        module = stage.submodule
        native = self.fsdp is not None and self.fsdp.is_sharded(module)
        own = sharded_states(module)
        ranks = tuple(self.group.ranks)
        if native:
            found = self.fsdp.group_ranks(module)
            if found is not None and tuple(sorted(found)) != tuple(sorted(ranks)):
                raise ValueError(f"stage {stage.stage_index} is fully sharded over ranks {list(found)}, but the "
                                 f"data-parallel dimension through rank {self.p.rank} is {list(ranks)}")
            if self.gather == "stage":
                self.fsdp.take_over(module)
        if own and self.gather == "layer":
            raise ValueError("gather='layer' needs torch's FSDP2 (a torch.distributed job); this library's "
                             "fully_shard gathers whole stages (gather='stage')")
        for state in own:
            if tuple(state.group.ranks) != ranks:
                raise ValueError(f"stage {stage.stage_index} is fully sharded over ranks {list(state.group.ranks)}, "
                                 f"but the data-parallel dimension through rank {self.p.rank} is {list(ranks)}")
        plain = [param for param in stage.params
                 if state_of(param) is None and not (native and self.fsdp.manages(param))]
        return _StageSync(module, native, own, GradBucket(self.p, plain, self.group) if plain else None)

    # ------------------------------------------------------------------ lowering
    def lowering_pass(self, lowered: dict[int, list[MetaStep]], schedule: PipelineSchedule,
                      forward_only: bool) -> dict[int, list[MetaStep]]:
        if self.fsdp is not None and any(sync.native for sync in self.local.values()):
            split = {part.meta_type for steps in lowered.values() for s in steps if s is not None for part in s.parts}
            if _T.BWD_INPUT in split or _T.BWD_WEIGHT in split:
                raise ValueError("torch's FSDP2 cannot run a split backward (I/W steps): its unsharded "
                                 "parameters are not the stage's parameters")
        return window.insert_all(lowered, self.sharded_stages, self.all_stages, self.lookahead, forward_only)

    # ------------------------------------------------------------------ step handlers
    def unshard(self, runtime: Any, step: MetaStep) -> None:
        sync = self.local[step.stage_index]
        if sync.native:
            self.fsdp.unshard(sync.module)
        for state in sync.own:
            state.unshard()

    def reshard(self, runtime: Any, step: MetaStep) -> None:
        sync = self.local[step.stage_index]
        if sync.native:
            self.fsdp.reshard(sync.module)
        for state in sync.own:
            state.reshard()

    def reduce_grad(self, runtime: Any, step: MetaStep) -> None:
        sync = self.local[step.stage_index]
        if sync.bucket is not None:
            sync.bucket.start()
        if sync.native:
            self.fsdp.reduce_grads(sync.module)
        for state in sync.own:
            state.reduce_grads()
        self.reduced += 1
        if self.reduced == len(self.local):  # the rank's last one: the all-reduces must be done
            for other in self.local.values():
                if other.bucket is not None:
                    other.bucket.finish()

    def handlers(self) -> dict[MetaStepType, Any]:
        return {_T.FSDP_UNSHARD: self.unshard, _T.FSDP_RESHARD: self.reshard, _T.FSDP_REDUCE_GRAD: self.reduce_grad}

    # ------------------------------------------------------------------ run hook
    def before_run(self, schedule: PipelineSchedule, runtime: Any) -> None:
        self.reduced = 0
        for sync in self.local.values():
            if sync.native:
                self.fsdp.begin_run(sync.module, keep_gathered=self.gather == "stage")
            for state in sync.own:
                state.begin_accumulation()
            if sync.bucket is not None:
                sync.bucket.begin_accumulation()

    def after_run(self, schedule: PipelineSchedule, runtime: Any) -> None:
        if self.reduced != len(self.local):
            raise RuntimeError(
                f"rank {self.p.rank}: {self.reduced} of {len(self.local)} stages reduced their gradients in this run; "
                "a custom step function must not replace FSDP_REDUCE_GRAD steps"
            )

    def on_failure(self, schedule: PipelineSchedule) -> None:
        self.reduced = 0
        for sync in self.local.values():
            if sync.native:
                self.fsdp.discard_grads(sync.module)
            for state in sync.own:
                state.discard()
            if sync.bucket is not None:
                sync.bucket.discard()


def data_parallel(schedule: PipelineSchedule, mesh: DeviceMesh, *, dim: str = "dp", lookahead: int = 2,
                  gather: str = "stage") -> PipelineSchedule:
    """Make ``schedule`` one of the data-parallel replicas along ``mesh``'s ``dim`` dimension (a 1-D mesh
    is that dimension); returns the schedule. Call it on every rank after building the schedule.

    Stages whose module was passed to :func:`~hyper_parallel.fully_shard` are gathered ``lookahead``
    distinct stages ahead of their compute and freed when they leave that window; their gradients are
    reduce-scattered once per run. Every other parameter's gradient is all-reduced once per run, after
    the stage's last backward. Both average over the replicas.

    ``gather="layer"`` (torch's FSDP2 only) leaves the gathering to FSDP2's own hooks instead: each
    fully sharded sub-module is gathered around its forward and its backward of every micro-batch
    (``reshard_after_forward`` as given to ``fully_shard``), so at most a few layers are whole at a
    time, for one all-gather per module per micro-batch and direction instead of one per window.
    """
    if not isinstance(schedule, PipelineSchedule):
        raise TypeError(f"data_parallel needs a pipeline schedule, got {type(schedule).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a hyper_parallel DeviceMesh, got {type(mesh).__name__}")
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
        raise ValueError(f"lookahead must be an int >= 1, got {lookahead!r}")
    if gather not in ("stage", "layer"):
        raise ValueError(f"gather must be 'stage' or 'layer', got {gather!r}")
    if mesh.ndim > 1 and dim not in mesh.mesh_dim_names:
        raise ValueError(f"mesh has no dimension {dim!r}: {list(mesh.mesh_dim_names)}")
    if getattr(schedule, "_data_parallel", None) is not None:
        raise ValueError("data_parallel was already applied to this schedule")
    feature = DataParallel(schedule, mesh if mesh.ndim == 1 else mesh[dim], lookahead, gather, mesh)
    schedule.add_feature(lowering_pass=feature.lowering_pass, handlers=feature.handlers(), hook=feature)
    schedule._data_parallel = feature  # type: ignore[attr-defined]
    schedule.exec_order  # noqa: B018  (lower and validate now: fail before any communication)
    return schedule


def data_parallel_state(schedule: Any) -> DataParallel | None:
    """The :class:`DataParallel` state ``data_parallel`` attached to ``schedule`` (or ``None``)."""
    return getattr(schedule, "_data_parallel", None)
