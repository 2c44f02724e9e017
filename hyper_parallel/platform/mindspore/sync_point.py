"""Differentiable sync points for MindSpore (PyNative): an identity with a gradient hook.

A Cell with a custom ``bprop`` does not work with the eager autograd engine this backend uses,
so the backward callback is a tensor hook on a ``* 1`` alias of the tensor: the engine calls it
when the gradient of the alias is complete, before anything upstream of the sync point runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mindspore as ms
from mindspore import ops


def sync_point(tensor: Any, on_forward: Callable[[], None], on_backward: Callable[[], None]) -> Any:
    """Call ``on_forward()`` now; return ``tensor`` (an alias of it when a gradient can flow)
    whose gradient, when the backward reaches it, first calls ``on_backward()``.

    A tensor no gradient can flow through (not floating point) is returned as is and
    ``on_backward`` is never called.
    """
    if not isinstance(tensor, ms.Tensor):
        raise TypeError(f"a sync point needs a tensor, got {type(tensor).__name__}")
    on_forward()
    if not ops.is_floating_point(tensor):
        return tensor
    alias = tensor * 1

    def hook(grad: Any) -> Any:
        on_backward()
        return grad

    alias.register_hook(hook)
    return alias
