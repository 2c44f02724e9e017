"""Interleaved 1F1B (Megatron style) over looped placement, for any number of micro-batches.

Micro-batches are taken in depth-first rounds of p (the last round may be shorter). Every
rank walks the same unit order, with stage ``c * p + r`` standing for chunk ``c``:

- forwards: for each round, chunk 0..v-1, each micro-batch of the round;
- backwards: for each round, chunk v-1..0, each micro-batch of the round.

Rank r runs ``warmup(r)`` forwards, then one forward / one backward, then the remaining
backwards. The textbook warm-up is ``(v - 1) * p + 2 * (p - 1 - r)``.

Adjustment for a short round. Rank 0's forward of chunk c + 1 waits for rank p-1's forward
of chunk c, and rank p-1's backward of chunk c waits for rank 0's backward of chunk c + 1.
Inside a round of n micro-batches these units of one micro-batch sit n places apart in the
unit orders, so a short last round (n = m mod p < p) lets rank 0 run far enough ahead of
rank p-1 that each waits for the other. Rank 0..p-2's extra warm-up over rank p-1 is
therefore capped at ``p + n_min`` (``n_min`` = size of the shortest round)::

    warmup(r) = min(v * m, (v - 1) * p + min(2 * (p - 1 - r), p + n_min))

With full rounds (n_min = p) or m < p the cap changes nothing; otherwise it trades a little
bubble for deadlock freedom, which the property tests check for many (p, v, m).
"""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.schedules._common import bwd, check_count, fwd, paused_gc, one_f_one_b
from hyper_parallel.core.pipeline_parallel.schedules.overlap_pairs import fuse_overlap_pairs


def microbatch_rounds(num_ranks: int, num_microbatches: int) -> list[range]:
    """Consecutive rounds of ``num_ranks`` micro-batches; the last may be shorter."""
    p, m = num_ranks, num_microbatches
    return [range(start, min(start + p, m)) for start in range(0, m, p)]


def interleaved_warmup(num_ranks: int, num_chunks: int, num_microbatches: int, rank: int) -> int:
    """Number of warm-up forwards of ``rank`` (see the module docstring)."""
    p, v, m = num_ranks, num_chunks, num_microbatches
    shortest = min(len(rnd) for rnd in microbatch_rounds(p, m))
    return min(v * m, (v - 1) * p + min(2 * (p - 1 - rank), p + shortest))


@paused_gc()
def generate_interleaved_1f1b(
    num_ranks: int, num_chunks: int, num_microbatches: int, overlap_b_f: bool = False
) -> dict[int, list[MetaStep | None]]:
    """Interleaved 1F1B with stage ``c * p + r`` on rank r; any m >= 1, v >= 2.

    With ``overlap_b_f`` the steady state's pairs of a backward and the next forward of another
    chunk become ``OVERLAP_B_F`` steps (``overlap_pairs.fuse_overlap_pairs``)."""
    p = check_count("num_ranks", num_ranks, 1)
    v = check_count("num_chunks", num_chunks, 2)
    m = check_count("num_microbatches", num_microbatches, 1)
    rounds = microbatch_rounds(p, m)
    schedule: dict[int, list[MetaStep | None]] = {}
    for r in range(p):
        forwards = [fwd(c * p + r, i) for rnd in rounds for c in range(v) for i in rnd]
        backwards = [bwd(c * p + r, i) for rnd in rounds for c in reversed(range(v)) for i in rnd]
        schedule[r] = list(one_f_one_b(forwards, backwards, interleaved_warmup(p, v, m, r)))
    if overlap_b_f:
        return fuse_overlap_pairs(schedule, looped_placement(p, v))
    return schedule
