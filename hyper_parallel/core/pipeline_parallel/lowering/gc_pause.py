"""Planning without the cyclic garbage collector.

Lowering and validation of a large job make millions of small objects that all stay alive
until the planning ends; Python's collector would scan them again and again while they are
made (about half of the planning time at p = 16, v = 4, m = 128). Planning makes no garbage
cycles that outlive it (the job model breaks the links between its operations and groups when
a run ends), so the collector is paused for its duration and resumed by the last planner to
leave (threads of one process may plan at the same time).

A process forked while threads plan (a data loader's workers) holds only the forking thread:
its planners are the only ones left there, so the child resumes the collector once they are done
(at once when the forking thread was not planning).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_DEPTH = 0
_RESUME = False  # whether the collector was on when the first planner came in
_MINE = threading.local()  # depth: the planners of this thread (what survives a fork)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic collector for the body (nested and threaded use are fine)."""
    global _DEPTH, _RESUME
    with _LOCK:
        if _DEPTH == 0:
            _RESUME = gc.isenabled()
            gc.disable()
        _DEPTH += 1
        _MINE.depth = getattr(_MINE, "depth", 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            _MINE.depth -= 1
            if _DEPTH == 0 and _RESUME:
                gc.enable()


def _after_fork_in_child() -> None:
    global _LOCK, _DEPTH
    _LOCK = threading.Lock()  # another thread may have held it at the fork
    if _DEPTH == 0:
        return
    _DEPTH = getattr(_MINE, "depth", 0)
    if _DEPTH == 0 and _RESUME:
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
