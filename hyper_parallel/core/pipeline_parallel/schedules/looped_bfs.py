"""Looped BFS: breadth first over chunks — each chunk runs all micro-batches in turn."""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep
from hyper_parallel.core.pipeline_parallel.schedules._common import bwd, check_count, fwd, paused_gc


@paused_gc()
def generate_looped_bfs(
    num_ranks: int, num_chunks: int, num_microbatches: int
) -> dict[int, list[MetaStep | None]]:
    """Looped placement (stage c*p + r on rank r). Chunks 0..v-1 each forward all
    micro-batches, then chunks v-1..0 each backward all micro-batches."""
    p = check_count("num_ranks", num_ranks, 1)
    v = check_count("num_chunks", num_chunks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    schedule: dict[int, list[MetaStep | None]] = {}
    for r in range(p):
        forwards = [fwd(c * p + r, i) for c in range(v) for i in range(m)]
        backwards = [bwd(c * p + r, i) for c in reversed(range(v)) for i in range(m)]
        schedule[r] = forwards + backwards
    return schedule
