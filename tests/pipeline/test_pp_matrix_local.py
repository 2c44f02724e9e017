"""Every schedule crossed with the options it meets, on torch LocalCluster, against the oracle.

schedule x p in {2, 3, 4} x chunks x m (short rounds included) x transport x dyn_shape x
overlap_p2p, comparing every micro-batch's loss and every gradient with the same stages chained
in one process. Tied weights and shapes that change per micro-batch get their own crossings.
"""

from __future__ import annotations

import itertools

import pytest
from mlp_harness import MatrixJob, check, run_matrix_job

from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, chunk_range
from hyper_parallel.core.pipeline_parallel.schedule import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.platform.local import LocalCluster

SCHEDULES = [(ScheduleGPipe, 1), (Schedule1F1B, 1), (ScheduleInterleaved1F1B, 2), (ScheduleLoopedBFS, 2)]
OPTIONS = list(itertools.product(("plain", "batch"), (False, True), (False, True)))  # transport, dyn, overlap


def _micro_counts(p: int) -> list[int]:
    return sorted({1, p - 1, p + 1, 2 * p + 1} - {0})


CASES = [
    pytest.param(cls, v, p, m, transport, dyn, overlap, id=f"{cls.__name__}-p{p}-v{v}-m{m}-{transport}"
                 f"{'-dyn' if dyn else ''}{'-overlap' if overlap else ''}")
    for cls, v in SCHEDULES
    for p in (2, 3, 4)
    for m in _micro_counts(p)
    for transport, dyn, overlap in OPTIONS
    if (p, m) != (4, 9) or (transport, dyn) == ("batch", True)  # keep the widest case lean
]


@pytest.mark.parametrize("cls, v, p, m, transport, dyn, overlap", CASES)
def test_schedule_matrix_matches_oracle(cls, v, p, m, transport, dyn, overlap):
    job = MatrixJob(cls, v, m, dict(p2p_transport=transport, overlap_p2p=overlap), dyn_shape=dyn)
    results = LocalCluster(p).run(run_matrix_job, job)
    check(job, results, p * v)


@pytest.mark.parametrize("cls, v", SCHEDULES)
@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_tied_weights_under_every_schedule(cls, v, transport):
    job = MatrixJob(cls, v, 5, dict(p2p_transport=transport, overlap_p2p=True), tie=True)
    check(job, LocalCluster(3).run(run_matrix_job, job), 3 * v)


@pytest.mark.parametrize("cls, v", SCHEDULES)
@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("overlap", [False, True])
def test_shapes_that_change_per_micro_batch(cls, v, transport, overlap):
    job = MatrixJob(cls, v, 5, dict(p2p_transport=transport, overlap_p2p=overlap), dyn_shape=True, vary=True)
    check(job, LocalCluster(2).run(run_matrix_job, job), 2 * v)


def test_batch_metadata_order_regression():
    # Interleaved, 2 ranks x 2 chunks, m=3, dyn_shape, batch: the metadata of one BATCH used to be
    # received before its data, breaking the FIFO order lowering set up.
    job = MatrixJob(ScheduleInterleaved1F1B, 2, 3, dict(p2p_transport="batch"), dyn_shape=True)
    check(job, LocalCluster(2).run(run_matrix_job, job), 4)


# ---------------------------------------------------------------- p up to 6, every v: a covering design
# The full cross above stops at p = 4 and the chunk counts of the classic schedules. Every schedule x
# p in 2..6 x v in 1..3 (where the class takes it) x three micro-batch counts x two transports x
# static/dynamic shapes x overlap on/off (some 2,500 runs) is too slow with tensors;
# the lowerings of that cross are validated without tensors in
# tests/pipeline_unit/test_pp_lowering_cross.py. Here every pair of option values meets in at least
# one run (all-pairs, picked greedily and deterministically from the valid cases).
WIDE_SCHEDULES = list(available_schedules().values())  # every built-in schedule class
assert len(WIDE_SCHEDULES) == 7, WIDE_SCHEDULES
WIDE_FACTORS = {  # name -> values; m is a kind: the schedule's fewest, p, or 2p + 1 micro-batches
    "cls": WIDE_SCHEDULES, "p": [2, 3, 4, 5, 6], "v": [1, 2, 3], "m": ["min", "p", "2p+1"],
    "transport": ["plain", "batch"], "dyn": [False, True], "overlap": [False, True],
}


def _micro(cls, p: int, v: int, kind: str) -> int:
    low = cls.min_microbatches(p, v)
    return {"min": low, "p": max(p, low), "2p+1": max(2 * p + 1, low)}[kind]


def _allowed(case: dict) -> bool:
    return chunk_range(case["cls"])[0] <= case["v"] <= chunk_range(case["cls"])[1]


def all_pairs(factors: dict[str, list], allowed) -> list[dict]:
    """Cases in which every two values of two factors meet at least once (where some allowed case
    holds them both): each round takes the allowed case that covers the most pairs not yet
    covered, the first in product order on a tie."""
    names = list(factors)
    cases = [dict(zip(names, values, strict=True)) for values in itertools.product(*factors.values())]
    cases = [c for c in cases if allowed(c)]

    def pairs(case: dict) -> set:
        return set(itertools.combinations([(n, case[n]) for n in names], 2))

    todo = set().union(*(pairs(c) for c in cases))
    chosen = []
    while todo:
        best = max(cases, key=lambda c: len(pairs(c) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


WIDE_DESIGN = all_pairs(WIDE_FACTORS, _allowed)
WIDE_CASES = [
    pytest.param(c["cls"], c["v"], c["p"], _micro(c["cls"], c["p"], c["v"], c["m"]), c["transport"], c["dyn"],
                 c["overlap"], id=f"{c['cls'].__name__}-p{c['p']}-v{c['v']}-m{c['m']}-{c['transport']}"
                 f"{'-dyn' if c['dyn'] else ''}{'-overlap' if c['overlap'] else ''}")
    for c in WIDE_DESIGN
]


def test_the_covering_design_covers_every_pair():
    # checked by brute force, apart from the greedy choice: every two values of two factors that
    # some allowed case holds together meet in a chosen case
    names = list(WIDE_FACTORS)
    every = [dict(zip(names, values, strict=True)) for values in itertools.product(*WIDE_FACTORS.values())]
    every = [c for c in every if _allowed(c)]
    for a, b in itertools.combinations(names, 2):
        possible = {(c[a], c[b]) for c in every}
        assert len(possible) > 1
        assert {(c[a], c[b]) for c in WIDE_DESIGN} == possible, (a, b)
    assert len(WIDE_DESIGN) <= 45  # the point of a covering design: far fewer runs than the ~2500 of the cross


@pytest.mark.parametrize("cls, v, p, m, transport, dyn, overlap", WIDE_CASES)
def test_wide_pipelines_match_oracle(cls, v, p, m, transport, dyn, overlap):
    job = MatrixJob(cls, v, m, dict(p2p_transport=transport, overlap_p2p=overlap), dyn_shape=dyn)
    check(job, LocalCluster(p).run(run_matrix_job, job), p * v)
