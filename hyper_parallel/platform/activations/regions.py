"""Swap and recompute regions: what a wrapped module does with the tensors its forward saves.

A wrapped module's forward opens a region (unless one is open already: the outermost wrapped
module decides) and installs saved-tensor hooks that pack through the current pool (the stage
forward's; a fresh one outside any stage), so the dx/dW split, swap and memory accounting see
every saved tensor as one kind of packed item.

* :class:`SwapRegion` collects the items; once the forward returns, the items that are not module
  outputs, parameters or inputs go to a :class:`SwapGroup` that is offloaded at once and loaded
  back when the gradient reaches the module's outputs.
* :class:`CheckpointRegion` drops every item as it is packed (except inside the sub-modules chosen
  with ``save``), keeps the module's inputs as items, and re-runs the module's forward the first
  time its backward reads a dropped item, capturing what the re-run saves, in the same order, into
  the dropped items. The re-run's own graph is never differentiated, so backward hooks fire once;
  forward hooks inside the module fire again (see :func:`is_recomputing`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from hyper_parallel.platform.activations.ops import FrameworkOps
from hyper_parallel.platform.activations.state import entered_region, recomputing
from hyper_parallel.platform.activations.swap import SwapGroup, select_swappable


def map_tensors(ops: FrameworkOps, value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (tuples, lists, dicts, named tuples)."""
    if ops.is_tensor(value):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(ops, v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(ops, v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(ops, v, fn)) for k, v in value.items())
    return value


def tensors_in(ops: FrameworkOps, value: Any) -> list[Any]:
    found: list[Any] = []
    map_tensors(ops, value, found.append)
    return found


class _PackedRef:
    """A tensor kept by a region (an input of a checkpointed module), held as a pool item so that
    swap and memory accounting see it."""

    __slots__ = ("item", "requires_grad")

    def __init__(self, item: Any, requires_grad: bool) -> None:
        self.item = item
        self.requires_grad = requires_grad  # a re-run saves the same tensors only if this matches


class SwapRegion:
    """One call of a swap-wrapped module: the items its forward packed."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.items: list[Any] = []

    def pack(self, tensor: Any) -> Any:
        item = self.pool.pack(tensor)
        self.items.append(item)
        return item

    def unpack(self, item: Any) -> Any:
        return self.pool.unpack(item)

    def group(self, ops: FrameworkOps, engine: Any, args: Any, outputs: Any) -> SwapGroup | None:
        keep = {ops.storage_key(t) for t in tensors_in(ops, outputs) + tensors_in(ops, args)}
        items = select_swappable(ops, self.items, keep)
        self.items = []
        return SwapGroup(ops, engine, items) if items else None


class CheckpointRegion:
    """One call of a checkpoint-wrapped module (see the module docstring)."""

    def __init__(self, ops: FrameworkOps, pool: Any, owner: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], saved: frozenset[int], preserve_rng: bool,
                 on_recompute: Callable[[], None] | None = None) -> None:
        self.ops, self.pool, self.owner, self.fn = ops, pool, owner, fn
        self.saved = saved  # ids of the sub-modules whose outputs are kept
        self.inputs = map_tensors(ops, (args, kwargs), self._keep)
        self.rng = ops.get_rng_state() if preserve_rng else None
        self.dropped: list[weakref.ref[Any]] = []
        self.kept_outputs: list[Any] = []
        self.depth = 0  # > 0 inside a sub-module whose outputs are kept
        self.replaying = False
        self.recomputed = False
        self.on_recompute = on_recompute
        self._next_kept = 0

    # ---------------------------------------------------------------- the first forward
    def pack(self, tensor: Any) -> Any:
        item = self.pool.pack(tensor)
        if self.depth == 0:
            item.tensor, item.source = None, self
            self.dropped.append(weakref.ref(item))
        return item

    def unpack(self, item: Any) -> Any:
        return self.pool.unpack(item)

    def run_saved(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call of a sub-module chosen with ``save``: run and keep its outputs (first forward), or
        hand the kept outputs back without running it (re-run)."""
        if self.replaying:
            if self._next_kept >= len(self.kept_outputs):
                raise RuntimeError("the re-run of a checkpointed module called a saved sub-module more often "
                                   "than its forward did (non-deterministic control flow)")
            kept = self.kept_outputs[self._next_kept]
            self._next_kept += 1
            return self._restore(kept)
        self.depth += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            self.depth -= 1
        self.kept_outputs.append(map_tensors(self.ops, out, self._keep))
        return out

    def _keep(self, tensor: Any) -> _PackedRef:
        return _PackedRef(self.pool.pack(tensor), self.ops.requires_grad(tensor))

    def _restore(self, value: Any) -> Any:
        return _map_refs(value, lambda ref: self.ops.fresh(self.pool.unpack(ref.item), ref.requires_grad))

    # ---------------------------------------------------------------- the re-run
    def materialize(self, item: Any) -> None:
        if not self.recomputed:
            self.recompute()
        if item.tensor is None:
            raise RuntimeError("a checkpointed module's saved tensor was read after its backward freed it")

    def recompute(self) -> None:
        self.recomputed = True
        ops = self.ops
        args, kwargs = self._restore(self.inputs)
        targets = self.dropped
        count = 0

        def capture(tensor: Any) -> None:
            nonlocal count
            if count < len(targets):
                item = targets[count]()
                if item is not None and item.tensor is None:
                    item.tensor = ops.detach(tensor)
            count += 1
            return None

        def never(_: Any) -> Any:
            raise RuntimeError("the re-run of a checkpointed module is never differentiated")

        outer_rng = ops.get_rng_state() if self.rng is not None else None
        if self.rng is not None:
            ops.set_rng_state(self.rng)
        self.replaying, self._next_kept = True, 0
        try:
            with entered_region(self), recomputing(), ops.recording(), ops.hooks(capture, never):
                self.fn(*args, **kwargs)
        finally:
            self.replaying = False
            if outer_rng is not None:
                ops.set_rng_state(outer_rng)
        if count != len(targets):
            raise RuntimeError(
                f"the re-run of a checkpointed module saved {count} tensors where its forward saved "
                f"{len(targets)}: its forward must do the same operations every time it runs"
            )
        if self.on_recompute is not None:
            self.on_recompute()


def _map_refs(value: Any, fn: Callable[[_PackedRef], Any]) -> Any:
    if isinstance(value, _PackedRef):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_refs(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_refs(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map_refs(v, fn)) for k, v in value.items())
    return value
