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
    expected = [("rank 0:", "RECV_B.s0.m0", "rank 1"), ("rank 1:", "RECV_F.s1.m0", "rank 0")]
    for outcome, names in zip(outcomes, expected):
        # The first rank to time out closes the gloo pair, so the other may see the closed connection.
        assert outcome["error"] in ("TimeoutError", "PeerError"), outcome
        assert all(name in outcome["message"] for name in names), outcome
    timeouts = [o for o in outcomes if o["error"] == "TimeoutError"]
    assert timeouts and all("within 3s" in o["message"] for o in timeouts), outcomes


@pytest.mark.timeout(300)
def test_peer_that_exited_is_reported_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_COMM_TIMEOUT", "120")
    run_torchrun(os.path.join(HERE, "gloo_timeout_worker.py"), 2, str(tmp_path), "exit", timeout=200)
    outcome = json.loads((tmp_path / "rank1.json").read_text())
    assert outcome["error"] == "PeerError", outcome  # a RuntimeError naming the peer and the step
    assert "rank 1: rank 0 failed or stopped while step RECV_META.s1.m0 waited for it" in outcome["message"]
