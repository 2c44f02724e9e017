"""ZB-H1 style zero bubble over looped placement (stage ``c * p + r`` on rank r), any v >= 1.

The backward of every (stage, micro-batch) is split into I (input gradient, on the critical
path) and W (weight gradient, free to move). Per rank:

1. F and I follow interleaved 1F1B with I in place of B: the same depth-first rounds of p
   micro-batches (see ``interleaved_1f1b.py``), ``v * p - r`` warm-up forwards (rank r),
   then one I / one F until the forwards run out, then the remaining I's.
2. The W's go where `place_weights` puts them: into the bubbles, and before a forward that
   would lift the rank above ``v * p`` activations in flight, oldest first.

With v = 1 this is ZB-H1 of Qi et al. (2023): rank r holds p - r activations after its
warm-up, takes one more with each (I, F) pair until it holds p, and from then on runs
(I, W, F); its r held-back W's fill the bubbles of the cool-down.

Guarantees (in (stage, micro-batch) activations, an activation being in flight from its F
to its W): every rank holds at most ``v * min(p, m)``, i.e. at most p micro-batches of the
rank's whole layers when its layers are split evenly over its v chunks -- the peak of 1F1B.
With F = I = W (per chunk) and m a multiple of p, the makespan is ``3 v m + p - 1`` units:
each rank idles ``p - 1`` units, ``(p - 1)(F + I - W)``, a third of 1F1B's ``(p - 1)(F + B)``.
When m is not a multiple of p (v > 1) the short last round costs a few units more.
"""

from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep
from hyper_parallel.core.pipeline_parallel.schedules._common import check_count, fwd, paused_gc
from hyper_parallel.core.pipeline_parallel.schedules._weights import input_backward, place_weights
from hyper_parallel.core.pipeline_parallel.schedules.interleaved_1f1b import microbatch_rounds


@paused_gc()
def generate_interleaved_zero_bubble(
    num_ranks: int, num_chunks: int, num_microbatches: int
) -> dict[int, list[MetaStep | None]]:
    """ZB-H1 style schedule with stage ``c * p + r`` on rank r; any p, v >= 1, m >= 1."""
    p = check_count("num_ranks", num_ranks, 1)
    v = check_count("num_chunks", num_chunks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    rounds = microbatch_rounds(p, m)
    orders: dict[int, list[MetaStep]] = {}
    for r in range(p):
        forwards = [fwd(c * p + r, i) for rnd in rounds for c in range(v) for i in rnd]
        inputs = [input_backward(c * p + r, i) for rnd in rounds for c in reversed(range(v)) for i in rnd]
        warmup = min(len(forwards), v * p - r)
        later = len(forwards) - warmup
        steady: list[MetaStep] = [None] * (2 * later)  # type: ignore[list-item]
        steady[0::2] = inputs[:later]  # one I, one F while forwards remain
        steady[1::2] = forwards[warmup:]
        orders[r] = forwards[:warmup] + steady + inputs[later:]
    return place_weights(orders, v * p, dict.fromkeys(range(p), v * p))
