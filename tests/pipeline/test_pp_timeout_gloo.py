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


@pytest.mark.timeout(300)
def test_a_stage_that_raises_fails_the_other_ranks_at_once_naming_it(tmp_path, monkeypatch):
    # 3 gloo ranks. First a healthy run with 60 tensors across each stage boundary (dyn_shape, batch
    # transport: metadata messages far over 128 ints) against the non-pipelined chain; then rank 1's
    # stage raises in its forward of micro-batch 2. The communication timeout (300 s) is longer
    # than the whole job may take (150 s): ranks 0 and 2 must learn of the failure from rank 1's
    # closed connections, not from a timeout, and name rank 1.
    import numpy as np

    monkeypatch.setenv("HYPER_PARALLEL_COMM_TIMEOUT", "300")
    run_torchrun(os.path.join(HERE, "gloo_timeout_worker.py"), 3, str(tmp_path), "raise", timeout=150)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for rank, outcome in enumerate(outcomes):
        many = outcome["many"]
        assert many["meta_ints"] > 128, many["meta_ints"]
        np.testing.assert_allclose(many["grad"], many["ref_grad"], rtol=1e-5, atol=1e-7, err_msg=f"rank {rank}")
    np.testing.assert_allclose(outcomes[2]["many"]["losses"], outcomes[2]["many"]["ref_losses"], rtol=1e-6)
    assert outcomes[1]["error"] == "StageError" and outcomes[1]["cause"] == "ValueError", outcomes[1]
    assert outcomes[1]["message"].startswith("rank 1: the forward of stage 1 on micro-batch 2 (F.s1.m2) failed: "
                                             "ValueError: this stage cannot take micro-batch 2"), outcomes[1]
    for rank in (0, 2):
        assert outcomes[rank]["error"] == "PeerError", outcomes[rank]  # not TimeoutError
        assert outcomes[rank]["message"].startswith(f"rank {rank}: rank 1 failed or stopped while step "), outcomes[rank]
