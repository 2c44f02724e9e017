"""``HYPER_PARALLEL_TRACE`` turns tracing on for every schedule built while it is set (a job can be
traced without touching its code); unset or ``0`` leaves it off and records nothing."""

from __future__ import annotations

import pytest
import torch
from mlp_harness import MatrixJob, batch, build_stages, mse

from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B
from hyper_parallel.platform.local import LocalCluster


@pytest.mark.parametrize("value, traced", [("1", True), ("0", False), ("", False)])
def test_trace_environment_variable(monkeypatch, value, traced):
    monkeypatch.setenv("HYPER_PARALLEL_TRACE", value)
    job = MatrixJob(Schedule1F1B, 1, 3)

    def body():
        stages = build_stages(job, 2, Schedule1F1B.stage_placement(2, 1))
        sched = Schedule1F1B(stages[0], 3, loss_fn=mse)
        x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
        sched.run(x, target=y if stages[-1].is_last else None)
        return sched.tracer.enabled, sched.gather_trace()

    results = LocalCluster(2).run(body)
    enabled, records = results[0]
    assert enabled is traced
    if traced:  # one compute record per forward and backward of every rank: 2 ranks x 3 x (F + B)
        assert sum(1 for r in records if r["kind"] == "compute") == 2 * 3 * 2
    else:
        assert records == []
