"""1F1B: a short forward warm-up, then one forward / one backward, then a cool-down."""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep
from hyper_parallel.core.pipeline_parallel.schedules._common import bwd, check_count, fwd, paused_gc, one_f_one_b


@paused_gc()
def generate_1f1b(num_ranks: int, num_microbatches: int) -> dict[int, list[MetaStep | None]]:
    """Stage r on rank r. Rank r warms up with min(m, p - r - 1) forwards, so it never holds
    more than min(m, p - r) micro-batches forwarded but not yet backwarded."""
    p = check_count("num_ranks", num_ranks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    schedule: dict[int, list[MetaStep | None]] = {}
    for r in range(p):
        forwards = [fwd(r, i) for i in range(m)]
        backwards = [bwd(r, i) for i in range(m)]
        schedule[r] = list(one_f_one_b(forwards, backwards, warmup=p - r - 1))
    return schedule
