"""The saved-tensor features of one platform instance: wrappers, schedule-driven swap, accounting.

``Platform.saved_tensors()`` returns one :class:`SavedTensorSupport` per platform object (so per
rank on a LocalCluster); the framework-specific part is its :class:`FrameworkOps`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hyper_parallel.platform.activations.ops import CopyEngine, FrameworkOps
from hyper_parallel.platform.activations.regions import CheckpointRegion, SwapRegion, tensors_in
from hyper_parallel.platform.activations.state import (
    active_pool,
    current_pool,
    current_region,
    entered_region,
    is_recomputing,
    live_items,
)
from hyper_parallel.platform.activations.swap import SwapGroup, select_swappable
from hyper_parallel.platform.activations.tracker import SavedTracker

_MARK = "_hyper_parallel_activation_wrapper"
SaveSpec = Iterable[str] | Callable[[str, Any], bool] | None


class SavedTensorSupport:
    def __init__(self, ops: FrameworkOps) -> None:
        self.ops = ops
        self._engine: CopyEngine | None = None
        self.tracker: SavedTracker | None = None
        self.capture = False  # MindSpore: pack stage forwards even without a wrapper (swap, tracking)
        self._deferred: list[SwapGroup] = []  # wrapper offloads still in flight (devices with streams)

    @property
    def engine(self) -> CopyEngine:
        if self._engine is None:
            self._engine = self.ops.copy_engine()
        return self._engine

    is_recomputing = staticmethod(is_recomputing)

    # ---------------------------------------------------------------- wrappers
    def swap_wrapper(self, module: Any) -> Any:
        ops = self.ops
        original = self._claim(module, "swap_wrapper")

        def forward(*args: Any, **kwargs: Any) -> Any:
            if current_region() is not None or not ops.grad_recording():
                return original(*args, **kwargs)
            pool, own = self._pool()
            region = SwapRegion(pool)
            with entered_region(region), ops.hooks(region.pack, region.unpack), _maybe(own, pool):
                out = original(*args, **kwargs)
            self._finish_deferred()
            group = region.group(ops, self.engine, (args, kwargs, ops.persistent_tensors(module)), out)
            if group is not None:
                group.launch_offload()
                if self.engine.asynchronous:
                    self._deferred.append(group)
                else:
                    group.finish_offload()
                if self.tracker is not None:
                    self.tracker.add_group(group)
                for t in tensors_in(ops, out):
                    ops.on_grad(t, lambda g=group: self._bring_back(g))
            return out

        ops.set_forward(module, forward)
        return module

    def checkpoint_wrapper(self, module: Any, save: SaveSpec = None, preserve_rng: bool = True) -> Any:
        ops = self.ops
        saved = self._saved_modules(module, save)
        original = self._claim(module, "checkpoint_wrapper")
        saved_ids = frozenset(id(m) for _, m in saved)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if current_region() is not None or not ops.grad_recording():
                return original(*args, **kwargs)
            pool, own = self._pool()
            region = CheckpointRegion(ops, pool, module, original, args, kwargs, saved_ids, preserve_rng,
                                      on_recompute=self.sample)
            with entered_region(region), ops.hooks(region.pack, region.unpack), _maybe(own, pool):
                return original(*args, **kwargs)

        for _, sub in saved:
            self._keep_outputs_of(module, sub)
        ops.set_forward(module, forward)
        return module

    def wrapped_modules(self, module: Any) -> list[tuple[str, str]]:
        """``(dotted name, wrapper)`` of every module in ``module`` (itself named ``""``) that
        :meth:`swap_wrapper` or :meth:`checkpoint_wrapper` wrapped."""
        if not self.ops.is_module(module):
            return []
        return [(name, getattr(m, _MARK)) for name, m in self.ops.named_modules(module)
                if getattr(m, _MARK, None) is not None]

    def _claim(self, module: Any, what: str) -> Callable[..., Any]:
        if not self.ops.is_module(module):
            raise TypeError(f"{what} needs a {self.ops.name} module, got {type(module).__name__}")
        if getattr(module, _MARK, None) is not None:
            raise ValueError(f"{type(module).__name__} is already wrapped by {getattr(module, _MARK)}")
        original = self.ops.forward_of(module)
        object.__setattr__(module, _MARK, what)
        return original

    def _saved_modules(self, module: Any, save: SaveSpec) -> list[tuple[str, Any]]:
        if save is None:
            return []
        subs = [(n, m) for n, m in self.ops.named_modules(module) if n]
        if callable(save):
            return [(n, m) for n, m in subs if save(n, m)]
        if isinstance(save, str):
            save = [save]
        chosen: dict[int, tuple[str, Any]] = {}
        for pattern in save:
            if not isinstance(pattern, str):
                raise TypeError(f"save= takes sub-module names (glob patterns) or a predicate, got {pattern!r}")
            found = [(n, m) for n, m in subs if fnmatch.fnmatchcase(n, pattern)]
            if not found:
                names = ", ".join(n for n, _ in subs) or "none"
                raise ValueError(f"save={pattern!r} matches no sub-module of {type(module).__name__} "
                                 f"(sub-modules: {names})")
            for n, m in found:
                chosen.setdefault(id(m), (n, m))
        return list(chosen.values())

    def _keep_outputs_of(self, owner: Any, sub: Any) -> None:
        ops = self.ops
        original = ops.forward_of(sub)

        def forward(*args: Any, **kwargs: Any) -> Any:
            region = current_region()
            if isinstance(region, CheckpointRegion) and region.owner is owner and id(sub) in region.saved:
                return region.run_saved(original, args, kwargs)
            return original(*args, **kwargs)

        ops.set_forward(sub, forward)

    def _pool(self) -> tuple[Any, bool]:
        pool = current_pool()
        return (pool, False) if pool is not None else (self.ops.new_pool(), True)

    def _finish_deferred(self) -> None:
        for group in self._deferred:
            if group.state == "offloading":
                group.finish_offload()
        self._deferred = []

    def _bring_back(self, group: SwapGroup) -> None:
        """The gradient reached a swap-wrapped module's outputs: start loading what it saved."""
        if group.state == "offloading":
            group.finish_offload()
        if group.state == "offloaded":
            group.launch_load()
            self.sample()

    # ---------------------------------------------------------------- schedule-driven swap
    def offload(self, record: Any) -> SwapGroup | None:
        """Launch the offload of what the forward of ``record`` saved (its outputs, inputs and the
        parameters stay); None when nothing can be swapped."""
        pool = self.ops.pool_of(record)
        if pool is None:
            return None
        held = (*record.outputs, *record.params, *self.ops.record_inputs(record))
        keep = {self.ops.storage_key(t) for t in held if self.ops.is_tensor(t)}
        items = select_swappable(self.ops, live_items(pool), keep)
        if not items:
            return None
        group = SwapGroup(self.ops, self.engine, items)
        group.launch_offload()
        if self.tracker is not None:
            self.tracker.add_group(group)
        return group

    def finish_offload(self, group: SwapGroup) -> None:
        group.finish_offload()

    def load(self, group: SwapGroup) -> None:
        if group.state == "offloading":  # the backward came before the offload was waited
            group.finish_offload()
        if group.state == "offloaded":
            group.launch_load()
        self.sample()

    def finish_load(self, group: SwapGroup) -> None:
        if group.state == "offloaded":
            group.launch_load()
        if group.state == "loading":
            group.finish_load()

    # ---------------------------------------------------------------- accounting
    def start_tracking(self, modules: Sequence[Any], records: Callable[[], list[Any]] | None = None) -> None:
        """Measure from now on; ``modules``' parameters and buffers are not activations;
        ``records()`` lists the live forward records (their outputs are sampled too)."""
        exclude = {self.ops.storage_key(t) for m in modules for t in self.ops.persistent_tensors(m)}

        def outputs(new: Any) -> int:
            live = list(records()) if records is not None else []
            if new is not None and all(r is not new for r in live):
                live.append(new)
            return self._output_bytes(live)

        self.tracker = SavedTracker(self.ops, exclude, outputs)
        self.capture = True

    def _output_bytes(self, records: list[Any]) -> int:
        seen: set[int] = set()
        total = 0
        for record in records:
            for t in record.outputs:
                if self.ops.is_tensor(t):
                    key = self.ops.storage_key(t)
                    nbytes = self.ops.storage_nbytes(t)
                    if nbytes and key not in seen:
                        seen.add(key)
                        total += nbytes
        return total

    def stop_tracking(self) -> SavedTracker | None:
        tracker, self.tracker, self.capture = self.tracker, None, False
        return tracker

    def after_forward(self, record: Any) -> None:
        """Called by the platform after every stage forward."""
        self._finish_deferred()
        if self.tracker is not None:
            self.tracker.add_pool(self.ops.pool_of(record))
            self.tracker.sample(record)

    def sample(self) -> None:
        if self.tracker is not None:
            self.tracker.sample()


class _maybe:
    """``active_pool(pool)`` when ``own`` (a wrapped module run outside any stage forward)."""

    def __init__(self, own: bool, pool: Any) -> None:
        self._cm = active_pool(pool) if own else None

    def __enter__(self) -> None:
        if self._cm is not None:
            self._cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)
