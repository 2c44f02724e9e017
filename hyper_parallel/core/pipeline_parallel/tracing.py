"""`StepTracer`: what the runtime records of each step it runs (the format is in ``trace.py``).

Use from a runtime (one tracer per rank)::

    tracer.start(platform, group)            # every rank: a barrier, then t = 0 (when enabled)
    t0 = tracer.now()
    ...run the step...
    tracer.record(step, "compute", t0, tracer.now())
    records = tracer.gather(platform, group)   # every rank: all ranks' records, sorted

Disabled (the default) ``now`` returns 0.0 without reading a clock and ``record`` returns at
once: two method calls per step. ``step`` may be a `MetaStep` or its text; it is turned into
text only when the records are read, never on the hot path.

Clocks: each rank measures with ``time.perf_counter`` from the moment ``start`` returned; with
a platform, ``start`` first waits in a barrier of the group, so the ranks' origins differ by
the barrier's exit skew only (one process-local clock per rank: no clock is shared).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .trace import KINDS, Record, merge_records


class StepTracer:
    """Per-rank recorder of (step, kind, start, end); see the module docstring."""

    __slots__ = ("enabled", "rank", "_clock", "_origin", "_items")

    def __init__(self, enabled: bool = False, rank: int = 0, clock: Callable[[], float] = time.perf_counter) -> None:
        self.enabled = bool(enabled)
        self.rank = rank
        self._clock = clock
        self._origin = clock()
        self._items: list[tuple[Any, str, float, float]] = []

    def start(self, platform: Any = None, group: Any = None) -> None:
        """Forget earlier records and set time 0 (after a barrier of ``group`` when a platform
        is given). Does nothing when disabled, so it costs no communication then."""
        if not self.enabled:
            return
        if platform is not None:
            platform.barrier(group)
            self.rank = group.group_rank(platform.rank) if group is not None else platform.rank
        self._items.clear()
        self._origin = self._clock()

    def now(self) -> float:
        """Seconds since ``start`` (0.0 when disabled)."""
        if not self.enabled:
            return 0.0
        return self._clock() - self._origin

    def record(self, step: Any, kind: str, start: float, end: float) -> None:
        """Keep one record; ``kind`` is ``compute``, ``p2p-issue`` or ``p2p-wait``."""
        if self.enabled:
            self._items.append((step, kind, start, end))

    @contextmanager
    def span(self, step: Any, kind: str = "compute") -> Iterator[None]:
        """Record the time spent inside the ``with`` block."""
        if not self.enabled:
            yield
            return
        t0 = self.now()
        try:
            yield
        finally:
            self.record(step, kind, t0, self.now())

    def records(self) -> list[Record]:
        """This rank's records in the trace format (checked)."""
        out = []
        for step, kind, start, end in self._items:
            if kind not in KINDS:
                raise ValueError(f"step {step}: unknown record kind {kind!r}; valid: {', '.join(KINDS)}")
            out.append({"rank": self.rank, "step": str(step), "kind": kind, "start": start, "end": end})
        return out

    def gather(self, platform: Any, group: Any = None) -> list[Record]:
        """Every rank's records, merged and sorted (a collective: every rank of ``group`` calls
        it, each gets the whole list)."""
        mine = self.records() if self.enabled else []
        everyone = platform.all_gather_object(mine, group)
        return merge_records(everyone)
