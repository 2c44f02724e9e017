"""DeviceMesh and DTensor in a real 2-process msrun job on MindSpore's CPU build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mindspore")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORLD = 2
JOB_TIMEOUT_S = 180

pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)


def _msrun() -> str | None:
    local = Path(sys.executable).with_name("msrun")
    return str(local) if local.exists() else shutil.which("msrun")


def test_mesh_and_dtensor_in_an_msrun_job(tmp_path):
    from conftest import free_port

    msrun = _msrun()
    if msrun is None:
        pytest.skip("msrun is not installed")
    out_dir, log_dir = tmp_path / "out", tmp_path / "logs"
    out_dir.mkdir()
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # msrun runs `python`
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["HYPER_PARALLEL_PLATFORM"] = "mindspore"
    cmd = [msrun, f"--worker_num={WORLD}", f"--local_worker_num={WORLD}", f"--master_port={free_port()}",
           f"--log_dir={log_dir}", "--join=True", str(HERE / "dtensor_msrun_worker.py"), str(out_dir)]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"msrun job timed out after {JOB_TIMEOUT_S} s\n{exc.stdout}\n{exc.stderr}")
    files = [out_dir / f"rank_{r}.json" for r in range(WORLD)]
    if proc.returncode != 0 or not all(f.exists() for f in files):
        logs = "\n".join(f"--- {f.name} ---\n{f.read_text(errors='replace')[-4000:]}" for f in log_dir.glob("*.log"))
        pytest.fail(f"msrun job failed (rc={proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs}")
    for r, f in enumerate(files):
        res = json.loads(f.read_text())
        assert res["platform"] == "mindspore" and res["rank"] == r
        assert res["failures"] == [], "\n".join(res["failures"])
        assert res["dp_group"] == [0, 1]
        assert res["pp_group"].startswith(f"mesh dim 'pp': no group for ranks [{r}]: MindSpore's CPU build has no "
                                          "communication sub-groups")
