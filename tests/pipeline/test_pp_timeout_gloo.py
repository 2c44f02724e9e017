"""A peer that never sends fails the step after the configured timeout, naming the step and the peer."""

import json
import os

import pytest
from conftest import run_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(300)
def test_missing_send_fails_after_the_timeout_on_gloo(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_COMM_TIMEOUT", "3")
    run_torchrun(os.path.join(HERE, "gloo_timeout_worker.py"), 2, str(tmp_path), "silent", timeout=200)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = ["rank 0: step RECV_B.s0.m0 waiting on rank 1 failed", "rank 1: step RECV_F.s1.m0 waiting on rank 0 failed"]
    for outcome, names in zip(outcomes, expected):
        # The first rank to time out closes the gloo pair, so the other may see the closed connection.
        assert outcome["error"] in ("TimeoutError", "RuntimeError"), outcome
        assert names in outcome["message"], outcome
    timeouts = [o for o in outcomes if o["error"] == "TimeoutError"]
    assert timeouts and all("within 3s" in o["message"] for o in timeouts), outcomes


@pytest.mark.timeout(300)
def test_peer_that_exited_is_reported_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_COMM_TIMEOUT", "120")
    run_torchrun(os.path.join(HERE, "gloo_timeout_worker.py"), 2, str(tmp_path), "exit", timeout=200)
    outcome = json.loads((tmp_path / "rank1.json").read_text())
    assert outcome["error"] == "RuntimeError", outcome
    assert "rank 1: step RECV_F.s1.m0 waiting on rank 0 failed" in outcome["message"]
    assert "did the peer rank die?" in outcome["message"]
