"""PipelineStage: one model chunk, its place in the pipeline and what it agreed with neighbours."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hyper_parallel.core.pipeline_parallel.meta import TensorMeta
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import Group


def _check_index(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


class PipelineStage:
    """One stage of a pipeline: ``submodule`` is stage ``stage_index`` of ``stage_num``.

    ``group`` (or the ``"pp"`` dimension of ``mesh``) is the process group of the pipeline;
    by default the whole world. With ``dyn_shape=True`` the shapes of the tensors passed
    between stages are exchanged for every micro-batch (so sequence lengths may vary);
    otherwise once, on the first run. ``shared_parameters`` maps a tie name to a parameter
    of this stage (or to its name in ``submodule``); stages that use the same tie name hold
    the same weight: values are synced when the schedule is built and gradients summed
    after every run.
    """

    def __init__(
        self,
        submodule: Any,
        stage_index: int,
        stage_num: int,
        device: Any = None,
        group: Group | None = None,
        mesh: Any = None,
        dyn_shape: bool = False,
        shared_parameters: Mapping[str, Any] | None = None,
    ) -> None:
        _check_index("stage_index", stage_index)
        _check_index("stage_num", stage_num)
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
        self.device = device
        self.dyn_shape = bool(dyn_shape)
        if mesh is not None:
            mesh = mesh if mesh.ndim == 1 else mesh["pp"]
            group = mesh.get_group()
        self.group: Group = group if group is not None else self.platform.world_group
        if self.platform.rank not in self.group.ranks:
            raise ValueError(f"rank {self.platform.rank} is not in the pipeline group {list(self.group.ranks)}")
        self.named_params: list[tuple[str, Any]] = self.platform.named_parameters(submodule)
        self.params = [p for _, p in self.named_params]
        self.shared_parameters = self._resolve_shared(shared_parameters or {})
        # What this stage agreed with its neighbours (static shapes): filled on the first run.
        self.input_meta: list[TensorMeta] | None = None
        self.output_meta: list[TensorMeta] | None = None

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
        """Accumulated gradient of every parameter that has one, by parameter name."""
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
