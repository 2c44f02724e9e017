"""The main job runs end to end and its gradient check passes (torch gloo processes, MindSpore LocalCluster)."""

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO_ROOT


@pytest.mark.timeout(300)
def test_demo_trains_and_matches_the_non_pipelined_step():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.cli", "demo", "--steps", "3", "--schedule", "interleaved-1f1b"],
        capture_output=True, text=True, timeout=280, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "rank 3 |" in out and "bubble" in out
    assert len(re.findall(r"^step \d/3  loss \d+\.\d+$", out, flags=re.M)) == 3
    diff = float(re.search(r"vs the same step without a pipeline: (\S+) \(OK", out).group(1))
    assert diff <= 1e-5


@pytest.mark.timeout(300)
def test_demo_on_mindspore_local_cluster():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.cli", "demo", "--backend", "mindspore", "--steps", "2",
         "--micro-batches", "4", "--batch-size", "8", "--schedule", "gpipe"],
        capture_output=True, text=True, timeout=280, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MindSpore LocalCluster ranks" in proc.stdout
    assert len(re.findall(r"^step \d/2  loss \d+\.\d+$", proc.stdout, flags=re.M)) == 2
    diff = float(re.search(r"vs the same step without a pipeline: (\S+) \(OK", proc.stdout).group(1))
    assert diff <= 1e-4


@pytest.mark.timeout(300)
def test_demo_on_mindspore_in_graph_mode_keeps_its_gradient_check():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.cli", "demo", "--backend", "mindspore", "--graph-mode", "--steps",
         "2", "--ranks", "2", "--micro-batches", "2", "--batch-size", "4"],
        capture_output=True, text=True, timeout=280, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "MindSpore LocalCluster ranks in GRAPH_MODE" in proc.stdout
    assert len(re.findall(r"^step \d/2  loss \d+\.\d+$", proc.stdout, flags=re.M)) == 2
    diff = float(re.search(r"vs the same step without a pipeline: (\S+) \(OK", proc.stdout).group(1))
    assert diff <= 1e-4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["interleaved-zb", "zbv", "dualpipev"])
def test_demo_worker_with_zero_bubble_schedules(schedule, capsys):
    # the demo's training job on LocalCluster ranks (what `demo --schedule` runs in gloo processes),
    # its chart included: V placement puts both tied embedding ends on rank 0
    from hyper_parallel.cli import main
    from hyper_parallel.demo import DemoOptions, train_worker
    from hyper_parallel.platform.local import LocalCluster

    assert main(["chart", "--schedule", schedule, "--ranks", "2", "--micro-batches", "4"]) == 0
    assert "rank 1 |" in capsys.readouterr().out
    opts = DemoOptions(schedule=schedule, ranks=2, steps=2, micro_batches=4, batch_size=4)
    results = LocalCluster(2, platform="torch").run(train_worker, opts, False)
    losses = next(r["losses"] for r in results if r["losses"])
    assert len(losses) == 2 and losses[1] < losses[0]
    assert results[0]["max_grad_diff"] <= 1e-5
