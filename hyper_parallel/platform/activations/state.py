"""Per-thread state of the saved-tensor machinery (framework-neutral, no tensor library imported).

* the *pool* of the stage forward in progress: every tensor the forward saves for its backward is
  packed into one item of it (torch: ``platform/torch/autograd.py``; MindSpore: :class:`SavedPool`);
* the *region* a wrapped module opened (a swap or a recompute region, see ``regions.py``);
* whether a recompute re-run is in progress (:func:`is_recomputing`).

A packed item holds its tensor in ``item.tensor``. While the data is elsewhere (on the host after a
swap, or dropped until a recompute), ``item.tensor`` is ``None`` and ``item.source`` is the object
whose ``materialize(item)`` puts it back; a pool's ``unpack`` calls it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

_local = threading.local()


class SavedItem:
    """One saved tensor as packed by a :class:`SavedPool` (the torch pool packs the same fields)."""

    __slots__ = ("tensor", "dx_only", "source", "__weakref__")

    def __init__(self, tensor: Any) -> None:
        self.tensor: Any = tensor
        self.dx_only = False
        self.source: Any = None


class SavedPool:
    """Packs what one forward saves (MindSpore stage forwards, and wrapped modules run outside any
    stage forward). Keeps weak references to its items for swap and memory accounting."""

    def __init__(self) -> None:
        self.items: list[weakref.ref[SavedItem]] = []
        self.dropping = False

    def pack(self, tensor: Any) -> SavedItem:
        item = SavedItem(tensor)
        self.items.append(weakref.ref(item))
        return item

    def unpack(self, item: SavedItem) -> Any:
        if item.tensor is None and item.source is not None:
            item.source.materialize(item)
        if item.tensor is None:
            raise RuntimeError("a saved tensor was read after its backward freed it")
        return item.tensor


def live_items(pool: Any) -> Iterator[Any]:
    """The items of ``pool`` still referenced by a graph."""
    for ref in pool.items:
        item = ref()
        if item is not None:
            yield item


def current_pool() -> Any:
    """The pool of the stage forward (or standalone wrapped module) running on this thread, or None."""
    stack = getattr(_local, "pools", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def active_pool(pool: Any) -> Iterator[Any]:
    """Make ``pool`` the current pool of this thread while the block runs."""
    stack = _local.__dict__.setdefault("pools", [])
    stack.append(pool)
    try:
        yield pool
    finally:
        stack.pop()


def current_region() -> Any:
    """The swap / recompute region open on this thread (the outermost wrapped module), or None."""
    return getattr(_local, "region", None)


@contextlib.contextmanager
def entered_region(region: Any) -> Iterator[Any]:
    previous = getattr(_local, "region", None)
    _local.region = region
    try:
        yield region
    finally:
        _local.region = previous


def is_recomputing() -> bool:
    """True while a checkpointed module's forward is re-run for its backward, on this thread.

    Forward hooks of the modules inside a checkpointed module fire again during that re-run; a
    hook that must run once per forward (a communication hook, a counter) returns early when this
    is True. Backward hooks fire once: the re-run's own graph is never differentiated.
    """
    return getattr(_local, "recomputing", 0) > 0


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    _local.recomputing = getattr(_local, "recomputing", 0) + 1
    try:
        yield
    finally:
        _local.recomputing -= 1
