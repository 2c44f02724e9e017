"""The zero-bubble schedule classes on 4 real gloo processes (one torchrun job) against the
non-pipelined oracle: every micro-batch's loss, every gradient, and the peak activations."""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import load_rank_results, run_torchrun
from mlp_harness import check
from zero_bubble_gloo_worker import CASES, P

from hyper_parallel import ScheduleDualPipeV, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("gloo_zb")
    run_torchrun(os.path.join(HERE, "zero_bubble_gloo_worker.py"), P, str(out), timeout=180)
    loaded = load_rank_results(out, P)
    assert [(d["rank"], d["world"]) for d in loaded] == [(r, P) for r in range(P)]
    return loaded


def test_cases_cover_the_minimum_2p_2p_plus_1_and_every_option():
    """Each schedule meets m at its minimum, 2p and 2p+1, and both transports with overlap_p2p on and off."""
    for cls in (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV):
        jobs = [job for job in CASES.values() if job.schedule_cls is cls]
        assert {job.micro for job in jobs} == {cls.min_microbatches(P, 2), 2 * P, 2 * P + 1}, cls.__name__
        options = {(job.options["p2p_transport"], job.options.get("overlap_p2p", False)) for job in jobs}
        assert options == {(t, o) for t in ("plain", "batch") for o in (False, True)}, cls.__name__


@pytest.mark.parametrize("name", list(CASES))
def test_gloo_matches_non_pipelined(ranks, name):
    job = CASES[name]
    results = [d["results"][name] for d in ranks]
    num_stages = len(job.schedule_cls.stage_placement(P, job.chunks))
    check(job, results, num_stages)
    # only the rank holding the last stage returns losses (rank 0 under V placement)
    last = job.schedule_cls.stage_placement(P, job.chunks)[num_stages - 1]
    assert [bool(r["losses"]) for r in results] == [r == last for r in range(P)]
    bound = 2 * P + 1 if job.schedule_cls is ScheduleDualPipeV else job.chunks * min(P, job.micro)
    assert max(r["peak"] for r in results) == bound
