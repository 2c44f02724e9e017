"""Auto-schedule: the fastest (schedule, chunks per rank, micro-batches) that fits in memory.

For a fixed number of pipeline ranks ``p`` and global batch ``N``, `tune` tries every
available schedule, every chunk count ``v`` the schedule accepts (among ``chunk_options``) and
every micro-batch count ``m`` that divides ``N``, and simulates each:

- stage costs: the cost model re-cut into ``p * v`` stages (`CostModel.for_stages`: its own
  stages when the count matches, balanced groups of its ``layers``, else an even split of the
  whole model), at micro-batch size ``N / m`` (`CostModel.for_micro_batch_size`, when the
  model says what size it was measured with; otherwise the times are used as they are);
- memory of a rank: ``state_factor * param_bytes`` of its stages (default 4: weights,
  gradients and two Adam moments of the same precision) plus its simulated peak activation
  bytes; a candidate fits when every rank stays within ``memory_limit``;
- the choice: the smallest simulated makespan among the fitting candidates (ties: less
  memory, then fewer micro-batches, fewer chunks, then the name).

With ``lowered``, each candidate is lowered as ``schedule.run(overlap_p2p=overlap_p2p)`` lowers it
(`runtime_costs.run_lowering`: receives posted ahead with ``overlap_p2p``, metadata for the first
micro-batch; on ``plain`` without runtime costs the cheaper lists without either, which give the
same times). With ``runtime`` costs in the cost model (a machine file of ``hyper-parallel
calibrate``) the runtime's own cost per step is charged too (``runtime_costs.py``).

Candidates a schedule cannot run (it rejects the counts, or the simulation finds a deadlock)
are listed with the reason.

With ``jobs`` above 1 the candidates are simulated in that many worker processes (each plans and
simulates whole candidates; the result is the same as one process's, in the same order). Each
worker holds one candidate's lists at a time: at p = 64, m = 1024 several hundred MiB.

With ``search`` the tuner also builds custom orders (`order_search.greedy_order`) for the looped
placement of every chunk count and for the V placement, with and without the dx/dW split, each
within the memory the rank has left after its weights; they appear as ``search-looped``,
``search-looped-zb``, ``search-v`` and ``search-v-zb`` (simulated lowered, like the library
schedules, when ``lowered``), and the chosen one's order is in
``Candidate.order`` (write it with `schedule_csv.save_schedule_csv`).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, chunk_range
from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel
from hyper_parallel.core.pipeline_parallel.simulation.runtime_costs import run_lowering
from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate_schedule
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError


@dataclass
class Candidate:
    """One simulated configuration."""

    schedule: str
    num_chunks: int
    num_microbatches: int
    micro_batch_size: int
    makespan_ms: float | None = None
    bubble_fraction: float | None = None
    peak_memory_bytes: float | None = None
    peak_activation_bytes: float | None = None
    fits: bool = False
    note: str = ""
    order: dict[int, list[Any]] | None = field(default=None, repr=False, compare=False)

    def sort_key(self) -> tuple:
        return (self.makespan_ms, self.peak_memory_bytes, self.num_microbatches, self.num_chunks, self.schedule)


@dataclass
class TuneResult:
    """The chosen candidate (None when nothing fits) and every candidate tried."""

    best: Candidate | None
    candidates: list[Candidate] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        def plain(c: Candidate) -> dict[str, Any]:
            data = asdict(c)
            data.pop("order")
            return data

        return {"best": plain(self.best) if self.best else None, "candidates": [plain(c) for c in self.candidates]}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def evaluate(
    schedule_class: Any, name: str, costs: CostModel, num_ranks: int, num_chunks: int, num_microbatches: int,
    global_batch: int, memory_limit: float, state_factor: float = 4.0, lowered: bool = False,
    transport: str = "plain", overlap_p2p: bool = True,
) -> Candidate:
    """Simulate one configuration (see the module docstring)."""
    size = global_batch // num_microbatches
    cand = Candidate(name, num_chunks, num_microbatches, size)
    try:
        scaled = costs.for_micro_batch_size(size) if costs.micro_batch_size else costs
        placement = schedule_class.stage_placement(num_ranks, num_chunks)
        stage_costs = scaled.for_stages(len(placement), allow_even_split=True)
        like_run = run_lowering(transport, costs.runtime is not None, overlap_p2p) if lowered else {}
        plan, result = simulate_schedule(schedule_class, num_ranks, num_chunks, num_microbatches, stage_costs,
                                         lowered=lowered, transport=transport, timelines=False, **like_run)
    except (ValueError, ScheduleError) as exc:
        cand.note = "not runnable: " + str(exc).splitlines()[0]
        return cand
    _fill(cand, result, plan.stage_to_rank, stage_costs, num_ranks, memory_limit, state_factor)
    cand.num_chunks = plan.num_chunks
    return cand


def _static_bytes(stage_to_rank: dict[int, int], stage_costs: CostModel, num_ranks: int,
                  state_factor: float) -> dict[int, float]:
    static = {r: 0.0 for r in range(num_ranks)}
    for stage, rank in stage_to_rank.items():
        static[rank] += state_factor * stage_costs.stages[stage].param_bytes
    return static


def _fill(cand: Candidate, result: Any, stage_to_rank: dict[int, int], stage_costs: CostModel, num_ranks: int,
          memory_limit: float, state_factor: float) -> None:
    static = _static_bytes(stage_to_rank, stage_costs, num_ranks, state_factor)
    memory = {r: static[r] + result.peak_activation_bytes.get(r, 0.0) for r in static}
    cand.makespan_ms = result.makespan
    cand.bubble_fraction = result.bubble_fraction
    cand.peak_memory_bytes = max(memory.values())
    cand.peak_activation_bytes = max(result.peak_activation_bytes.values(), default=0.0)
    cand.fits = cand.peak_memory_bytes <= memory_limit
    if not cand.fits:
        worst = max(memory, key=memory.get)
        cand.note = f"rank {worst} needs {memory[worst]:.4g} bytes > limit {memory_limit:.4g}"


def search_candidate(
    costs: CostModel, num_ranks: int, num_chunks: int, placement: str, split: bool, num_microbatches: int,
    global_batch: int, memory_limit: float, state_factor: float = 4.0, lowered: bool = False,
    transport: str = "plain", overlap_p2p: bool = True,
) -> Candidate:
    """A custom order from `order_search.greedy_order` for one configuration, simulated (lowered
    as `evaluate` lowers the library schedules, so that every candidate is compared alike)."""
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
    from hyper_parallel.core.pipeline_parallel.tools.order_search import greedy_order
    from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement, v_placement
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate

    size = global_batch // num_microbatches
    name = f"search-{placement}" + ("-zb" if split else "")
    cand = Candidate(name, num_chunks, num_microbatches, size)
    try:
        scaled = costs.for_micro_batch_size(size) if costs.micro_batch_size else costs
        stage_to_rank = v_placement(num_ranks) if placement == "v" else looped_placement(num_ranks, num_chunks)
        stage_costs = scaled.for_stages(len(stage_to_rank), allow_even_split=True)
        static = _static_bytes(stage_to_rank, stage_costs, num_ranks, state_factor)
        order = greedy_order(stage_to_rank, num_microbatches, stage_costs, memory_limit - max(static.values()), split)
        steps = order
        if lowered:
            steps = lower(order, stage_to_rank, transport,
                          **run_lowering(transport, costs.runtime is not None, overlap_p2p))
        result = simulate(steps, stage_to_rank, stage_costs, model="stream" if transport == "batch" else "eager",
                          timelines=False)
    except (ValueError, ScheduleError) as exc:
        cand.note = "not runnable: " + str(exc).splitlines()[0]
        return cand
    _fill(cand, result, stage_to_rank, stage_costs, num_ranks, memory_limit, state_factor)
    cand.order = order
    return cand


def tune(
    costs: CostModel,
    memory_limit: float,
    global_batch: int,
    num_ranks: int,
    *,
    schedules: dict[str, Any] | None = None,
    chunk_options: Sequence[int] = (1, 2, 3, 4),
    micro_batches: Sequence[int] | None = None,
    state_factor: float = 4.0,
    lowered: bool = False,
    transport: str = "plain",
    search: bool = False,
    jobs: int = 1,
    overlap_p2p: bool = True,
) -> TuneResult:
    """Try every candidate and pick the best (see the module docstring). ``micro_batches``
    restricts the micro-batch counts (each must divide ``global_batch``); ``jobs``: worker
    processes simulating candidates side by side (1: all in this process); ``overlap_p2p``: with
    ``lowered``, the lists of ``schedule.run()`` with that setting."""
    for name, value, low in (("global_batch", global_batch, 1), ("num_ranks", num_ranks, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not memory_limit > 0:
        raise ValueError(f"memory_limit must be > 0 bytes, got {memory_limit!r}")
    counts = divisors(global_batch) if micro_batches is None else sorted(set(micro_batches))
    for m in counts:
        if global_batch % m:
            raise ValueError(f"{m} micro-batches do not divide the global batch {global_batch}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    if not isinstance(overlap_p2p, bool):
        raise TypeError(f"overlap_p2p must be a bool, got {overlap_p2p!r}")
    schedules = available_schedules() if schedules is None else schedules
    tasks: list[tuple[Any, ...]] = []
    for name, cls in schedules.items():
        low, high = chunk_range(cls)
        for v in sorted({v for v in chunk_options if low <= v <= high}):
            for m in counts:
                tasks.append((evaluate, cls, name, costs, num_ranks, v, m, global_batch, memory_limit, state_factor,
                              lowered, transport, overlap_p2p))
    if search:
        shapes = [("looped", v) for v in sorted(set(chunk_options)) if v >= 1] + [("v", 2)]
        for placement, v in shapes:
            for split in (False, True):
                for m in counts:
                    tasks.append((search_candidate, costs, num_ranks, v, placement, split, m, global_batch,
                                  memory_limit, state_factor, lowered, transport, overlap_p2p))
    candidates = _run_all(tasks, jobs)
    fitting = [c for c in candidates if c.fits]
    best = min(fitting, key=Candidate.sort_key) if fitting else None
    candidates.sort(key=lambda c: (c.makespan_ms is None, not c.fits, c.makespan_ms or 0.0, c.schedule,
                                   c.num_chunks, c.num_microbatches))
    return TuneResult(best, candidates)


def _run_task(task: tuple[Any, ...]) -> Candidate:
    function, *arguments = task
    return function(*arguments)


def _run_in_worker(task: tuple[Any, ...]) -> Candidate:
    """A task in a worker process, which forgets the candidate's kept schedules afterwards (no later
    task there is the same candidate, and each would hold hundreds of MiB at p = 64, m = 1024) and
    collects what cycles it left: a worker forked while the collector was paused (the CLI pauses it)
    runs with it off."""
    from hyper_parallel.core.pipeline_parallel.lowering import plan_cache

    try:
        return _run_task(task)
    finally:
        plan_cache.clear()
        gc.collect()  # little is left alive between candidates: a short pass


def _run_all(tasks: list[tuple[Any, ...]], jobs: int) -> list[Candidate]:
    """Every task's candidate, in order; in ``jobs`` worker processes when there is more than one
    task, here otherwise, and here again where the workers fail: the tasks cannot be sent (a
    schedule class defined in a function), a worker cannot read them back (a class of a script's
    ``__main__`` where workers are spawned, not forked) or dies. A candidate's own error is raised
    from here then, as without workers."""
    jobs = min(jobs, len(tasks))
    if jobs > 1:
        try:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                return list(pool.map(_run_in_worker, tasks))
        except Exception:  # noqa: BLE001 - whatever went wrong there, the same tasks run here
            pass
    return [_run_task(task) for task in tasks]


def default_jobs(limit: int = 8) -> int:
    """Worker processes for the CLI: the CPUs this process may use, at most ``limit`` (each worker
    holds one candidate's lists)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    return max(1, min(limit, usable))


def format_table(result: TuneResult, limit: int | None = None) -> str:
    """The candidates as a text table, fastest fitting first; the choice marked ``*``."""
    header = f"  {'schedule':<18} {'v':>2} {'m':>4} {'mb':>4} {'makespan ms':>12} {'bubble':>7} " \
             f"{'peak memory':>12}  note"
    lines = [header]
    shown = result.candidates if limit is None else result.candidates[:limit]
    for c in shown:
        mark = "*" if c is result.best else " "
        span = f"{c.makespan_ms:12.4g}" if c.makespan_ms is not None else f"{'-':>12}"
        bubble = f"{c.bubble_fraction:7.1%}" if c.bubble_fraction is not None else f"{'-':>7}"
        memory = f"{_bytes(c.peak_memory_bytes):>12}" if c.peak_memory_bytes is not None else f"{'-':>12}"
        note = c.note or ("fits" if c.fits else "")
        lines.append(f"{mark} {c.schedule:<18} {c.num_chunks:>2} {c.num_microbatches:>4} {c.micro_batch_size:>4} "
                     f"{span} {bubble} {memory}  {note}")
    if limit is not None and len(result.candidates) > limit:
        lines.append(f"  ... {len(result.candidates) - limit} more (--json lists all)")
    return "\n".join(lines)


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.4g} {unit}" if unit != "B" else f"{value:.0f} B"
        value /= 1024
    return f"{value:.4g} TiB"
