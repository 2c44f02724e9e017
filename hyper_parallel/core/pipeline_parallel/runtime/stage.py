"""PipelineStage: one model chunk, its place in the pipeline and what it agreed with neighbours."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hyper_parallel.core.pipeline_parallel.ir.placement import check_flag, check_int
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import Group


class PipelineStage:
    """One stage of a pipeline: ``submodule`` is stage ``stage_index`` of ``stage_num``.

    ``device`` is where received tensors and this stage's micro-batch inputs are placed (a torch
    device or its name; default: the platform's current device). ``group`` (or the ``"pp"``
    dimension of ``mesh``) is the process group of the pipeline; by default the whole world.
    ``mesh`` (kept as ``stage.mesh``) is also where DTensors received from the previous stage are
    rebuilt: on this rank's line of the mesh dimensions they were laid out over (e.g. ``"tp"``).
    The shapes of the tensors passed between stages are exchanged for the first micro-batch of
    every run (the others must match it); with ``dyn_shape=True`` for every micro-batch (so
    sequence lengths may vary within a run).
    ``shared_parameters`` maps a tie name to a parameter of this stage (or to its name in
    ``submodule``); stages that use the same tie name hold the same weight: values are synced
    when the schedule is built and gradients summed after every run.

    ``free_sent_outputs`` (default True): once an output has been sent to the next stage, its
    storage is released and only its autograd link is kept, as Megatron does (never a tensor the
    graph saved for its backward). A forward hook, or a custom autograd function that keeps a
    reference to that output on ``ctx`` instead of ``save_for_backward``, then sees an empty
    tensor; pass ``False`` to keep the data (it costs one output's memory per micro-batch in flight).
    ``num_stages`` is accepted as another name of ``stage_num`` (torch.distributed.pipelining's).
    The trainable parameters are read from ``submodule`` at every run, so a parameter frozen
    or unfrozen after the stage was built is handled.
    """

    def __init__(
        self,
        submodule: Any,
        stage_index: int,
        stage_num: int | None = None,
        device: Any = None,
        group: Group | None = None,
        mesh: Any = None,
        dyn_shape: bool = False,
        shared_parameters: Mapping[str, Any] | None = None,
        free_sent_outputs: bool = True,
        num_stages: int | None = None,
    ) -> None:
        if stage_num is None and num_stages is None:
            raise TypeError("PipelineStage needs stage_num (or num_stages)")
        if stage_num is not None and num_stages is not None and stage_num != num_stages:
            raise ValueError(f"stage_num={stage_num} and num_stages={num_stages} disagree")
        stage_num = stage_num if stage_num is not None else num_stages
        check_int("stage_index", stage_index)
        check_int("stage_num", stage_num)
        if stage_num < 1:
            raise ValueError(f"stage_num must be >= 1, got {stage_num}")
        if not 0 <= stage_index < stage_num:
            raise ValueError(f"stage_index must be in [0, {stage_num}), got {stage_index}")
        if group is not None and mesh is not None:
            raise ValueError("pass either group= or mesh=, not both")
        self.platform = get_platform()
        self.submodule = submodule
        self.stage_index = stage_index
        self.stage_num = stage_num
        self.device = self.platform.check_device(device)
        self.dyn_shape = check_flag("dyn_shape", dyn_shape)
        self.free_sent_outputs = check_flag("free_sent_outputs", free_sent_outputs)
        # learned by the runtime from this stage's last forward: whether it sent a single tensor
        # (such forwards run without the saved-tensor pool; see ``PipelineRuntime._needs_pool``)
        self.sends_one_tensor = False
        self.mesh = mesh  # the whole mesh: DTensors arriving from the previous stage are rebuilt on it
        if mesh is not None:
            pp_mesh = mesh if mesh.ndim == 1 else mesh["pp"]
            group = pp_mesh.get_group()
        self.group: Group = group if group is not None else self.platform.world_group
        if self.platform.rank not in self.group.ranks:
            raise ValueError(f"rank {self.platform.rank} is not in the pipeline group {list(self.group.ranks)}")
        self.shared_parameters = self._resolve_shared(shared_parameters or {})

    @property
    def named_params(self) -> list[tuple[str, Any]]:
        """The trainable parameters of ``submodule`` now, as a list of ``(name, parameter)`` pairs: on torch
        the submodule's own names (``0.weight``), on MindSpore ``Parameter.name``."""
        return self.platform.named_parameters(self.submodule)

    @property
    def params(self) -> list[Any]:
        """The trainable parameters of ``submodule`` now."""
        return [p for _, p in self.named_params]

    def _resolve_shared(self, shared: Mapping[str, Any]) -> dict[str, Any]:
        by_name = dict(self.named_params)
        resolved = {}
        for tie, param in shared.items():
            if isinstance(param, str):
                if param not in by_name:
                    raise ValueError(f"shared parameter {tie!r}: stage has no parameter named {param!r}")
                param = by_name[param]
            elif not any(param is p for p in self.params):
                raise ValueError(f"shared parameter {tie!r} is not a trainable parameter of this stage's module")
            resolved[tie] = param
        return resolved

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.stage_num - 1

    def named_gradients(self) -> dict[str, Any]:
        """Accumulated gradient of every trainable parameter that has one: a dict keyed by the names of
        :attr:`named_params` (the stage's own names; ``schedule.named_gradients()`` prefixes ``stage<i>.``)."""
        out = {}
        for name, p in self.named_params:
            grad = self.platform.get_grad(p)
            if grad is not None:
                out[name] = grad
        return out

    def zero_grad(self) -> None:
        self.platform.zero_grads(self.params)

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.stage_num}, group={list(self.group.ranks)})"
