"""Review of d72454a / a58b0bd (the leaner hand-over path).

A forward send whose output gradient "came back" is settled without a gloo wait
(``TorchHandle.settle_received``). When a stage's outputs are all non-differentiable (a frozen
first stage, as when fine-tuning with a frozen embedding), its output-gradient receive carries no
tensor: it "arrives" at once, before the peer has even posted the receive of the forward output.
Dropping a gloo send that has not been received cancels it: the peer waits for the activation
until the communication timeout. Before d72454a the send was waited for and the run matched the
non-pipelined oracle.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import load_rank_results, run_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_frozen_first_stage_on_gloo_matches_the_oracle(tmp_path, monkeypatch, schedule, transport):
    # a lost activation shows as a receive timeout on rank 1 well within the job's timeout
    monkeypatch.setenv("HYPER_PARALLEL_COMM_TIMEOUT", "20")
    run_torchrun(os.path.join(HERE, "review11_frozen_first_gloo_worker.py"), 2, str(tmp_path), schedule, transport,
                 timeout=150)
    results = load_rank_results(tmp_path, 2)
    ref = results[1]["ref"]
    for run in results[1]["runs"]:
        np.testing.assert_allclose(run["losses"], ref["losses"], rtol=1e-5, atol=1e-6)
        assert set(run["grads"]) == set(ref["grads"])
        for name, grad in run["grads"].items():
            np.testing.assert_allclose(grad.numpy(), ref["grads"][name].numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
