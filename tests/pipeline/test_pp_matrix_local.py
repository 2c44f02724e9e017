"""Every schedule crossed with the options it meets, on torch LocalCluster, against the oracle.

schedule x p in {2, 3, 4} x chunks x m (short rounds included) x transport x dyn_shape x
overlap_p2p, comparing every micro-batch's loss and every gradient with the same stages chained
in one process. Tied weights and shapes that change per micro-batch get their own crossings.
"""

from __future__ import annotations

import itertools

import pytest
from mlp_harness import MatrixJob, check, run_matrix_job

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
