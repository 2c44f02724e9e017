"""overlap_b_f on 4 real gloo processes (pp=2 x ep=2, the MoE model of examples/moe_overlap.py):
bitwise the same losses and gradients as without it, both equal to the non-pipelined oracle; and the
example itself, run as written with short settings."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import REPO_ROOT, load_rank_results, run_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("moe_gloo")
    run_torchrun(os.path.join(HERE, "moe_gloo_worker.py"), WORLD, str(out), "4", timeout=400)
    loaded = load_rank_results(out, WORLD)
    assert [d["rank"] for d in loaded] == list(range(WORLD))
    return [d["results"] for d in loaded]


def test_overlap_pairs_were_run(ranks):
    """The 'on' schedule holds OVERLAP_B_F steps on every pipeline rank, the 'off' one none."""
    for results in ranks:
        on = [s for steps in results["on"]["exec_order"].values() for s in steps]
        off = [s for steps in results["off"]["exec_order"].values() for s in steps]
        assert sum(s.startswith("OVERLAP_B_F[") for s in on) == 4  # p=2, v=2, m=4: 2 pairs per rank
        assert not any(s.startswith("OVERLAP") for s in off)


def test_overlap_b_f_is_bitwise_equal_to_no_overlap(ranks):
    for results in ranks:
        on, off = results["on"], results["off"]
        assert on["losses"] == off["losses"]
        assert sorted(on["grads"]) == sorted(off["grads"]) and on["grads"]
        for name, grad in off["grads"].items():
            assert np.array_equal(on["grads"][name], grad), name


@pytest.mark.parametrize("mode", ["off", "on"])
def test_pipelined_matches_non_pipelined_oracle(ranks, mode):
    last = [r for r in ranks if r[mode]["losses"]]
    assert len(last) == 2  # the two ranks holding the last stage (one per ep rank)
    for results in ranks:
        got, ref = results[mode], results["oracle"]
        if got["losses"]:
            np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=1e-7)
        assert sorted(got["grads"]) == sorted(ref["grads"])
        for name, want in ref["grads"].items():
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got["grads"][name], want, rtol=1e-5, atol=1e-7 * scale, err_msg=name)


def test_example_runs_as_written_with_short_settings(tmp_path):
    """Four steps alternating plain / overlap_b_f on the same stages: two of each, every loss
    finite, the last stage's ranks print them, the report adds up."""
    out = tmp_path / "report"
    logs = run_torchrun(os.path.join(REPO_ROOT, "examples", "moe_overlap.py"), WORLD, "--width", "16", "--hidden", "32",
                 "--tokens", "4", "--micro-batches", "4", "--steps", "4", "--out", str(out), timeout=300)
    reports = [json.loads((tmp_path / f"report.rank{r}.json").read_text()) for r in range(WORLD)]
    for report in reports:
        assert list(report["phases"]) == ["no overlap", "overlap_b_f"]
        assert [len(rows) for rows in report["phases"].values()] == [2, 2]
        assert report["hidden"] == pytest.approx(report["all_to_all"] - report["exposed"])
    losses = [row["loss"] for r in reports[2:] for rows in r["phases"].values() for row in rows]
    assert len(losses) == 8 and np.isfinite(losses).all()
    assert "Warning" not in logs, logs
    if len(os.sched_getaffinity(0)) < WORLD:  # more ranks than cores: every rank's times come with the caveat
        assert all(f"rank {r}: caveat: {WORLD} processes share" in logs for r in range(WORLD)), logs
