"""PP x FSDP (torch's own FSDP2) and PP x DP on real torch.distributed gloo processes, mesh pp=2 x dp=2.

Each job is one torchrun of ``fsdp_gloo_worker.py`` (checks combined per job: every job costs ~15 s).
The oracle is the whole model trained in this process on the whole batch (``dp_harness``).
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from conftest import run_torchrun
from dp_harness import TOL, UNUSED, Config, check_clip, merged_params, oracle, replica_losses

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fsdp_gloo_worker.py")


def _job(tmp_path, *args: str) -> list[dict]:
    out = str(tmp_path / f"{args[0]}.pkl")
    run_torchrun(WORKER, 4, args[0], out, *args[1:], timeout=300)
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _job(tmp_path_factory.mktemp("train"), "train")


@pytest.mark.parametrize("mode", ["fsdp", "dp"])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_three_steps_match_one_rank(trained, mode, schedule):
    cfg = Config(mode=mode, schedule=schedule)
    results = [r[(mode, schedule)] for r in trained]
    ref_losses, ref_params, _ = oracle(cfg)
    for step in range(cfg.steps):
        np.testing.assert_allclose(replica_losses(results, cfg, step), ref_losses[step], **TOL["torch"],
                                   err_msg=f"losses of step {step}")
    params = merged_params(results)
    assert set(params) == set(ref_params)
    for name, value in params.items():
        np.testing.assert_allclose(value, ref_params[name], **TOL["torch"], err_msg=name)


@pytest.mark.parametrize("schedule,stages_per_rank", [("1f1b", 1), ("interleaved", 2)])
def test_one_gradient_collective_per_stage_per_run(trained, schedule, stages_per_rank):
    """Counted by the torch profiler over one run of 4 micro-batches: FSDP reduce-scatters (and gathers)
    once per stage, DP all-reduces once per stage; never once per micro-batch."""
    for r in trained:
        fsdp, dp = r[("fsdp", schedule)]["counts"], r[("dp", schedule)]["counts"]
        assert fsdp == {"c10d::_reduce_scatter_base_": stages_per_rank, "c10d::_allgather_base_": stages_per_rank,
                        "c10d::allreduce_": 0}
        assert dp == {"c10d::_reduce_scatter_base_": 0, "c10d::_allgather_base_": 0,
                      "c10d::allreduce_": stages_per_rank}


@pytest.mark.parametrize("mode", ["fsdp", "dp"])
def test_tied_weight_failed_run_clipping_and_non_finite(trained, mode):
    results = [r[(mode, "tied")] for r in trained]
    for r in results:  # each rank reports its own stage's forward
        assert f"the forward of stage {r['pp']} on micro-batch {3 - r['pp']}" in r["failed"], r["failed"]
        assert f"injected failure in stage {r['pp']}" in r["failed"]
    assert all(r["no_grads_after_failure"] for r in results)
    cfg = Config(mode=mode, tie=True, steps=1)
    _, _, ref_grads = oracle(cfg)
    grads = merged_params(results, "grads")
    assert set(grads) == set(ref_grads[0])
    for name, value in grads.items():
        np.testing.assert_allclose(value, ref_grads[0][name], **TOL["torch"], err_msg=name)
    names = [n for n in ref_grads[0] if n != "head.weight"]  # the non-pipelined model holds the tie once
    tensors = [torch.nn.Parameter(torch.zeros(ref_grads[0][n].shape)) for n in names]
    for t, n in zip(tensors, names):
        t.grad = torch.from_numpy(ref_grads[0][n].copy())
    ref_norm = float(torch.nn.utils.clip_grad_norm_(tensors, 0.05))
    assert len({r["norm"] for r in results}) == 1
    np.testing.assert_allclose(results[0]["norm"], ref_norm, rtol=1e-6)
    clipped = merged_params(results, "clipped")
    for t, n in zip(tensors, names):
        np.testing.assert_allclose(clipped[n], t.grad.numpy(), **TOL["torch"], err_msg=f"clipped {n}")
    assert [r["finite"] for r in results] == [False] * 4  # only rank 3 holds the inf
    assert all(r["inf_norm"] == float("inf") for r in results)


@pytest.mark.parametrize("mode", ["fsdp", "dp"])
def test_clip_without_mesh_every_norm_type_and_non_finite_on_one_rank(trained, mode):
    """torch's FSDP2 and DP over gloo, clip_grad_norm_ without mesh=: the whole model's norm on every rank for
    norm types 2, 1, 3, inf; a nan on one rank gives nan everywhere (gloo's max alone would drop it)."""
    check_clip([r[(mode, "clip")] for r in trained], oracle(Config(mode=mode, steps=1))[2][0], TOL["torch"])


@pytest.mark.parametrize("mode,unused", [("dp", True), ("fsdp", "never")])
def test_unused_parameter_keeps_no_gradient_and_adamw_leaves_it(trained, mode, unused):
    """DP: parameters no replica uses keep grad None, one only the first replica uses is averaged with
    zeros; torch's FSDP2 (parameters no replica uses): the same, as the non-parallel AdamW step."""
    cfg = Config(mode=mode, extra={"unused": unused, "adamw": 0.1})
    results = [r[(mode, "unused")] for r in trained]
    ref_losses, ref_params, _ = oracle(cfg)
    for step in range(cfg.steps):
        np.testing.assert_allclose(replica_losses(results, cfg, step), ref_losses[step], **TOL["torch"])
    params = merged_params(results)
    assert set(params) == set(ref_params)
    for name, value in params.items():
        np.testing.assert_allclose(value, ref_params[name], **TOL["torch"], err_msg=name)
    for name in ("never", "never_row"):
        np.testing.assert_array_equal(params[name], np.full(UNUSED[name], 0.5, np.float32), err_msg=name)
    for r in results:
        if r["pp"] == cfg.pp - 1:
            assert "never" not in r["grads"] and "never_row" not in r["grads"], r["grads"]
            assert ("sometimes" in r["grads"]) == (unused is True), r["grads"]


def test_checkpoint_resumes_bitwise_in_new_processes_and_reshards(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = _job(tmp_path, "save", ckpt)
    second = _job(tmp_path, "resume", ckpt)
    cfg = Config(mode="fsdp", steps=4)
    assert [r["extra"] for r in second] == [{"step": 2}] * 4
    for step in (2, 3):  # steps 3 and 4, bit for bit
        assert replica_losses(second, cfg, step) == replica_losses(first, cfg, step)
    a, b = merged_params(first), merged_params(second)
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    # the same checkpoint on pp=4 x dp=1: every parameter as saved, and training goes on the same way
    saved, resharded = merged_params(first, "at_save"), merged_params(second, "resharded")
    assert set(saved) == set(resharded)
    for name in saved:
        np.testing.assert_array_equal(resharded[name], saved[name], err_msg=name)
    losses = [r["other_losses"] for r in second if r["other_losses"][2]]
    assert len(losses) == 1
    for step in (2, 3):  # micro-batches of the same 2 rows; Adam's state came along with the parameters
        np.testing.assert_allclose(losses[0][step], replica_losses(first, cfg, step), **TOL["torch"])


def test_checkpoint_failures_raise_on_every_rank_and_batchnorm_dropout_resume_bitwise(tmp_path):
    """torch.distributed.checkpoint with FSDP2 (``ckpt_safety_gloo_worker.py``): failed saves keep the
    previous checkpoint, damaged or mismatched loads raise one error on every rank without entering the
    collective read, a BatchNorm + dropout stage with a frozen parameter resumes bit for bit, and each
    rank gets back the ``extra`` it saved."""
    base = tmp_path / "base"
    base.mkdir()
    out = str(tmp_path / "out.pkl")
    run_torchrun(os.path.join(HERE, "ckpt_safety_gloo_worker.py"), 4, out, str(base), timeout=300)
    with open(out, "rb") as f:
        results = pickle.load(f)
    fails = [r["failures"] for r in results]
    for case, rank, words in (("engine", 1, "__1_0.distcp"), ("flush", 2, "No space left on device")):
        messages = {f[case]["error"] for f in fails}
        assert len(messages) == 1 and None not in messages, (case, messages)
        message = messages.pop()
        assert f"rank {rank}: " in message and words in message, message
    assert fails[1]["engine"]["cause"] == "CheckpointException"  # torch's error kept as the cause
    assert fails[0]["kept"] and fails[0]["listing"] == ["ckpt"]  # the step-2 checkpoint as it was
    for case in ("truncated", "deleted"):
        messages = {f[case]["error"] for f in fails}
        assert len(messages) == 1 and None not in messages, (case, messages)
        assert f"{case}/__1_0.distcp" in messages.pop()
        assert all(f[case]["unchanged"] for f in fails)
    messages = {f["lacks"]["error"] for f in fails}
    assert len(messages) == 1 and None not in messages and "entries the model lacks: model.gain" in messages.pop()
    assert [f["resumed"] for f in fails] == [{"step": 2}] * 4
    # torch.distributed.checkpoint keeps one copy of a key all ranks write: each rank's extra is its own
    assert [r["own_extra"] for r in results] == [{"rank": r, "position": 100 + r} for r in range(4)]
    for r in results:
        first, second = r["bn_first"], r["bn_second"]
        assert first["losses"] == second["losses"]
        assert first["state"].keys() == second["state"].keys()
        for k in first["state"]:
            assert torch.equal(first["state"][k], second["state"][k]), k
