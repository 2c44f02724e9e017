"""Issue 22 for MPipe: each rank plans its own list (``features/mpipe/rank_plan.py``), equal to the
whole-job path's list for that rank, and where the overflow preprocesses go never changes a number:
on LocalCluster (torch, 4 ranks) one training step with the planned lists and one with the
structural places (each overflow preprocess a round ahead, no timed run) give bitwise equal losses
and gradients."""

from __future__ import annotations

import numpy as np
import pytest
from mpipe_harness import Case, data, mse, torch_modules

from hyper_parallel.core.pipeline_parallel.features.mpipe.plan import insert_mpipe_steps
from hyper_parallel.core.pipeline_parallel.features.mpipe.transpose import ScheduleMPipeTranspose
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

P = 4
CASES = [
    Case("recompute-full-overflow", 2, 11, 2),
    Case("owner-full-overflow-prefetch", 1, 10, 2, owner_backward=True, overlap_p2p=True),
    Case("frozen-full-overflow", 2, 9, 2, trainable=False),
    Case("dataload-only-owned", 1, 9, 0, inputs="owned"),
]


def _step(case: Case, structural: bool) -> dict:
    p = get_platform()
    n = p.world_size
    num_stages = n * case.chunks
    encoder, bodies = torch_modules(num_stages, case.layers, case.trainable)
    stages = [PipelineStage(bodies[c * n + p.rank], c * n + p.rank, num_stages) for c in range(case.chunks)]
    schedule = ScheduleMPipeTranspose(stages if case.chunks > 1 else stages[0], case.micro, encoder, case.layers,
                                      loss_fn=mse, **case.options())
    metadata = schedule._training_metadata()
    planned = schedule._lowered(metadata)
    assert sorted(planned) == [p.rank]  # the rank planned its own list
    whole = schedule._job_lowered(metadata)  # every rank's, as the whole-job path makes them
    assert planned[p.rank] == whole[p.rank]
    if structural:
        body = lower(schedule.compute_schedule, schedule.stage_to_pp_rank, "plain", metadata=metadata,
                     prefetch=schedule.overlap_p2p)
        lists = insert_mpipe_steps(body, schedule.stage_to_pp_rank, schedule.plan)
        assert lists != whole  # the structural places differ from the timed ones
        schedule._lowered_cache[(metadata, False)] = {p.rank: lists[p.rank]}
    image, tokens, target = data(case)
    if case.inputs == "owned":
        rows = schedule.owned_sample_indices(len(image))
        image, tokens = image[rows], tokens[rows]
    out = schedule.run(p.from_numpy(image), p.from_numpy(tokens), target=p.from_numpy(target))
    return {"losses": [float(p.to_numpy(x)) for x in out],
            "grads": {name: p.to_numpy(g).copy() for name, g in schedule.named_gradients().items()}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_where_a_preprocess_runs_changes_no_number(case):
    planned = LocalCluster(P, platform="torch").run(_step, case, False)
    structural = LocalCluster(P, platform="torch").run(_step, case, True)
    for a, b in zip(planned, structural):
        assert a["losses"] == b["losses"]
        assert a["grads"].keys() == b["grads"].keys()
        for name in a["grads"]:
            np.testing.assert_array_equal(a["grads"][name], b["grads"][name], err_msg=f"{case.name}: {name}")
