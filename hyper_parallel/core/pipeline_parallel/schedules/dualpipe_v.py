"""DualPipeV: the V-shaped DualPipe (DeepSeek-V3), stages r and 2p-1-r on rank r.

In the middle of the schedule every rank runs the backward of one micro-batch together with
the forward of another, as one ``OVERLAP_B_F`` step (backward first, then forward): with a
runtime that overlaps them (``CommComputeOverlap``), one side's all-to-all is in flight while
the other side computes. The weight gradients are split off (I, later W) in the phases where
that fills a bubble. Per rank r, with F0/F1, B0/B1, I0/I1 the steps of its chunk 0 (stage r)
and chunk 1 (stage 2p-1-r), each chunk's micro-batches in order, and W the oldest pending
weight step:

1. ``2 (p - r - 1)`` F0;
2. ``r + 1`` times (F0, F1);
3. ``p - r - 1`` times (I1, W, F1);
4. ``m - 2p + r + 1`` times (B1 & F0, B0 & F1) -- ``&`` is one overlapped step; rank p-1 runs
   the first pair as F0, B1 without overlap (its B1 cannot wait for F0's output otherwise);
5. ``p - r - 1`` times (B1, B0 & F1);
6. ``r + 1`` times (B1, B0), the second half of them split into I's;
7. ``p - r - 1`` times (W, I0);
8. ``r + 1`` times W.

Needs m >= 2p micro-batches (phase 4 must run at least once on rank 0). Peak in flight: ``2p
+ 1`` (stage, micro-batch) activations on the worst rank (p + 1/2 micro-batches of the rank's
whole layers, within DualPipe's "PP + 1"). With per-chunk costs F, B = I + W and an
overlapped pair costing ``F&B``, every rank idles ``(p - 1)(F&B + B - 3W)``: with F = I = W = 1
and F&B = F + B that is ``2 (p - 1)``, makespan ``6 m + 2 (p - 1)``.
"""

from __future__ import annotations

from collections import deque

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType, unchecked_step
from hyper_parallel.core.pipeline_parallel.schedules._common import bwd, check_count, fwd, paused_gc
from hyper_parallel.core.pipeline_parallel.schedules._weights import input_backward, weight_backward


@paused_gc()
def generate_dualpipe_v(num_ranks: int, num_microbatches: int) -> dict[int, list[MetaStep | None]]:
    """DualPipeV with stages r and 2p-1-r on rank r; any p >= 1, m >= 2p."""
    p = check_count("num_ranks", num_ranks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    if m < 2 * p:
        raise ValueError(
            f"DualPipeV needs at least 2 * num_ranks = {2 * p} micro-batches with {p} ranks, got {m}"
        )
    return {r: _RankSteps(p, r).build(m) for r in range(p)}


def overlap_b_f(backward: MetaStep, forward: MetaStep) -> MetaStep:
    """One ``OVERLAP_B_F`` step: ``backward`` (B or I) of one micro-batch, ``forward`` of another."""
    return unchecked_step(None, MetaStepType.OVERLAP_B_F, None, (backward, forward))


class _RankSteps:
    """The list of one rank, built phase by phase; tracks the next micro-batch of each kind."""

    def __init__(self, num_ranks: int, rank: int) -> None:
        self.p, self.r = num_ranks, rank
        self.stages = (rank, 2 * num_ranks - 1 - rank)
        self.next_forward = [0, 0]
        self.next_backward = [0, 0]
        self.weights: deque[MetaStep] = deque()
        self.steps: list[MetaStep | None] = []

    def f(self, chunk: int) -> MetaStep:
        micro = self.next_forward[chunk]
        self.next_forward[chunk] += 1
        return fwd(self.stages[chunk], micro)

    def b(self, chunk: int, split: bool = False) -> MetaStep:
        """Full backward, or (``split``) its input half with the weight half left pending."""
        stage, micro = self.stages[chunk], self.next_backward[chunk]
        self.next_backward[chunk] += 1
        if not split:
            return bwd(stage, micro)
        self.weights.append(weight_backward(stage, micro))
        return input_backward(stage, micro)

    def w(self) -> MetaStep:
        return self.weights.popleft()

    def build(self, m: int) -> list[MetaStep | None]:
        p, r, add = self.p, self.r, self.steps.extend
        for _ in range(2 * (p - r - 1)):
            add([self.f(0)])
        for _ in range(r + 1):
            add([self.f(0), self.f(1)])
        for _ in range(p - r - 1):
            add([self.b(1, split=True), self.w(), self.f(1)])
        for k in range(m - 2 * p + r + 1):
            if k == 0 and r == p - 1:
                add([self.f(0), self.b(1)])
            else:
                add([overlap_b_f(self.b(1), self.f(0))])
            add([overlap_b_f(self.b(0), self.f(1))])
        for _ in range(p - r - 1):
            add([self.b(1), overlap_b_f(self.b(0), self.f(1))])
        split = False
        for k in range(r + 1):
            split |= k == (r + 1) // 2 and r % 2 == 1
            add([self.b(1, split)])
            split |= k == (r + 1) // 2 and r % 2 == 0
            add([self.b(0, split)])
        for _ in range(p - r - 1):
            add([self.w(), self.b(0, split=True)])
        for _ in range(r + 1):
            add([self.w()])
        assert self.next_forward == [m, m] and self.next_backward == [m, m] and not self.weights
        return self.steps
