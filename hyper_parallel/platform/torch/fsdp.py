"""torch's own FSDP2 (``torch.distributed.fsdp.fully_shard``) driven by a pipeline schedule.

``fully_shard`` is torch's: parameters become ``DTensor`` shards, unsharded before use by FSDP's own
hooks. Inside a pipeline the schedule decides instead (``hyper_parallel/core/fully_shard``):

* at the start of a run, gradient sync and resharding are switched off
  (``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``,
  ``set_is_last_backward(False)``), so every micro-batch's backward only accumulates the unsharded
  gradients; ``reshard_after_forward`` is switched off once, when the pipeline takes the module;
* ``FSDP_UNSHARD`` / ``FSDP_RESHARD`` call the public ``unshard(async_op=True)`` / ``reshard()`` of
  every FSDP module of the stage (FSDP's pre-forward and pre-backward hooks wait for a pending
  unshard);
* ``FSDP_REDUCE_GRAD`` switches sync back on and runs the post-backward of every parameter group:
  one reduce-scatter per group per run. torch has no public call for "reduce the accumulated
  gradients now" (a pipeline never runs a backward with sync on); like
  ``torch.distributed.pipelining`` this uses the state behind ``fully_shard.state(module)``
  (``_state_ctx.all_states``, ``_fsdp_param_groups``, ``post_backward``, and the root's
  ``_root_post_backward_final_callback``). :func:`available` checks those names exist.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def available() -> str | None:
    """Why the pipeline cannot drive this torch's FSDP2, or ``None`` when it can."""
    missing = [name for name in ("set_requires_gradient_sync", "set_reshard_after_backward", "set_is_last_backward",
                                 "set_reshard_after_forward", "unshard", "reshard") if not hasattr(FSDPModule, name)]
    if not hasattr(fully_shard, "state"):
        missing.append("fully_shard.state")
    return f"torch {torch.__version__}'s FSDP2 lacks {missing}" if missing else None


class TorchFSDP:
    """The FSDP operations a pipeline schedule needs, over torch's FSDP2 (see the module docstring)."""

    name = "torch FSDP2"

    def fully_shard(self, module: Any, torch_mesh: Any, reshard_after_forward: bool) -> Any:
        return fully_shard(module, mesh=torch_mesh, reshard_after_forward=reshard_after_forward)

    @staticmethod
    def modules(module: Any) -> list[Any]:
        """The FSDP modules inside ``module`` (itself included), outermost first."""
        return [m for m in module.modules() if isinstance(m, FSDPModule)]

    def is_sharded(self, module: Any) -> bool:
        return bool(self.modules(module))

    def manages(self, param: Any) -> bool:
        """Whether FSDP shards this parameter (its parameters are DTensors)."""
        return isinstance(param, DTensor)

    def group_ranks(self, module: Any) -> tuple[int, ...] | None:
        """The ranks the parameters of ``module`` are sharded over (None: no sharded parameter)."""
        for param in module.parameters():
            if isinstance(param, DTensor):
                return tuple(int(r) for r in param.device_mesh.mesh.flatten().tolist())
        return None

    def take_over(self, module: Any) -> None:
        """The pipeline decides when parameters are gathered: no resharding after each forward."""
        for m in self.modules(module):
            m.set_reshard_after_forward(False, recurse=False)

    def begin_run(self, module: Any, keep_gathered: bool = True) -> None:
        """Micro-batch backwards only accumulate the unsharded gradients; with ``keep_gathered`` the
        parameters stay gathered after each backward (the schedule frees them), else FSDP frees them."""
        for m in self.modules(module):
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_backward(not keep_gathered, recurse=False)
            m.set_is_last_backward(False)

    def unshard(self, module: Any) -> None:
        for m in self.modules(module):
            m.unshard(async_op=True)

    def reshard(self, module: Any) -> None:
        for m in self.modules(module):
            m.reshard()

    def reduce_grads(self, module: Any) -> None:
        """Reduce-scatter the accumulated gradients into the sharded ``param.grad`` (summed onto any
        gradient already there), averaged over the data-parallel ranks."""
        roots = self.modules(module)
        for m in roots:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
            m.set_is_last_backward(True)
        for group in _param_groups(roots[0]):
            group.post_backward()
        _state(roots[0])._root_post_backward_final_callback()

    def discard_grads(self, module: Any) -> None:
        """After a failed run: drop the unreduced gradients and the unsharded parameters."""
        roots = self.modules(module)
        for group in _param_groups(roots[0]):
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param.unsharded_param.grad = None
        self.begin_run(module)
        _state(roots[0])._root_post_backward_final_callback()
        self.reshard(module)


def _state(module: Any) -> Any:
    return fully_shard.state(module)  # type: ignore[attr-defined]


def _param_groups(root: Any) -> Iterator[Any]:
    for state in _state(root)._state_ctx.all_states:
        yield from state._fsdp_param_groups
