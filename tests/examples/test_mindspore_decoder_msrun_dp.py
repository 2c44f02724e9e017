"""examples/mindspore_decoder.py as a real 2-process msrun job on MindSpore's CPU build (``--launcher
msrun-dp``): two data-parallel replicas, each a 2-rank pipeline on a LocalCluster, average their
gradients with the world all-reduce. Oracle: the same steps with one replica over the whole batch
(the local launcher) give the same losses, step after step (so the averaged update is the same)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT, run_msrun

pytest.importorskip("mindspore")

WORLD = 2
JOB_TIMEOUT_S = 300
SHORT = ["--steps", "2", "--layers", "2", "--dim", "16", "--seq", "8", "--vocab", "32", "--batch", "4",
         "--micro-batches", "2", "--ranks", "2"]

pytestmark = pytest.mark.timeout(JOB_TIMEOUT_S + 120)


def test_msrun_data_parallel_replicas_match_one_replica(tmp_path):
    example = Path(REPO_ROOT) / "examples" / "mindspore_decoder.py"
    report = tmp_path / "dp.json"
    run_msrun(str(example), WORLD, *SHORT, "--launcher", "msrun-dp", "--report", str(report), cwd=tmp_path,
              timeout=JOB_TIMEOUT_S)
    replicated = json.loads(report.read_text())["losses"]

    sys.path.insert(0, str(Path(REPO_ROOT) / "examples"))
    try:
        import mindspore_decoder
    finally:
        sys.path.pop(0)
    single = mindspore_decoder.main(SHORT)  # one replica, the whole batch, the same micro-batch size x 2
    assert len(replicated) == len(single) == 2
    np.testing.assert_allclose(replicated, single, rtol=1e-4, atol=1e-6)
