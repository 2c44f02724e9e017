"""ZB-V: zero bubble with two chunks per rank in a V (stages r and 2p-1-r on rank r).

A micro-batch goes down the ranks through chunk 0 (stages 0..p-1) and comes back up through
chunk 1 (stages p..2p-1), so rank p-1 holds the two middle stages and rank 0 the first and
the last. Every backward is split into I and W. Per rank r, writing F0/F1 and I0/I1 for the
forwards and input backwards of its chunk 0 / chunk 1 (each in micro-batch order):

1. warm-up: ``2 (p - r) - 1`` F0, then r pairs (F1, F0), then ``p - r`` pairs (F1, I1);
2. steady: (F0, I0, F1, I1) while forwards remain;
3. cool-down: (I0, I1) until the input backwards run out.

The W's go where `place_weights` puts them (into the bubbles, and before a forward that would
lift the rank above 2p activations in flight). When m < p the pattern is cut where the
forwards or input backwards run out.

Guarantees: every rank holds at most ``2 min(p, m)`` (stage, micro-batch) activations, i.e. at
most p micro-batches of the rank's whole layers when its two chunks are equal halves (the
peak of 1F1B). With F = I = W per chunk and m >= p the makespan is ``6 m + p - 1`` units: the
only idle time is the ramp, ``p - 1`` forwards of one chunk per rank on average.
"""

from __future__ import annotations

from collections import deque

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep
from hyper_parallel.core.pipeline_parallel.schedules._common import check_count, fwd, paused_gc
from hyper_parallel.core.pipeline_parallel.schedules._weights import input_backward, place_weights


@paused_gc()
def generate_zbv_zero_bubble(num_ranks: int, num_microbatches: int) -> dict[int, list[MetaStep | None]]:
    """ZB-V with stages r and 2p-1-r on rank r; any p >= 1, m >= 1."""
    p = check_count("num_ranks", num_ranks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    orders = {r: _rank_order(p, m, r) for r in range(p)}
    return place_weights(orders, 2 * p, dict.fromkeys(range(p), 2 * p))


def _rank_order(p: int, m: int, r: int) -> list[MetaStep]:
    """The F/I order of rank r (see the module docstring)."""
    chunk = (r, 2 * p - 1 - r)
    queues = {
        ("F", c): deque(fwd(chunk[c], i) for i in range(m)) for c in (0, 1)
    } | {("I", c): deque(input_backward(chunk[c], i) for i in range(m)) for c in (0, 1)}
    steps: list[MetaStep] = []

    def take(*names: tuple[str, int]) -> None:
        for name in names:
            if queues[name]:
                steps.append(queues[name].popleft())

    f0, f1, i0, i1 = ("F", 0), ("F", 1), ("I", 0), ("I", 1)
    for _ in range(2 * (p - r) - 1):
        take(f0)
    for _ in range(r):
        take(f1, f0)
    for _ in range(p - r):
        take(f1, i1)
    while queues[f0] or queues[f1]:
        take(f0, i0, f1, i1)
    while queues[i0] or queues[i1]:
        take(i0, i1)
    return steps
