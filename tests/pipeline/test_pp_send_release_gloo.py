"""On gloo a send reports completion only once it is waited for, so outputs freed "when the send has
completed" stayed allocated until the end of the run: every rank but the last held all m outputs.
A forward send is now settled when its micro-batch's output gradient arrives (the peer has used the
output by then), so 1F1B holds at most p - r sent outputs on rank r, as the schedule intends."""

from __future__ import annotations

import os

import pytest
from conftest import load_rank_results, run_torchrun
from mlp_harness import MatrixJob, check

from hyper_parallel import Schedule1F1B

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD, MICRO = 3, 6


@pytest.mark.timeout(300)
def test_sent_outputs_are_freed_when_their_gradient_arrives(tmp_path):
    run_torchrun(os.path.join(HERE, "send_release_gloo_worker.py"), WORLD, str(tmp_path), timeout=240)
    results = load_rank_results(tmp_path, WORLD)
    for rank, result in enumerate(results[:-1]):
        assert len(result["held"]) == MICRO, f"rank {rank} sent {len(result['held'])} outputs"
        # 1F1B keeps p - r micro-batches in flight on rank r; every older output was freed
        assert max(result["held"]) <= WORLD - rank, f"rank {rank} held {result['held']}"
    check(MatrixJob(Schedule1F1B, 1, MICRO), results, WORLD)
