"""The main job runs end to end and its gradient check passes (torch gloo processes)."""

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
