"""Swap and recompute inside pipeline schedules on 4 real gloo processes (one torchrun job)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import load_rank_results, run_torchrun
from gloo_activation_worker import CASES, P, job_for
from pp_harness import check_against_oracle, full_model_oracle, merged

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("gloo_activation")
    run_torchrun(os.path.join(HERE, "gloo_activation_worker.py"), P, str(out), timeout=300)
    loaded = load_rank_results(out, P)
    assert [d["rank"] for d in loaded] == list(range(P))
    return loaded


@pytest.mark.parametrize("name", list(CASES))
def test_matches_non_pipelined(ranks, name):
    job = job_for(name)
    results = [d["results"][name] for d in ranks]
    losses, grads = merged(results)
    assert len(losses) == 1 and len(losses[0]) == job.micro
    ref_loss, ref_grads = full_model_oracle("torch", job.config, job.tokens, job.targets)
    check_against_oracle("torch", losses[0], grads, ref_loss, ref_grads)
    stats = [r["stats"] for r in results]
    assert any(s["swapped"] for s in stats) and all(s["late_loads"] == 0 for s in stats), stats
