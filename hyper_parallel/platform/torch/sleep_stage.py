"""A stage whose compute is a fixed sleep: the workload of ``hyper-parallel calibrate`` and of
``benchmarks/fidelity.py``.

``SleepStage(f_s, i_s, w_s)`` computes ``x * scale`` and sleeps ``f_s`` seconds in its forward,
``i_s`` in the backward towards its input and ``w_s`` in the backward towards ``scale``: a full
backward sleeps ``i_s + w_s``, and with the dx/dW split the input backward sleeps ``i_s`` and the
weight backward ``w_s``. Sleeping processes leave the CPU to the others, so a pipeline of them
shows the schedule and the runtime rather than the arithmetic.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class _SleepCopy(torch.autograd.Function):
    """A copy of ``x`` that sleeps ``fwd_s`` in its forward and ``bwd_s`` in its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        if fwd_s > 0:
            time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.bwd_s > 0:
            time.sleep(ctx.bwd_s)
        return grad, None, None


class SleepStage(torch.nn.Module):
    """``x * scale`` with fixed sleeps (see the module docstring); ``width`` is the feature size."""

    def __init__(self, f_s: float, i_s: float, w_s: float, width: int = 16) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(width))
        self.f_s, self.i_s, self.w_s = float(f_s), float(i_s), float(w_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _SleepCopy.apply(self.scale, 0.0, self.w_s)
        return _SleepCopy.apply(x * weight, self.f_s, self.i_s)


def squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error, the loss of a sleep pipeline."""
    return ((out - target) ** 2).mean()


def sample(rows: int, width: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An input batch and a target of ``rows`` rows."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen)
