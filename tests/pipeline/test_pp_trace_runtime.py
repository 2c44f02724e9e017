"""A measured trace has one record per executed step per rank, in the schedule's order, and its
merged form is valid Chrome trace JSON; on LocalCluster and on 4 gloo processes. The gloo ranks'
clocks share one origin: no step runs before the peer sent its data (test_pp_trace_clock.py does
the same on LocalCluster)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import run_torchrun
from mlp_harness import MatrixJob, batch, build_stages, mse

from hyper_parallel.core.pipeline_parallel.schedule import ScheduleInterleaved1F1B
from hyper_parallel.core.pipeline_parallel.tools.trace import causality_violations, chrome_trace
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

HERE = os.path.dirname(os.path.abspath(__file__))


def _check(records, order):
    for rank, steps in order.items():
        issued = [r["step"] for r in records if r["rank"] == int(rank) and r["kind"] != "p2p-wait"]
        assert issued == steps, (rank, issued, steps)
        waits = [r for r in records if r["rank"] == int(rank) and r["kind"] == "p2p-wait"]
        assert all(r["step"].startswith("RECV_") for r in waits)
        starts = [r["start"] for r in records if r["rank"] == int(rank) and r["kind"] != "p2p-wait"]
        assert starts == sorted(starts)
    json.loads(json.dumps(chrome_trace(records)))  # serialisable as a Chrome trace


@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_trace_of_a_local_cluster_run(transport):
    job = MatrixJob(ScheduleInterleaved1F1B, 2, 4)

    def body():
        p = get_platform()
        placement = ScheduleInterleaved1F1B.stage_placement(2, 2)
        stages = build_stages(job, 4, placement)
        sched = ScheduleInterleaved1F1B(stages, 4, loss_fn=mse, p2p_transport=transport)
        sched.tracer.enabled = True
        x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
        sched.run(x, target=y if stages[-1].is_last else None)
        return sched.gather_trace(), {r: [str(s) for s in steps] for r, steps in sched.exec_order.items()}, p.rank

    results = LocalCluster(2).run(body)
    records, order, _ = results[0]
    assert records == results[1][0]  # every rank gets the whole trace
    _check(records, order)
    chrome = chrome_trace(records)
    assert {e["pid"] for e in chrome["traceEvents"] if e.get("ph") == "X"} == {0, 1}


@pytest.mark.timeout(300)
def test_trace_of_a_gloo_run(tmp_path):
    run_torchrun(os.path.join(HERE, "trace_gloo_worker.py"), 4, str(tmp_path), timeout=200)
    data = json.loads((tmp_path / "trace.json").read_text())
    _check(data["records"], data["order"])
    assert {r["rank"] for r in data["records"]} == {0, 1, 2, 3}
    assert data["clock_error"] < 1e-3  # one host: the wall-clock anchors agree to microseconds
    assert causality_violations(data["records"], data["clock_error"]) == []
