"""NCCL answers batch_isend_irecv with one request for the whole batch; the torch communicator
paired requests with operations one to one and raised on any batch of two or more operations.
Now every operation of a coalesced batch gets a handle sharing the one request, marked
``coalesced`` (the runtime then does not wait for such a forward send early: the request also
covers receives posted ahead of their data). Checked on 2 real gloo processes with
batch_isend_irecv answering in NCCL's shape."""

from __future__ import annotations

import json
import os

import pytest
from conftest import run_torchrun

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(200)
def test_a_batch_answered_with_one_request_gives_a_handle_per_operation(tmp_path):
    run_torchrun(os.path.join(HERE, "coalesced_batch_gloo_worker.py"), 2, str(tmp_path), timeout=150)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        peer = 1 - rank
        assert result["handles"] == 4 and all(result["coalesced"]) and all(result["completed"])
        assert result["got"] == [[10.0 * peer + k] * 3 for k in range(2)]
