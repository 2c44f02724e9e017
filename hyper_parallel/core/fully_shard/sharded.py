"""Fully sharded parameters over the platform collectives (MindSpore, and torch on a LocalCluster).

Each trainable parameter of a module whose dimension 0 divides by the group size keeps only its
piece of dimension 0 (its group rank's row block) as its data: the parameter object stays the same,
its data is swapped (``Platform.set_param_storage``), so optimizers built afterwards see and update
the shards. ``unshard`` all-gathers every shard of the module in one collective and puts the whole
tensors back; ``reshard`` drops them. ``reduce_grads`` reduce-scatters the whole gradients the
backward accumulated, in one collective, averaged over the group (data-parallel semantics), and adds
the result to the sharded gradient the parameter held before. Parameters whose dimension 0 does not
divide (or scalars) stay whole on every rank; their gradients are all-reduced (averaged) instead.
A parameter no rank of the group gave a gradient keeps ``None`` (the ranks agree through one flag
per parameter at the end of each collective's buffer); one that only some ranks used counts zeros
on the others.

Outside a pipeline the first forward gathers the parameters (a forward pre-hook) and
``reduce_grads`` followed by ``reshard`` ends the step; inside one the schedule's FSDP steps call
these methods (``hyper_parallel/core/fully_shard/data_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hyper_parallel.platform.base import Group, Platform

ATTR = "_hyper_parallel_shards"  # set on each sharded parameter: the ShardedModule that holds it


@dataclass
class _Entry:
    name: str
    param: Any
    full_shape: tuple[int, ...]
    shard: Any = None  # the shard while the whole tensor is in place


def _product(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def state_of(param: Any) -> ShardedModule | None:
    """The :class:`ShardedModule` that holds ``param``, if any."""
    return getattr(param, ATTR, None)


class ShardedModule:
    """The sharded parameters of one module over one group (see the module docstring)."""

    def __init__(self, platform: Platform, module: Any, group: Group) -> None:
        self.p = platform
        self.module = module
        self.group = group
        self.size = group.size
        self.index = group.group_rank(platform.rank)
        self.sharded: list[_Entry] = []
        self.replicated: list[_Entry] = []
        for name, param in platform.named_parameters(module):
            if state_of(param) is not None:
                continue  # a submodule was sharded first: its parameters stay with it
            data = platform.param_data(param)
            shape = tuple(platform.shape(data))
            entry = _Entry(name, param, shape)
            if shape and shape[0] % self.size == 0 and self.size > 1:
                platform.set_param_storage(param, platform.clone(platform.chunk(data, self.size, 0)[self.index]))
                self.sharded.append(entry)
            else:
                self.replicated.append(entry)
            setattr(param, ATTR, self)
        self.gathered = False
        self._prior: dict[int, Any] = {}  # gradient a parameter held before the current accumulation
        self._hook = platform.register_forward_pre_hook(module, self._before_forward)

    @property
    def params(self) -> list[Any]:
        return [e.param for e in self.sharded + self.replicated]

    def _before_forward(self) -> None:
        if not self.gathered:
            self.unshard()

    # ------------------------------------------------------------------ parameters
    def unshard(self) -> None:
        """All-gather the shards (one collective) and make each parameter whole."""
        if self.gathered:
            return
        p = self.p
        self.gathered = True
        if not self.sharded:
            return
        for e in self.sharded:  # a sharded gradient cannot sit beside whole data: keep it aside
            grad = p.get_grad(e.param)
            if grad is not None and tuple(p.shape(grad)) != e.full_shape:
                self._prior[id(e.param)] = grad
                p.set_grad(e.param, None)
        shards = [p.param_data(e.param) for e in self.sharded]
        flat = p.cat([p.reshape(s, (-1,)) for s in shards])
        per_rank = [p.split(piece, [p.numel(s) for s in shards]) for piece in p.all_gather(flat, self.group)]
        for k, (e, shard) in enumerate(zip(self.sharded, shards, strict=True)):
            shard_shape = p.shape(shard)
            whole = p.cat([p.reshape(pieces[k], shard_shape) for pieces in per_rank], 0)
            e.shard = shard
            p.set_param_storage(e.param, whole)

    def reshard(self) -> None:
        """Drop the whole tensors; every parameter holds its shard again."""
        if not self.gathered:
            return
        for e in self.sharded:
            self.p.set_param_storage(e.param, e.shard)
            e.shard = None
        self.gathered = False

    # ------------------------------------------------------------------ gradients
    def begin_accumulation(self) -> None:
        """Keep the gradients held now aside: the next ``reduce_grads`` adds them to its result."""
        for e in self.sharded + self.replicated:
            grad = self.p.get_grad(e.param)
            if grad is not None:
                self._prior[id(e.param)] = grad
                self.p.set_grad(e.param, None)

    def reduce_grads(self) -> None:
        """Reduce-scatter (sharded) and all-reduce (whole) the accumulated gradients, averaged over
        the group, each in one collective; a parameter without a gradient here counts zeros, and
        keeps ``None`` where no rank has one. The whole parameters are freed first (a sharded
        gradient sits beside sharded data)."""
        p = self.p
        if self.sharded:
            grads = [self._grad_or_zeros(e, e.full_shape) for e in self.sharded]
            flags = self._flags(self.sharded)
            per_param = [p.chunk(g, self.size, 0) for g in grads]
            buckets = [p.cat([*(p.reshape(pieces[r], (-1,)) for pieces in per_param), flags]) for r in range(self.size)]
            mine = p.reduce_scatter(buckets, "avg", self.group)
            for e in self.sharded:  # a sharded gradient needs sharded data beside it
                p.set_grad(e.param, None)
            self.reshard()
            shard_shapes = [(e.full_shape[0] // self.size, *e.full_shape[1:]) for e in self.sharded]
            *flat, used = p.split(mine, [*(_product(s) for s in shard_shapes), len(self.sharded)])
            for e, piece, shape, any_rank in zip(self.sharded, flat, shard_shapes, self._used(used), strict=True):
                self._set(e, p.reshape(piece, shape) if any_rank else None)
        if self.replicated:
            grads = [self._grad_or_zeros(e, e.full_shape) for e in self.replicated]
            flat = p.all_reduce(p.cat([*(p.reshape(g, (-1,)) for g in grads), self._flags(self.replicated)]),
                                "avg", self.group)
            *pieces, used = p.split(flat, [*(_product(e.full_shape) for e in self.replicated), len(self.replicated)])
            for e, piece, any_rank in zip(self.replicated, pieces, self._used(used), strict=True):
                self._set(e, p.reshape(piece, e.full_shape) if any_rank else None)

    def _flags(self, entries: Sequence[_Entry]) -> Any:
        """1 for each entry with a gradient on this rank, else 0, in the entries' dtype (averaged, > 0 means
        some rank has one)."""
        dtype = self.p.dtype_name(self.p.param_data(entries[0].param))
        return self.p.tensor([0.0 if self.p.get_grad(e.param) is None else 1.0 for e in entries], dtype)

    def _used(self, flags: Any) -> list[bool]:
        return [float(f) > 0.0 for f in self.p.to_numpy(flags)]

    def discard(self) -> None:
        """After a failed run: shards back in place, nothing kept aside (the run restored the gradients)."""
        self.reshard()
        self._prior.clear()

    def _grad_or_zeros(self, e: _Entry, shape: Sequence[int]) -> Any:
        grad = self.p.get_grad(e.param)
        if grad is None:
            return self.p.zeros(shape, self.p.dtype_name(self.p.param_data(e.param)))
        return grad

    def _set(self, e: _Entry, grad: Any) -> None:
        """The reduced gradient (``None``: no rank had one) added to the one kept aside before."""
        prior = self._prior.pop(id(e.param), None)
        if grad is None:
            self.p.set_grad(e.param, prior)
            return
        self.p.set_grad(e.param, self.p.clone(grad) if prior is None else prior + grad)
