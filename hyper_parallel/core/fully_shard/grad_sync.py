"""Data-parallel gradient averaging for parameters that are not sharded: one bucket per stage.

``start`` flattens the stage's accumulated gradients into one buffer per dtype and starts an
all-reduce (average) of it without waiting (``Platform.all_reduce_async``: torch.distributed runs it
while later backwards compute); ``finish`` waits and puts the averages back as the gradients, added
to the gradients kept aside by ``begin_accumulation`` (those of before the run), so a run adds the
average of its own contribution, as one backward of ``DistributedDataParallel`` would.

A parameter no rank of the group gave a gradient keeps ``None`` (an optimizer then leaves it alone,
weight decay included, as without data parallelism); one that some rank did not use counts zeros
there. The ranks agree on which is which in the same collective: each buffer ends with one flag per
parameter (1 where this rank has a gradient), averaged with the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.platform.base import Group, Handle, Platform

ATTR = "_hyper_parallel_replicas"  # set on each parameter of a bucket: the number of replicas it is averaged over


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class GradBucket:
    """The gradients of some parameters, averaged over ``group`` in one collective per dtype."""

    def __init__(self, platform: Platform, params: Sequence[Any], group: Group) -> None:
        self.p = platform
        self.params = list(params)
        self.group = group
        for param in self.params:
            setattr(param, ATTR, group.size)
        self._prior: dict[int, Any] = {}
        self._pending: list[tuple[list[Any], Any, Handle]] = []  # (params, flat buffer, handle)

    def begin_accumulation(self) -> None:
        for param in self.params:
            grad = self.p.get_grad(param)
            if grad is not None:
                self._prior[id(param)] = grad
                self.p.set_grad(param, None)

    def start(self) -> None:
        p = self.p
        by_dtype: dict[str, list[Any]] = {}
        for param in self.params:
            by_dtype.setdefault(p.dtype_name(p.param_data(param)), []).append(param)
        for dtype, params in sorted(by_dtype.items()):
            grads, flags = [], []
            for param in params:
                grad = p.get_grad(param)
                grads.append(p.reshape(grad if grad is not None else p.zeros_like(p.param_data(param)), (-1,)))
                flags.append(0.0 if grad is None else 1.0)
            flat = p.cat([*grads, p.tensor(flags, dtype)])
            self._pending.append((params, flat, p.all_reduce_async(flat, "avg", self.group)))

    def finish(self) -> None:
        p = self.p
        pending, self._pending = self._pending, []
        for params, flat, handle in pending:
            handle.wait()
            shapes = [p.shape(p.param_data(param)) for param in params]
            *pieces, flags = p.split(flat, [*(_numel(s) for s in shapes), len(params)])
            used = [float(f) > 0.0 for f in p.to_numpy(flags)]
            for param, piece, shape, any_rank in zip(params, pieces, shapes, used, strict=True):
                prior = self._prior.pop(id(param), None)
                if not any_rank:  # no rank produced a gradient: keep what was there (None, or the prior)
                    p.set_grad(param, prior)
                    continue
                averaged = p.reshape(piece, shape)
                p.set_grad(param, averaged if prior is None else prior + averaged)

    def discard(self) -> None:
        """After a failed run: forget what is in flight and what was kept aside."""
        self._pending.clear()
        self._prior.clear()
