"""``overlap_p2p`` prefetch (issue 6, fix 2), counted in the lowered lists of every built-in schedule.

A receive is *prefetched* when at least one compute step of its rank runs between the place it
is posted and the compute step that consumes it. Which receives *can* be prefetched is worked
out here from the compute-only schedule alone, not from the lowering: the receive consumed by
compute step k of rank r can be posted before step k - 1 when the compute step that produces
its message (on another rank) does not depend, through program order and data, on step k - 1
of rank r. Receives whose buffer waits for metadata (the first forward message of every stage
boundary with ``metadata="first"``, every one with ``"all"``) cannot move.

Run this file with ``-s`` to print the table of counts.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType, consumes, message_key, produces
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.schedule import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.schedules.overlap_pairs import fuse_overlap_pairs
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_lowered
from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

T = MetaStepType
DATA_RECVS = (T.FWD_RECV, T.BWD_RECV)

# (name, class, chunks, fuse overlap_b_f pairs)
SCHEDULES = [
    ("GPipe", ScheduleGPipe, 1, False),
    ("1F1B", Schedule1F1B, 1, False),
    ("Interleaved1F1B", ScheduleInterleaved1F1B, 2, False),
    ("Interleaved1F1B v3", ScheduleInterleaved1F1B, 3, False),
    ("Interleaved1F1B overlap_b_f", ScheduleInterleaved1F1B, 2, True),
    ("LoopedBFS", ScheduleLoopedBFS, 2, False),
    ("InterleavedZeroBubble", ScheduleInterleavedZeroBubble, 1, False),
    ("InterleavedZeroBubble v2", ScheduleInterleavedZeroBubble, 2, False),
    ("ZBV", ScheduleZBVZeroBubble, 2, False),
    ("DualPipeV", ScheduleDualPipeV, 2, False),
]
SIZES = [(2, None), (3, None), (4, "2p+1")]  # (p, m); None: 2p, or the schedule's minimum if larger


def _micro(cls, p: int, v: int, which) -> int:
    m = 2 * p + 1 if which == "2p+1" else 2 * p
    return max(m, cls.min_microbatches(p, v))


def _compute(cls, p: int, v: int, m: int, fuse: bool):
    placement = cls.stage_placement(p, v)
    compute = cls.generate(p, v, m)
    if fuse:
        compute = fuse_overlap_pairs(compute, placement)
    return compute, placement


def expected_prefetchable(compute, placement, metadata: str) -> dict[int, int]:
    """Per rank: the cross-rank receives that may be posted one compute step early (see above)."""
    num_stages = len(placement)
    items = {r: [st for st in steps if st is not None] for r, steps in compute.items()}
    producer: dict[tuple, tuple[int, int]] = {}
    for r, steps in items.items():
        for k, step in enumerate(steps):
            for part in step.parts:
                for key in produces(part):
                    producer[key] = (r, k)
    # successors of a compute step: the next one on its rank, and every consumer of what it makes
    consumers: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for r, steps in items.items():
        for k, step in enumerate(steps):
            for part in step.parts:
                for key in consumes(part, num_stages):
                    consumers[key].append((r, k))
    succ: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
    for r, steps in items.items():
        for k, step in enumerate(steps):
            if k + 1 < len(steps):
                succ[(r, k)].add((r, k + 1))
            for part in step.parts:
                for key in produces(part):
                    succ[(r, k)].update(consumers.get(key, ()))

    @functools.cache
    def reach(node: tuple[int, int]) -> frozenset:
        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            for s in succ[n]:
                if s not in seen:
                    seen.add(s)
                    todo.append(s)
        return frozenset(seen)

    # forward messages that carry metadata: the first forward of every stage with a cross-rank consumer
    with_meta: set[tuple] = set()
    for r, steps in items.items():
        seen_stage: set[int] = set()
        for step in steps:
            for part in step.parts:
                if part.meta_type is T.FWD and placement.get(part.stage_index + 1, r) != r:
                    if metadata == "all" or (metadata == "first" and part.stage_index not in seen_stage):
                        with_meta.add(("F", part.stage_index, part.micro_index))
                    seen_stage.add(part.stage_index)
    counts = {}
    for r, steps in items.items():
        n = 0
        for k, step in enumerate(steps):
            for part in step.parts:
                for key in consumes(part, num_stages):
                    src = producer[key]
                    if src[0] == r or k == 0 or key in with_meta:
                        continue
                    if src not in reach((r, k - 1)):
                        n += 1
        counts[r] = n
    return counts


def counted_prefetches(lowered: dict[int, list[MetaStep]]) -> dict[int, int]:
    """Per rank: data receives posted at least one compute step before their consumer."""
    num_stages = 1 + max(p.stage_index for steps in lowered.values() for st in steps for p in st.parts)
    counts = {}
    for r, steps in lowered.items():
        posted: dict[tuple, int] = {}  # message -> compute steps run before the receive was posted
        done = n = 0
        for step in steps:
            for op in step.comm_parts:
                if op.meta_type in DATA_RECVS:
                    posted[message_key(op)] = done
            if step.parts:
                for part in step.parts:
                    for key in consumes(part, num_stages):
                        if key in posted and done - posted.pop(key) >= 1:
                            n += 1
                done += 1
        assert not posted, f"rank {r}: receives without a consumer: {sorted(posted)}"
        counts[r] = n
    return counts


TABLE: list[str] = []


@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("metadata", ["none", "first"])
@pytest.mark.parametrize("p,which", SIZES)
@pytest.mark.parametrize("name,cls,v,fuse", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_receives_are_posted_a_compute_step_early(name, cls, v, fuse, p, which, metadata, transport):
    m = _micro(cls, p, v, which)
    compute, placement = _compute(cls, p, v, m, fuse)
    allowed = expected_prefetchable(compute, placement, metadata)
    on = lower(compute, placement, transport, metadata=metadata, prefetch=True)
    off = lower(compute, placement, transport, metadata=metadata, prefetch=False)
    for engine in ("eager", "stream") if transport == "batch" else ("eager",):
        validate_lowered(on, placement, m, transport, engine=engine)
    got_on, got_off = counted_prefetches(on), counted_prefetches(off)
    TABLE.append(f"{name:28} p={p} m={m:2} {metadata:5} {transport:5} allowed={sum(allowed.values()):3} "
                 f"on={sum(got_on.values()):3} off={sum(got_off.values()):3}  per rank allowed/on/off="
                 f"{[(allowed[r], got_on[r], got_off[r]) for r in sorted(compute)]}")
    # batch: the stream repair may post some receives of a rank early without prefetch and
    # arrange that rank differently with it, so only the job's total is monotone there
    assert sum(got_on.values()) >= sum(got_off.values()), (got_on, got_off)
    for r in compute:
        if transport == "plain":
            assert got_on[r] >= got_off[r], (r, got_on, got_off)
        if allowed[r] > 0:
            assert got_on[r] > 0, f"rank {r}: {allowed[r]} receives could be prefetched, none was"
        if transport == "plain":  # nothing moves a prefetch back on the eager transport
            assert got_on[r] >= allowed[r], (r, got_on, allowed)
    # the schedules here all have receives that can be prefetched
    assert sum(allowed.values()) > 0


def test_the_expectation_sees_a_chain():
    """A strict chain (one micro-batch through GPipe) has nothing to prefetch; two micro-batches do."""
    compute, placement = _compute(ScheduleGPipe, 2, 1, 1, False)
    assert expected_prefetchable(compute, placement, "none") == {0: 0, 1: 0}
    assert counted_prefetches(lower(compute, placement, "plain", prefetch=True)) == {0: 0, 1: 0}
    compute, placement = _compute(ScheduleGPipe, 2, 1, 2, False)
    # rank 1's input of m1 can arrive while it computes F.s1.m0
    allowed = expected_prefetchable(compute, placement, "none")
    assert allowed[1] >= 1
    assert counted_prefetches(lower(compute, placement, "plain", prefetch=True))[1] >= 1
    assert counted_prefetches(lower(compute, placement, "plain", prefetch=False)) == {0: 0, 1: 0}


def test_zz_print_table():
    if TABLE:
        print("\n" + "\n".join(TABLE))
