"""examples/mindspore_decoder.py as a real 2-process msrun job on MindSpore's CPU build (``--launcher
msrun-dp``): two data-parallel replicas, each a 2-rank pipeline on a LocalCluster, average their
gradients with the world all-reduce. Oracle: the same steps with one replica over the whole batch
(the local launcher) give the same losses, step after step (so the averaged update is the same)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT, free_port

pytest.importorskip("mindspore")

WORLD = 2
JOB_TIMEOUT_S = 300
SHORT = ["--steps", "2", "--layers", "2", "--dim", "16", "--seq", "8", "--vocab", "32", "--batch", "4",
         "--micro-batches", "2", "--ranks", "2"]

pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 120)


def _msrun() -> str | None:
    local = Path(sys.executable).with_name("msrun")
    return str(local) if local.exists() else shutil.which("msrun")


def test_msrun_data_parallel_replicas_match_one_replica(tmp_path):
    msrun = _msrun()
    if msrun is None:
        pytest.skip("msrun is not installed")
    example = Path(REPO_ROOT) / "examples" / "mindspore_decoder.py"
    report, log_dir = tmp_path / "dp.json", tmp_path / "logs"
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # msrun runs `python`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["HYPER_PARALLEL_PLATFORM"] = "mindspore"
    cmd = [msrun, f"--worker_num={WORLD}", f"--local_worker_num={WORLD}", f"--master_port={free_port()}",
           f"--log_dir={log_dir}", "--join=True", str(example), *SHORT, "--launcher", "msrun-dp",
           "--report", str(report)]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"msrun job timed out after {JOB_TIMEOUT_S} s\n{exc.stdout}\n{exc.stderr}")
    if proc.returncode != 0 or not report.exists():
        logs = "\n".join(f"--- {f.name} ---\n{f.read_text(errors='replace')[-4000:]}" for f in log_dir.glob("*.log"))
        pytest.fail(f"msrun job failed (rc={proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs}")
    replicated = json.loads(report.read_text())["losses"]

    sys.path.insert(0, str(Path(REPO_ROOT) / "examples"))
    try:
        import mindspore_decoder
    finally:
        sys.path.pop(0)
    single = mindspore_decoder.main(SHORT)  # one replica, the whole batch, the same micro-batch size x 2
    assert len(replicated) == len(single) == 2
    np.testing.assert_allclose(replicated, single, rtol=1e-4, atol=1e-6)
