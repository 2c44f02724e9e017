"""`StepTracer`: what the runtime records of each step it runs (the format is in ``trace.py``).

Use from a runtime (one tracer per rank)::

    tracer.start(platform, group)            # every rank: agree on t = 0 (when enabled)
    t0 = tracer.now()
    ...run the step...
    tracer.record(step, "compute", t0, tracer.now())
    records = tracer.gather(platform, group)   # every rank: all ranks' records, sorted

Disabled (the default) ``now`` returns 0.0 without reading a clock and ``record`` returns at
once: two method calls per step. ``step`` may be a `MetaStep` or its text; it is turned into
text only when the records are read, never on the hot path.

Clocks: each rank measures with ``time.perf_counter`` (its own monotonic clock). With a
platform, ``start`` pins that clock to the wall clock (``time.time_ns``: one clock for every
process of a host, read in integer nanoseconds so that no float rounding of the epoch time
enters) and the ranks exchange these anchors in one ``all_gather_object``; time 0 is
the earliest rank's anchor, and every rank counts from that same instant. A barrier would not
do: a rank that wakes from it late (a busy machine, the GIL of LocalCluster) would start its
clock late and its records would shift against its peers'. ``clock_error`` says how exact the
alignment is: the largest disagreement between two ranks' origins that the reading of the
anchors allows (microseconds on one host). Ranks on different hosts also differ by their
hosts' wall-clock offset (NTP: typically well under a millisecond; PTP: microseconds), which
no anchor can see.

Compute records start when the step's input is in hand: the runtime waits for a received input
inside the step, and that wait is its own ``p2p-wait`` record, so ``records`` moves the start
of a compute record past the waits nested in it that feed its (first) part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep
from hyper_parallel.core.pipeline_parallel.ir.trace_records import KINDS, Record, merge_records

_ANCHOR_READS = 5  # pairs of wall-clock reads around one monotonic read; the tightest is kept


class StepTracer:
    """Per-rank recorder of (step, kind, start, end); see the module docstring."""

    __slots__ = ("enabled", "rank", "origin_ns", "clock_error", "_clock", "_wall", "_origin", "_items")

    def __init__(self, enabled: bool = False, rank: int = 0, clock: Callable[[], float] = time.perf_counter,
                 wall_clock: Callable[[], int] = time.time_ns) -> None:
        self.enabled = bool(enabled)
        self.rank = rank
        self._clock = clock
        self._wall = wall_clock
        self._origin = clock()
        self.origin_ns = 0
        """Time 0 of the last ``start`` on the wall clock (nanoseconds since the epoch; 0 before any
        ``start`` with a platform): the same on every rank of a run."""
        self.clock_error = 0.0
        """Seconds: how far two ranks' time 0 may differ from the reading of their anchors (one host)."""
        self._items: list[tuple[Any, str, float, float]] = []

    def start(self, platform: Any = None, group: Any = None) -> None:
        """Forget earlier records and set time 0: with a platform, the same instant on every rank
        of ``group`` (a collective: every rank calls it; see the module docstring). Does nothing
        when disabled, so it costs no communication then."""
        if not self.enabled:
            return
        self._items.clear()
        if platform is None:
            self._origin = self._clock()
            return
        self.rank = group.group_rank(platform.rank) if group is not None else platform.rank
        wall, mono, error = self._anchor()
        anchors = platform.all_gather_object((wall, error), group)
        self.origin_ns = min(w for w, _ in anchors)
        errors = sorted(e for _, e in anchors)
        self.clock_error = errors[-1] + (errors[-2] if len(errors) > 1 else 0.0)
        self._origin = mono - (wall - self.origin_ns) * 1e-9

    def _anchor(self) -> tuple[int, float, float]:
        """(wall time in ns, monotonic time in s, error in s): one monotonic read between two
        wall-clock reads, the tightest pair of several; the wall time is their midpoint, the
        error half their gap plus the wall clock's resolution."""
        wall, clock = self._wall, self._clock
        best = (0, 0.0, -1)
        for _ in range(_ANCHOR_READS):
            before = wall()
            mono = clock()
            after = wall()
            if best[2] < 0 or after - before < best[2]:
                best = ((before + after) // 2, mono, after - before)
        resolution = time.get_clock_info("time").resolution if wall is time.time_ns else 0.0
        return best[0], best[1], best[2] * 0.5e-9 + resolution

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
        """This rank's records in the trace format (checked); compute records start when their
        input was in hand (see the module docstring)."""
        out = []
        waits: list[Record] = []  # p2p-wait records since the last other record: nested in the next step
        for step, kind, start, end in self._items:
            if kind not in KINDS:
                raise ValueError(f"step {step}: unknown record kind {kind!r}; valid: {', '.join(KINDS)}")
            record = {"rank": self.rank, "step": str(step), "kind": kind, "start": start, "end": end}
            if kind == "p2p-wait":
                waits.append(record)
            else:
                if kind == "compute" and waits:
                    record["start"] = _input_ready(step, start, end, waits)
                waits = []
            out.append(record)
        return out

    def gather(self, platform: Any, group: Any = None) -> list[Record]:
        """Every rank's records, merged and sorted (a collective: every rank of ``group`` calls
        it, each gets the whole list)."""
        mine = self.records() if self.enabled else []
        everyone = platform.all_gather_object(mine, group)
        return merge_records(everyone)


def _input_ready(step: Any, start: float, end: float, waits: list[Record]) -> float:
    """When the first part of a compute step had its input: the end of the last of ``waits``
    inside [start, end] that received for that part (same stage and micro-batch), else ``start``."""
    if not isinstance(step, MetaStep):
        try:
            step = MetaStep.from_str(str(step))
        except ValueError:
            return start
    parts = step.parts
    if not parts:
        return start
    first = (parts[0].stage_index, parts[0].micro_index)
    ready = start
    for wait in waits:
        if start <= wait["start"] and wait["end"] <= end:
            try:
                received = MetaStep.from_str(wait["step"])
            except ValueError:
                continue
            if (received.stage_index, received.micro_index) == first:
                ready = max(ready, wait["end"])
    return ready
