"""Dry run: a user's training script with all its ranks as threads of one process (LocalCluster).

The script is the one a launcher (``torchrun`` / ``msrun``) would start once per rank: it asks
``hyper_parallel.get_platform()`` for its rank and world size and never initialises a process
group itself (the platform does that under a launcher; here every rank gets a LocalCluster
platform). It runs once per rank, as ``__main__``, with ``sys.argv = [script, *argv]``.

While it runs, the dry run watches (without changing what the script computes):

- every pipeline schedule object (``PipelineSchedule`` and subclasses): its placement, chunk
  and micro-batch counts, its lowered step lists (re-validated and simulated here);
- every point-to-point message: sender, receiver, shape, dtype and bytes (the stage boundary
  shapes);
- every stage forward/backward through the rank's platform: how many forwards are held and,
  where the backend can tell (torch), their saved activation bytes, over time;
- the runtime's step trace, when the schedule object offers one: a ``tracer`` attribute
  holding a `StepTracer` (``runtime/tracing.py``) is enabled before each ``run`` and read after it.
  Every rank's records count from one origin (the first traced run's time 0), later runs
  placed after it on the same clock. Until the runtime records steps, the trace is the
  simulated plan of what ran.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TRACE_ATTRIBUTE = "tracer"
"""The schedule attribute the dry run looks for: a `StepTracer` the runtime records into."""


@dataclass
class RankReport:
    """What one rank did."""

    rank: int
    messages: dict[tuple[int, int, str, tuple[int, ...]], list[int]] = field(default_factory=dict)
    live_forwards: int = 0
    peak_forwards: int = 0
    live_bytes: int = 0
    peak_bytes: int | None = 0
    schedules: list[dict[str, Any]] = field(default_factory=list)
    trace: list[dict[str, Any]] = field(default_factory=list)
    trace_origin_ns: int | None = None  # wall-clock time 0 of the first traced run (the trace's origin)
    result: Any = None


@dataclass
class DryRunReport:
    """Per-rank reports plus the schedule check of the first pipeline schedule that ran."""

    script: str
    world_size: int
    platform: str
    ranks: list[RankReport]
    check: dict[str, Any] = field(default_factory=dict)

    def trace_facts(self) -> dict[str, dict[int, Any]]:
        """What the watchers saw per rank, for a trace's ``otherData`` (`visualize.write_chrome_trace`):
        peak forwards held and their bytes; None for a rank where they saw no forward at all (its
        backend's stage calls went unwatched), so a viewer counts the peaks from the records instead."""
        seen = {r.rank: r.peak_forwards > 0 for r in self.ranks}
        return {"peak_activations": {r.rank: r.peak_forwards if seen[r.rank] else None for r in self.ranks},
                "peak_activation_bytes": {r.rank: r.peak_bytes if seen[r.rank] else None for r in self.ranks}}

    def boundaries(self) -> list[dict[str, Any]]:
        """Distinct messages: (src, dst, dtype, shape) with their count and bytes each."""
        rows = []
        for report in self.ranks:
            for (src, dst, dtype, shape), sizes in sorted(report.messages.items()):
                rows.append({"src": src, "dst": dst, "dtype": dtype, "shape": list(shape), "count": len(sizes),
                             "bytes": sizes[0]})
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "script": self.script, "world_size": self.world_size, "platform": self.platform,
            "boundaries": self.boundaries(),
            "ranks": [{"rank": r.rank, "peak_forwards_held": r.peak_forwards, "peak_activation_bytes": r.peak_bytes,
                       "schedules": [{k: v for k, v in f.items() if k not in ("id", "lowered")} for f in r.schedules]}
                      for r in self.ranks],
            "check": {k: v for k, v in self.check.items() if k != "plan"},
        }


class _Watch:
    """Wraps the methods of one rank's platform object to observe what it does."""

    def __init__(self, platform: Any, report: RankReport) -> None:
        from hyper_parallel.platform.memory import saved_activation_bytes

        self.platform = platform
        self.report = report
        self.saved = saved_activation_bytes
        self.held: dict[int, int] = {}
        for name in ("stage_forward", "stage_backward", "stage_backward_input", "stage_backward_weight", "isend",
                     "batch_isend_irecv"):
            setattr(platform, name, self._wrap(name, getattr(platform, name)))

    def _wrap(self, name: str, original: Any) -> Any:
        handler = getattr(self, f"_on_{name}")

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return handler(original, *args, **kwargs)

        return wrapper

    def _message(self, tensor: Any, dst: int) -> None:
        p = self.platform
        if not p.is_tensor(tensor):
            return
        from hyper_parallel.platform.memory import tensor_bytes

        key = (p.rank, dst, p.dtype_name(tensor), tuple(p.shape(tensor)))
        self.report.messages.setdefault(key, []).append(tensor_bytes(p, tensor))

    def _on_isend(self, original: Any, tensor: Any, dst: int, *args: Any, **kwargs: Any) -> Any:
        self._message(tensor, dst)
        return original(tensor, dst, *args, **kwargs)

    def _on_batch_isend_irecv(self, original: Any, ops: Sequence[Any]) -> Any:
        for op in ops:
            if getattr(op, "op", None) == "isend":
                self._message(op.tensor, op.peer)
        return original(ops)

    def _on_stage_forward(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        record = original(*args, **kwargs)
        saved = self.saved(self.platform, record)
        r = self.report
        r.live_forwards += 1
        r.peak_forwards = max(r.peak_forwards, r.live_forwards)
        if saved is None:
            r.peak_bytes = None
        elif r.peak_bytes is not None:
            self.held[id(record)] = saved
            r.live_bytes += saved
            r.peak_bytes = max(r.peak_bytes, r.live_bytes)
        return record

    def _release(self, record: Any) -> None:
        self.report.live_forwards -= 1
        self.report.live_bytes -= self.held.pop(id(record), 0)

    def _on_stage_backward(self, original: Any, record: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(record, *args, **kwargs)
        self._release(record)
        return out

    def _on_stage_backward_input(self, original: Any, record: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(record, *args, **kwargs)
        if id(record) in self.held:
            after = self.saved(self.platform, record) or 0
            self.report.live_bytes -= self.held[id(record)] - after
            self.held[id(record)] = after
        return out

    def _on_stage_backward_weight(self, original: Any, record: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(record, *args, **kwargs)
        self._release(record)
        return out


def _schedule_facts(schedule: Any) -> dict[str, Any]:
    facts = {"class": type(schedule).__name__}
    for name in ("micro_batch_num", "num_ranks", "p2p_transport", "peak_activations"):
        if hasattr(schedule, name):
            facts[name] = getattr(schedule, name)
    placement = getattr(schedule, "stage_to_pp_rank", None)
    if placement is not None:
        facts["stage_to_rank"] = dict(placement)
    order = getattr(schedule, "exec_order", None)
    if order is not None:
        facts["lowered"] = {r: [str(s) for s in steps if s is not None] for r, steps in order.items()}
    return facts


def _install_schedule_hooks(reports: dict[int, RankReport]) -> Any:
    from hyper_parallel.core.pipeline_parallel.schedule import PipelineSchedule
    from hyper_parallel.core.pipeline_parallel.runtime.tracing import StepTracer
    from hyper_parallel.platform import get_platform

    original_run = PipelineSchedule.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        report = reports[get_platform().rank]
        tracer = getattr(self, TRACE_ATTRIBUTE, None)
        if isinstance(tracer, StepTracer):
            tracer.enabled = True
        out = original_run(self, *args, **kwargs)
        facts = next((f for f in report.schedules if f["id"] == id(self)), None)
        if facts is None:
            facts = {"id": id(self), "runs": 0, **_schedule_facts(self)}
            report.schedules.append(facts)
        facts["runs"] += 1
        facts["peak_activations"] = max(facts.get("peak_activations", 0), getattr(self, "peak_activations", 0))
        if isinstance(tracer, StepTracer):
            records = tracer.records()
            if report.trace_origin_ns is None:
                report.trace_origin_ns = tracer.origin_ns
            shift = (tracer.origin_ns - report.trace_origin_ns) * 1e-9  # later runs after the first, on one clock
            report.trace += [{**r, "start": r["start"] + shift, "end": r["end"] + shift} for r in records]
            facts["traced_steps"] = facts.get("traced_steps", 0) + len(records)
        return out

    PipelineSchedule.run = run

    def restore() -> None:
        PipelineSchedule.run = original_run

    return restore


_LOCK = threading.Lock()


def dry_run(script: str, world_size: int, platform: str = "torch", argv: Sequence[str] = (),
            timeout: float | None = None) -> DryRunReport:
    """Run ``script`` on ``world_size`` LocalCluster ranks and report (see the module docstring)."""
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.local import LocalCluster

    if not os.path.isfile(script):
        raise ValueError(f"no such script: {script}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    reports = {rank: RankReport(rank) for rank in range(world_size)}

    def body() -> Any:
        plat = get_platform()
        _Watch(plat, reports[plat.rank])
        namespace = runpy.run_path(script, run_name="__main__")
        return namespace.get("RESULT")

    with _LOCK:  # the hooks are process-wide
        saved_argv = sys.argv
        sys.argv = [script, *argv]
        restore = _install_schedule_hooks(reports)
        try:
            kwargs = {"timeout": timeout} if timeout is not None else {}
            results = LocalCluster(world_size, platform=platform, **kwargs).run(body)
        finally:
            restore()
            sys.argv = saved_argv
    for rank, result in enumerate(results):
        reports[rank].result = result
    report = DryRunReport(script, world_size, platform, [reports[r] for r in range(world_size)])
    report.check = check_schedules(report)
    return report


def check_schedules(report: DryRunReport) -> dict[str, Any]:
    """Validate and simulate the lowered lists of the first schedule every rank ran."""
    from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate
    from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError, validate_lowered

    firsts = [r.schedules[0] for r in report.ranks if r.schedules]
    if not firsts:
        return {"status": "no pipeline schedule ran"}
    facts = firsts[0]
    if "lowered" not in facts or "stage_to_rank" not in facts:
        return {"status": "the schedule object does not expose exec_order / stage_to_pp_rank", "class": facts["class"]}
    lowered = {int(r): [MetaStep.from_str(s) for s in steps] for r, steps in facts["lowered"].items()}
    placement = {int(s): int(r) for s, r in facts["stage_to_rank"].items()}
    transport = facts.get("p2p_transport", "plain")
    out: dict[str, Any] = {"class": facts["class"], "micro_batch_num": facts.get("micro_batch_num"),
                           "transport": transport}
    try:
        validate_lowered(lowered, placement, facts["micro_batch_num"], transport)
        result = simulate(lowered, placement, model="stream" if transport == "batch" else "eager")
    except (ScheduleError, ValueError) as exc:
        out["status"] = "invalid"
        out["error"] = str(exc)
        return out
    out["status"] = "ok"
    out["simulated"] = result.summary()
    out["plan"] = result
    counts: dict[int, int] = defaultdict(int)
    for r in report.ranks:
        for f in r.schedules[:1]:
            counts[r.rank] = f.get("peak_activations", 0)
    out["peak_forwards_planned"] = result.peak_activations
    out["peak_forwards_runtime"] = dict(counts)
    return out
