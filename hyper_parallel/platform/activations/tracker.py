"""Memory accounting of saved activations, read from the packed items (not from an allocator).

``resident_bytes`` is the size of the distinct storages that saved items of tracked forwards hold
on the compute device now (parameters and buffers excluded; an offloaded item holds nothing; a
load in flight counts), plus nothing else. The tracker samples it after every stage forward,
every recompute and every swap load (the only moments it can grow), and keeps the peak; an
optional ``output_sampler`` is sampled at the same moments (the schedule's un-released outputs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from hyper_parallel.platform.activations.ops import FrameworkOps
from hyper_parallel.platform.activations.state import live_items


class SavedTracker:
    def __init__(self, ops: FrameworkOps, exclude: set[int],
                 output_sampler: Callable[[Any], int] | None = None) -> None:
        self.ops = ops
        self.exclude = exclude
        self.output_sampler = output_sampler
        self._pools: list[weakref.ref[Any]] = []
        self._groups: list[weakref.ref[Any]] = []
        self.peak_saved_bytes = 0
        self.peak_output_bytes = 0
        self.samples = 0

    def add_pool(self, pool: Any) -> None:
        if pool is not None and not any(ref() is pool for ref in self._pools):
            self._pools.append(weakref.ref(pool))

    def add_group(self, group: Any) -> None:
        self._groups.append(weakref.ref(group))

    def resident_bytes(self) -> int:
        ops = self.ops
        seen: set[int] = set()
        total = 0
        pools = []
        for ref in self._pools:
            pool = ref()
            if pool is not None:
                pools.append(ref)
                for item in live_items(pool):
                    t = item.tensor
                    if t is None or not ops.is_tensor(t):
                        continue
                    key = ops.storage_key(t)
                    if key in seen or key in self.exclude:
                        continue
                    seen.add(key)
                    total += ops.storage_nbytes(t)
        self._pools = pools
        self._groups = [ref for ref in self._groups if ref() is not None]
        return total + sum(ref().inflight_bytes for ref in self._groups if ref() is not None)

    def sample(self, record: Any = None) -> None:
        self.samples += 1
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.resident_bytes())
        if self.output_sampler is not None:
            self.peak_output_bytes = max(self.peak_output_bytes, self.output_sampler(record))
