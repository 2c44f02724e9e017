"""Differentiable sync points for torch: an identity that calls back in forward and backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class _BackwardCallback(torch.autograd.Function):
    """Identity whose backward calls ``on_backward()`` before passing the gradient on unchanged."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, on_backward: Callable[[], None]) -> torch.Tensor:
        ctx.on_backward = on_backward
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.on_backward()
        return grad, None


def sync_point(tensor: Any, on_forward: Callable[[], None], on_backward: Callable[[], None]) -> Any:
    """Call ``on_forward()`` now; return ``tensor`` as a new graph node whose backward calls
    ``on_backward()`` when the gradient reaches it (the gradient itself is unchanged).

    ``on_forward`` runs before the node is recorded, outside any autograd call. A tensor no
    gradient can flow through (integer dtype, or recorded without grad) gets no node and
    ``on_backward`` is never called.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a sync point needs a tensor, got {type(tensor).__name__}")
    on_forward()
    if not (tensor.requires_grad and torch.is_grad_enabled()):
        return tensor
    return _BackwardCallback.apply(tensor, on_backward)
