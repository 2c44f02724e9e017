"""Issue 21 on 2 real gloo processes (one torchrun job): ZB-H1, ZB-V and 1F1B with gradient hooks
at the dx/dW boundary in every stage and a loss function with parameters of its own, against the
non-pipelined model (losses, every gradient, hook calls, retained gradients)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import load_rank_results, run_torchrun
from issue21_gloo_worker import CASES, P
from split_hooks_harness import check

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("gloo_issue21")
    run_torchrun(os.path.join(HERE, "issue21_gloo_worker.py"), P, str(out), timeout=180)
    loaded = load_rank_results(out, P)
    assert [(d["rank"], d["world"]) for d in loaded] == [(r, P) for r in range(P)]
    return loaded


@pytest.mark.parametrize("name", list(CASES))
def test_gloo_with_hooks_and_loss_parameters_matches_non_pipelined(ranks, name):
    check(CASES[name], [d["results"][name] for d in ranks], P)
