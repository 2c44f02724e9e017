"""GPipe: every rank runs all forwards, then all backwards."""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep
from hyper_parallel.core.pipeline_parallel.schedules._common import bwd, check_count, fwd, paused_gc


@paused_gc()
def generate_gpipe(num_ranks: int, num_microbatches: int) -> dict[int, list[MetaStep | None]]:
    """Stage r on rank r: forwards of micro-batches 0..m-1, then their backwards 0..m-1."""
    p = check_count("num_ranks", num_ranks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    return {
        r: [fwd(r, i) for i in range(m)] + [bwd(r, i) for i in range(m)]
        for r in range(p)
    }
