"""Every schedule on LocalCluster (torch and MindSpore) against the non-pipelined model."""

from __future__ import annotations

import numpy as np
import pytest
from pp_harness import (
    SCHEDULES,
    Job,
    batch,
    check_against_oracle,
    full_model_oracle,
    merged,
    run_job,
    small_config,
)

from hyper_parallel.platform.local import LocalCluster

P = 4
MICRO = [1, P - 1, P, 2 * P + 1]
FRAMEWORKS = ["torch", "mindspore"]


# torch carries the whole matrix; MindSpore (one run ~50x a torch run in PyNative) one micro-batch count per
# schedule, chosen so that together they still meet m = 1, a short round (m < p), m = p and m > 2p
MINDSPORE_MICRO = {"gpipe": 1, "1f1b": P - 1, "interleaved": 2 * P + 1, "looped_bfs": P}
CASES = [("torch", schedule, micro) for schedule in SCHEDULES for micro in MICRO] + [
    ("mindspore", schedule, micro) for schedule, micro in MINDSPORE_MICRO.items()
]


@pytest.mark.parametrize("framework, schedule, micro", CASES)
def test_schedule_matches_non_pipelined(framework, schedule, micro):
    config = small_config(n_layers=5 if SCHEDULES[schedule][1] > 1 else 3)
    tokens, targets = batch(config, 2 * micro)
    ref_loss, ref_grads = full_model_oracle(framework, config, tokens, targets)
    results = LocalCluster(P, platform=framework).run(run_job, Job(schedule, micro, config, tokens, targets))
    losses, grads = merged(results)
    assert len(losses[0]) == micro
    check_against_oracle(framework, losses[0], grads, ref_loss, ref_grads)
    # run() returns the losses only where the last stage lives
    last_rank = P - 1
    assert [bool(r["losses"][0]) for r in results] == [r == last_rank for r in range(P)]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tied_embeddings_and_two_tensor_boundary(framework):
    config = small_config(n_layers=5, tie_embeddings=True, two_tensor_boundary=True)
    tokens, targets = batch(config, 6)
    ref_loss, ref_grads = full_model_oracle(framework, config, tokens, targets)
    results = LocalCluster(P, platform=framework).run(run_job, Job("interleaved", 3, config, tokens, targets))
    losses, grads = merged(results)
    check_against_oracle(framework, losses[0], grads, ref_loss, ref_grads, tie=True)
    # the two copies of the tied weight carry the same (summed) gradient
    np.testing.assert_array_equal(grads["tok_emb"], grads["head.weight"])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_dyn_shape_sequence_length_changes_between_runs(framework):
    config = small_config()
    seqs = [5, 8, 3]
    data = [batch(config, 4, seq=s, seed=k) for k, s in enumerate(seqs)]
    job = Job("1f1b", 4, config, [d[0] for d in data], [d[1] for d in data], runs=len(seqs),
              stage_options={"dyn_shape": True}, options={"scale_grads": False})
    results = LocalCluster(P, platform=framework).run(run_job, job)
    losses, grads = merged(results)
    ref_grads_total = {}
    for k, (tokens, targets) in enumerate(data):
        ref_loss, ref_grads = full_model_oracle(framework, config, tokens, targets)
        np.testing.assert_allclose(np.mean(losses[k]), ref_loss, **{"rtol": 1e-5, "atol": 1e-5})
        for name, g in ref_grads.items():
            # scale_grads=False: per-micro-batch gradients are summed, and runs accumulate
            ref_grads_total[name] = ref_grads_total.get(name, 0) + g * 4
    for name, g in grads.items():
        np.testing.assert_allclose(g, ref_grads_total[name], rtol=1e-5, atol=1e-5, err_msg=name)
