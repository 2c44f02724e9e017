"""The gradients of one run: accumulated in place, put back as they were if the run fails.

A run adds its contribution to whatever gradients the parameters already hold, in place (the
framework's own accumulation: no second gradient buffer on the device). With
``scale_grads`` the contribution is scaled by seeding each micro-batch's loss gradient with
``1 / micro_batch_num``, so no pass over the gradients is needed afterwards and earlier
gradients are not rescaled.

If the run fails, every parameter gets back exactly the gradient it had before: parameters
that had none lose what the run accumulated; for those that had one, a copy taken when the
run started is copied back into the same gradient tensor (views of it stay valid). The copies
live in host memory (pinned on accelerators, so the device holds one gradient buffer, as native
accumulation does) and are reused from run to run. ``keep_grads_on_error=False`` skips them; a
failed run then leaves the gradients that existed before it partly accumulated. The gradient
of a tied weight's non-owning holder, which every run rebuilds from the tie's sum, is always
kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform.base import Platform

HostCopies = dict[int, tuple[Any, Any]]  # id(param) -> (param, host copy), kept by the schedule


class RunGradients:
    """Snapshot what a failed run must restore; clear the gradients a tied-weight sum rebuilds."""

    def __init__(self, platform: Platform, params: Sequence[Any], keep_on_error: bool, cleared: Sequence[Any],
                 copies: HostCopies) -> None:
        self.p = platform
        cleared_ids = {id(c) for c in cleared}
        self.fresh: list[Any] = []  # parameters with no gradient before the run
        self.kept: list[tuple[Any, Any, Any]] = []  # (param, its gradient tensor, host copy)
        for param in params:
            grad = platform.get_grad(param)
            if grad is None:
                self.fresh.append(param)
            elif keep_on_error or id(param) in cleared_ids:
                self.kept.append((param, grad, _host_copy(platform, copies, param, grad)))
        for param in params:
            if id(param) in cleared_ids:  # a non-owning holder of a tie gets the whole sum afterwards
                platform.set_grad(param, None)

    def restore(self) -> None:
        """Put back the gradients of before the run (see the module docstring)."""
        for param in self.fresh:
            self.p.set_grad(param, None)
        for param, grad, copy in self.kept:
            if self.p.get_grad(param) is grad:
                self.p.copy_(grad, copy)
            else:
                self.p.set_grad(param, self.p.to_device(copy))


def _host_copy(platform: Platform, copies: HostCopies, param: Any, grad: Any) -> Any:
    held = copies.get(id(param))
    if held is not None and held[0] is param:
        copy = held[1]
        if platform.shape(copy) == platform.shape(grad) and platform.dtype_name(copy) == platform.dtype_name(grad):
            return platform.copy_(copy, grad)
    copy = platform.to_host(grad)
    copies[id(param)] = (param, copy)
    return copy
