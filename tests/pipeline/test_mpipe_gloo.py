"""ScheduleMPipeTranspose on 4 real gloo processes (one torchrun job for every case) against the
non-pipelined model; and the multimodal example, short, with and without MPipe."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
from conftest import REPO_ROOT, load_rank_results, run_torchrun
from mpipe_gloo_worker import CASES, P
from mpipe_harness import check

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("mpipe_gloo")
    run_torchrun(os.path.join(HERE, "mpipe_gloo_worker.py"), P, str(out), timeout=500)
    loaded = load_rank_results(out, P)
    assert [d["rank"] for d in loaded] == list(range(P))
    return loaded


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gloo_matches_non_pipelined(ranks, case):
    check(case, [d["results"][case.name] for d in ranks], "torch")


def test_example_runs_short_with_and_without_mpipe(tmp_path):
    """With lr = 0 every step sees the same parameters and batch: the MPipe steps and the plain
    steps must print the same loss."""
    out = tmp_path / "summary.json"
    logs = run_torchrun(os.path.join(REPO_ROOT, "examples", "mpipe_multimodal.py"), 4, "--steps", "4", "--skip", "0",
                 "--dim", "16", "--image-size", "8", "--seq", "4", "--vocab", "16", "--encoder-layers", "2",
                 "--lr", "0", "--out", str(out), timeout=300)
    summary = json.loads(out.read_text())
    modes = [mode for mode, _ in summary["losses"]]
    assert modes == ["mpipe", "plain", "mpipe", "plain"]
    losses = [loss for _, loss in summary["losses"]]
    assert np.isfinite(losses).all()
    np.testing.assert_allclose(losses, losses[0], rtol=1e-5)
    assert len(summary["times"]["mpipe"]) == len(summary["times"]["plain"]) == 2
    assert "Warning" not in logs, logs
    if len(os.sched_getaffinity(0)) < 4:  # 4 ranks on fewer cores: the times come with the caveat
        assert "caveat: 4 processes share" in logs, logs
