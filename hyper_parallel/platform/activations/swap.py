"""Swap groups: saved tensors moved to host memory and back as one unit of work.

A group owns a set of packed items (a stage forward's, or a swap-wrapped module call's). Items
whose tensors share memory are copied once (a *unit*: the whole storage on torch). Lifecycle:

``resident`` --launch_offload--> ``offloading`` --finish_offload--> ``offloaded``
--launch_load--> ``loading`` --finish_load--> ``resident``

While ``offloading`` the items still hold their device tensors (the copy reads them); at
``finish_offload`` they drop them (``item.tensor = None``, ``item.source = group``), which frees
the device memory unless something else holds it. A backward that reads an item of an offloaded
group loads the group at once (:meth:`SwapGroup.materialize`): correct, but not overlapped, and
counted in ``late_loads``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.platform.activations.ops import FrameworkOps


@dataclass
class _Unit:
    device: Any  # the device unit while resident / offloading; None once offloaded
    nbytes: int
    items: list[tuple[weakref.ref[Any], Any]] = field(default_factory=list)  # (item, meta)
    host: Any = None


def select_swappable(ops: FrameworkOps, items: Iterable[Any], keep: set[int]) -> list[Any]:
    """The resident items that may be swapped: produced by a recorded operation, in no other group,
    and whose storage is not in ``keep`` (parameters, stage or module outputs) nor shared with an
    item that may not be swapped."""
    by_storage: dict[int, list[Any]] = {}
    blocked: set[int] = set(keep)
    for item in items:
        t = item.tensor
        if t is None or not ops.is_tensor(t):
            continue
        key = ops.storage_key(t)
        if item.source is not None or not ops.computed(t) or ops.storage_nbytes(t) == 0:
            blocked.add(key)
            continue
        by_storage.setdefault(key, []).append(item)
    return [item for key, group in by_storage.items() if key not in blocked for item in group]


class SwapGroup:
    """Saved tensors of one forward (or one module call) moved to the host and back."""

    def __init__(self, ops: FrameworkOps, engine: Any, items: list[Any]) -> None:
        self.ops = ops
        self.engine = engine
        self.state = "resident"
        self.late_loads = 0
        self._units: dict[Any, _Unit] = {}
        for item in items:
            key, unit, meta = ops.unit_of(item.tensor)
            entry = self._units.get(key)
            if entry is None:
                entry = self._units[key] = _Unit(unit, ops.unit_nbytes(unit))
            entry.items.append((weakref.ref(item), meta))
        self.nbytes = sum(u.nbytes for u in self._units.values())
        self._pending: Any = None

    def __len__(self) -> int:
        return len(self._units)

    @property
    def inflight_bytes(self) -> int:
        """Device bytes the group holds outside its items (a load not finished yet)."""
        return self.nbytes if self.state == "loading" else 0

    def _expect(self, *states: str) -> None:
        if self.state not in states:
            raise RuntimeError(f"swap group is {self.state}, expected {' or '.join(states)}")

    def launch_offload(self) -> None:
        self._expect("resident")
        units = list(self._units.values())
        self._pending = self.engine.launch_offload([u.device for u in units])
        self.state = "offloading"

    def finish_offload(self) -> None:
        self._expect("offloading")
        units = list(self._units.values())
        hosts = self.engine.finish_offload(self._pending)
        self._pending = None
        for unit, host in zip(units, hosts, strict=True):
            unit.host, unit.device = host, None
            for ref, _ in unit.items:
                item = ref()
                if item is not None:
                    item.tensor, item.source = None, self
        self.state = "offloaded"

    def launch_load(self) -> None:
        self._expect("offloaded")
        units = list(self._units.values())
        self._pending = self.engine.launch_load([u.host for u in units])
        self.state = "loading"

    def finish_load(self) -> None:
        self._expect("loading")
        units = list(self._units.values())
        devices = self.engine.finish_load(self._pending)
        self._pending = None
        for unit, device in zip(units, devices, strict=True):
            unit.host = None
            for ref, meta in unit.items:
                item = ref()
                if item is not None and item.source is self:
                    item.tensor, item.source = self.ops.rebuild(device, meta), None
        self._units.clear()  # the items hold their tensors again; nothing else to keep
        self.state = "resident"

    def materialize(self, item: Any) -> None:
        """A backward reads ``item``: finish whatever brings the group back."""
        if self.state == "offloaded":
            self.late_loads += 1
            self.launch_load()
        if self.state == "loading":
            self.finish_load()
        if item.tensor is None:
            raise RuntimeError("a swapped tensor could not be restored")
