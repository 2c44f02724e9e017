"""A pipeline of sleep-cost stages on this rank, and timing of its training steps.

Used by ``hyper-parallel calibrate`` (its own workload) and by ``benchmarks/fidelity.py``: one
rank's share of the model sleeps ``fwd_ms`` in its forward and ``bwd_ms`` in its backward
(``I = W = bwd_ms / 2`` for the schedules that split it); a rank holding ``v`` chunks gives each
``1 / v`` of that. Runs in a process of a multi-process job (``torchrun``, `launch_local`) with
the torch platform.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hyper_parallel.core.pipeline_parallel.tools.catalog import resolve_schedule
from hyper_parallel.platform import get_platform


def build(schedule: str, chunks: int, micro_batches: int, fwd_ms: float, bwd_ms: float, *,
          transport: str = "auto", trace: bool = False) -> tuple[Any, Callable[[], None]]:
    """This rank's schedule object and a no-argument call that runs one training step."""
    import hyper_parallel as hp
    from hyper_parallel.platform.torch.sleep_stage import SleepStage, sample, squared_error

    p = get_platform()
    _, cls = resolve_schedule(schedule)
    placement = cls.stage_placement(p.world_size, chunks)
    mine = sorted(stage for stage, rank in placement.items() if rank == p.rank)
    v = len(mine)
    share = 1e-3 / v  # ms of a rank's share -> s of one of its chunks
    stages = [hp.PipelineStage(SleepStage(fwd_ms * share, bwd_ms / 2 * share, bwd_ms / 2 * share), s, len(placement))
              for s in mine]
    sched = cls(stages[0] if v == 1 else stages, micro_batches, loss_fn=squared_error, p2p_transport=transport)
    sched.tracer.enabled = trace
    x, y = sample(micro_batches)
    first, last = 0 in mine, len(placement) - 1 in mine
    params = [param for st in stages for param in st.submodule.parameters()]

    def step() -> None:
        for param in params:
            param.grad = None
        sched.run(*((x,) if first else ()), target=y if last else None)

    return sched, step


def timed_steps(step: Callable[[], None], rounds: int, warmup: int = 1,
                after: Callable[[], Any] | None = None) -> list[tuple[float, float, Any]]:
    """``warmup`` untimed steps, then ``rounds`` steps each started right after a barrier:
    ``(start, end, after())`` per timed step, in ``time.perf_counter`` seconds (one clock for every
    process of a host, so the ranks' pairs compare)."""
    p = get_platform()
    out = []
    for r in range(warmup + rounds):
        p.barrier()
        start = time.perf_counter()
        step()
        end = time.perf_counter()
        extra = after() if after is not None else None
        if r >= warmup:
            out.append((start, end, extra))
    p.barrier()
    return out


def alternating_steps(steps: list[Callable[[], None]], rounds: int, warmup: int = 1,
                      afters: list[Callable[[], Any] | None] | None = None) -> list[list[tuple[float, float, Any]]]:
    """`timed_steps` for several pipelines in turns (the first of a round rotates), so that a slow
    phase of a shared machine hits them alike: per pipeline, its ``(start, end, after())``."""
    p = get_platform()
    afters = afters or [None] * len(steps)
    out: list[list[tuple[float, float, Any]]] = [[] for _ in steps]
    for r in range(warmup + rounds):
        for k in [(r + j) % len(steps) for j in range(len(steps))]:
            p.barrier()
            start = time.perf_counter()
            steps[k]()
            end = time.perf_counter()
            extra = afters[k]() if afters[k] is not None else None
            if r >= warmup:
                out[k].append((start, end, extra))
    p.barrier()
    return out


def makespans_ms(per_rank: list[list[tuple[float, float, Any]]]) -> list[float]:
    """Per timed step: the last rank's end minus the first rank's start, in ms."""
    rounds = min(len(r) for r in per_rank)
    return [(max(r[k][1] for r in per_rank) - min(r[k][0] for r in per_rank)) * 1e3 for k in range(rounds)]
