"""DeviceMesh and DTensor in a real 2-process msrun job on MindSpore's CPU build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_msrun

pytest.importorskip("mindspore")

HERE = Path(__file__).resolve().parent
WORLD = 2
JOB_TIMEOUT_S = 180

pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 60)


def test_mesh_and_dtensor_in_an_msrun_job(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run_msrun(str(HERE / "dtensor_msrun_worker.py"), WORLD, str(out_dir), cwd=tmp_path, timeout=JOB_TIMEOUT_S)
    files = [out_dir / f"rank_{r}.json" for r in range(WORLD)]
    assert all(f.exists() for f in files), list(out_dir.iterdir())
    for r, f in enumerate(files):
        res = json.loads(f.read_text())
        assert res["platform"] == "mindspore" and res["rank"] == r
        assert res["failures"] == [], "\n".join(res["failures"])
        assert res["dp_group"] == [0, 1]
        assert res["pp_group"].startswith(f"mesh dim 'pp': no group for ranks [{r}]: MindSpore's CPU build has no "
                                          "communication sub-groups")
