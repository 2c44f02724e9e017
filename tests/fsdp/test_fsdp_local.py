"""PP x DP and PP x FSDP on LocalCluster (mesh pp=2 x dp=2): torch (this library's sharding, as torch's
FSDP needs process groups) and MindSpore. The oracle is the whole model trained on one rank with the
whole batch (``dp_harness``): losses of every micro-batch of every replica, parameters after 3 steps."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from dp_harness import (
    TOL,
    UNUSED,
    Config,
    Trainer,
    arm_failure,
    check_clip,
    clip_checks,
    full_value,
    merged_params,
    oracle,
    replica_losses,
)

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import data_parallel
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

HERE = os.path.dirname(os.path.abspath(__file__))


def _train(cfg: Config) -> dict:
    trainer = Trainer(cfg)
    losses = trainer.train(range(cfg.steps))
    return {"losses": losses, "params": trainer.full_params(), "dp": trainer.dp_index, "pp": trainer.pp}


def _check_training(cfg: Config, results: list[dict]) -> None:
    ref_losses, ref_params, _ = oracle(cfg)
    tol = TOL[cfg.framework]
    for step in range(cfg.steps):
        np.testing.assert_allclose(replica_losses(results, cfg, step), ref_losses[step], **tol,
                                   err_msg=f"losses of step {step}")
    params = merged_params(results)
    assert set(params) == set(ref_params)
    for name, value in params.items():
        np.testing.assert_allclose(value, ref_params[name], **tol, err_msg=name)


@pytest.mark.parametrize("mode", ["fsdp", "dp"])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "gpipe", "zb-h1", "zbv"])
def test_torch_pipeline_with_data_parallel_matches_one_rank(mode, schedule):
    cfg = Config(mode=mode, schedule=schedule)
    _check_training(cfg, LocalCluster(4).run(_train, cfg))


def _sharded_rank(lookahead: int) -> dict:
    """Parameters live sharded between runs; gathered only inside one; collectives per run counted."""
    p = get_platform()
    trainer = Trainer(Config(mode="fsdp", schedule="interleaved", lookahead=lookahead))
    shapes_before = {n: tuple(p.shape(p.param_data(q))) for n, q in trainer.schedule.named_parameters().items()}
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for name in counts:
        original = getattr(p, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(p, name, counting)
    trainer.run(0)
    for name in counts:
        delattr(p, name)
    shapes_after = {n: tuple(p.shape(p.param_data(q))) for n, q in trainer.schedule.named_parameters().items()}
    order = [str(s) for s in trainer.schedule.exec_order[trainer.pp]]
    return {"before": shapes_before, "after": shapes_after, "counts": counts, "order": order}


@pytest.mark.parametrize("lookahead", [1, 2])
def test_sharded_between_runs_and_one_collective_of_each_kind_per_stage_per_run(lookahead):
    results = LocalCluster(4).run(_sharded_rank, lookahead)
    for r in results:
        assert r["before"] == r["after"]
        # weights (8, 8) are split in 2 row blocks, biases (8,) too; the (1, 8) gain stays whole
        assert all(shape[0] in (1, 4) for shape in r["before"].values()), r["before"]
        unshards = sum(1 for s in r["order"] if s.startswith("FSDP_UNSHARD"))
        # interleaved, 2 stages per rank: a window of 2 holds both for the whole run, a window of 1
        # gathers again at every switch between them
        assert unshards == 2 if lookahead == 2 else unshards > 2
        # one all-gather per unshard, one reduce-scatter per stage; the stage with the gain all-reduces it
        assert r["counts"]["all_gather"] == unshards
        assert r["counts"]["reduce_scatter"] == 2
        assert r["counts"]["all_reduce"] == (1 if any(s.endswith("s3") for s in r["order"]) else 0)


def _tied_rank(mode: str, framework: str) -> dict:
    p = get_platform()
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    trainer = Trainer(Config(framework=framework, mode=mode, tie=True), mesh)
    armed = arm_failure(trainer)
    armed["on"] = False
    trainer.run(0)
    trainer.update()  # a first good step: the failed run must give back these gradients
    armed["on"] = True
    before = {n: full_value(q, p.get_grad(q)) for n, q in trainer.schedule.named_parameters().items()}
    try:
        trainer.schedule.run(trainer.tensor(np.zeros((8, 8), np.float32)),
                             target=trainer.tensor(np.zeros((8, 8), np.float32)) if trainer.stages[-1].is_last
                             else None)
        failed = None
    except RuntimeError as exc:
        failed = str(exc)
    armed["on"] = False
    restored = {n: full_value(q, p.get_grad(q)) for n, q in trainer.schedule.named_parameters().items()}
    trainer.run(1)
    grads = trainer.full_grads()
    norm = hp.clip_grad_norm_(trainer.schedule, 0.05, mesh=mesh)
    clipped = trainer.full_grads()
    if p.rank == 3:
        grad = p.get_grad(trainer.params[0])
        p.set_grad(trainer.params[0], grad * float("inf"))
    finite = hp.grads_are_finite(trainer.schedule, mesh=mesh)
    inf_norm = hp.clip_grad_norm_(trainer.schedule, 0.05, mesh=mesh)
    return {"failed": failed, "before": before, "restored": restored, "grads": grads, "norm": norm,
            "clipped": clipped, "finite": finite, "inf_norm": inf_norm}


def _check_tied(cfg: Config, results: list[dict]) -> None:
    import torch

    assert all("injected failure" in r["failed"] for r in results), [r["failed"] for r in results]
    for r in results:
        for name, value in r["before"].items():
            np.testing.assert_array_equal(r["restored"][name], value, err_msg=f"{name} after the failed run")
    _, _, ref_grads = oracle(Config(framework=cfg.framework, mode=cfg.mode, tie=True, steps=2))
    tol = TOL[cfg.framework]
    grads = merged_params(results, "grads")
    assert set(grads) == set(ref_grads[1])
    for name, value in grads.items():
        np.testing.assert_allclose(value, ref_grads[1][name], **tol, err_msg=name)
    # torch's clip_grad_norm_ on the whole model (one tied weight) with the oracle's gradients
    names = [n for n in ref_grads[1] if n != "head.weight"]
    tensors = [torch.nn.Parameter(torch.zeros(ref_grads[1][n].shape)) for n in names]
    for t, n in zip(tensors, names):
        t.grad = torch.from_numpy(ref_grads[1][n].copy())
    ref_norm = float(torch.nn.utils.clip_grad_norm_(tensors, 0.05))
    for r in results:
        np.testing.assert_allclose(r["norm"], ref_norm, rtol=1e-5)
        assert r["norm"] == results[0]["norm"]
    clipped = merged_params(results, "clipped")
    for t, n in zip(tensors, names):
        np.testing.assert_allclose(clipped[n], t.grad.numpy(), **tol, err_msg=f"clipped {n}")
    assert [r["finite"] for r in results] == [False] * 4
    assert all(not np.isfinite(r["inf_norm"]) for r in results)


@pytest.mark.parametrize("mode", ["fsdp", "dp"])
def test_torch_tied_weight_failed_run_and_global_clipping(mode):
    cfg = Config(mode=mode, tie=True)
    _check_tied(cfg, LocalCluster(4).run(_tied_rank, mode, "torch"))


def _clip_rank(mode: str, dp_mesh_only: bool = False) -> dict:
    trainer = Trainer(Config(mode=mode, extra={"dp_mesh_only": dp_mesh_only}))
    trainer.run(0)
    out = clip_checks(trainer)
    try:  # bare parameters say nothing of the replicas: sharded ones cannot be counted
        hp.clip_grad_norm_(trainer.params, 1.0)
        out["iterable"] = None
    except ValueError as exc:
        out["iterable"] = str(exc)
    return out


@pytest.mark.parametrize("mode,dp_mesh_only", [("fsdp", False), ("dp", False), ("fsdp", True)])
def test_torch_clip_without_mesh_every_norm_type_and_non_finite_on_one_rank(mode, dp_mesh_only):
    """Without mesh= the schedule's data-parallel mesh is used (given whole, or only its dp dimension):
    the whole model's norm on every rank, for norm types 2, 1, 3 and inf, as torch's clip_grad_norm_
    gives; a nan or an inf on one rank is seen by all."""
    results = LocalCluster(4).run(_clip_rank, mode, dp_mesh_only)
    check_clip(results, oracle(Config(mode=mode, steps=1))[2][0], TOL["torch"])
    messages = [r["iterable"] for r in results]
    if mode == "fsdp":  # each rank names its first parameter that cannot be counted: cut, or kept whole
        assert all(m and ("is cut into 2 shards" in m or "is averaged over 2 data-parallel replicas" in m)
                   and "pass mesh=" in m for m in messages), messages
        assert "is cut into 2 shards" in messages[0], messages
    else:  # the iterable summed over the world counted every replica of a replicated gradient (sqrt(2) x the norm)
        assert all(m and "is averaged over 2 data-parallel replicas" in m and "pass mesh=" in m for m in messages), \
            messages


def _whole_params_iterable_rank() -> str | None:
    import torch

    mesh = hp.init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    module = torch.nn.Linear(3, 3)  # dimension 0 of 3 does not divide by 2: this library's FSDP keeps both whole
    hp.fully_shard(module, mesh)
    schedule = hp.ScheduleGPipe(hp.PipelineStage(module, 0, 1, mesh=mesh), 2, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    hp.data_parallel(schedule, mesh)
    schedule.run(torch.ones(4, 3) * (mesh.get_local_rank("dp") + 1), target=torch.zeros(4, 3))
    try:
        hp.clip_grad_norm_(schedule.parameters(), 1e9)
    except ValueError as exc:
        return str(exc)
    return None


def test_torch_clip_iterable_of_fsdp_parameters_kept_whole():
    """An iterable of a fully sharded stage's parameters that stay whole (averaged over the replicas, not cut):
    summed over the world they used to count once per replica, silently; they raise as sharded ones do."""
    messages = LocalCluster(2).run(_whole_params_iterable_rank)
    assert all(m and "is averaged over 2 data-parallel replicas" in m for m in messages), messages


def _dp_mesh_clip_rank(mode: str) -> dict:
    trainer = Trainer(Config(mode=mode, extra={"dp_mesh_only": True}))
    trainer.run(0)
    p = get_platform()
    dp_mesh = trainer.mesh["dp"]
    out = {"norm": hp.clip_grad_norm_(trainer.schedule, 1e9), "dp_mesh": hp.clip_grad_norm_(trainer.schedule, 1e9,
                                                                                              mesh=dp_mesh)}
    if p.rank == 3:  # a nan on one rank of the other stage than rank 0's
        grad = next(p.get_grad(q) for q in trainer.params if p.get_grad(q) is not None)
        p.local_tensor(grad).view(-1)[0] = float("nan")
    out["finite"] = hp.grads_are_finite(trainer.schedule, mesh=dp_mesh)
    try:  # a 1-D mesh over every rank, not naming its pipeline dimension: it cannot say which ranks are replicas
        hp.clip_grad_norm_(trainer.schedule, 1.0, mesh=hp.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
        out["world"] = None
    except ValueError as exc:
        out["world"] = str(exc)
    return out


@pytest.mark.parametrize("mode", ["fsdp", "dp"])
def test_torch_clip_with_the_dp_mesh_given_to_data_parallel(mode):
    """mesh= the 1-D dp mesh data_parallel got (no 'pp' dimension): summed over the pipeline too, as without
    mesh= (each pipeline rank used to get the norm of its own stage only, and clip by its own coefficient);
    grads_are_finite sees a nan on the other stage; a mesh without 'pp' spanning the pipeline raises."""
    results = LocalCluster(4).run(_dp_mesh_clip_rank, mode)
    assert [r["dp_mesh"] for r in results] == [results[0]["norm"]] * 4, results
    assert [r["finite"] for r in results] == [False] * 4
    assert all(r["world"] and "has no 'pp' dimension" in r["world"] for r in results), [r["world"] for r in results]


def _unused_rank(cfg: Config) -> dict:
    trainer = Trainer(cfg)
    losses = trainer.train(range(cfg.steps))
    return {"losses": losses, "params": trainer.full_params(), "grads": sorted(trainer.full_grads()),
            "dp": trainer.dp_index, "pp": trainer.pp}


@pytest.mark.parametrize("mode", ["fsdp", "dp"])
def test_torch_unused_parameter_keeps_no_gradient_and_adamw_leaves_it(mode):
    """A parameter no replica uses keeps grad None (AdamW's weight decay leaves it, as on one rank); one only
    the first replica uses gets the average with zeros from the other: both as the non-parallel step."""
    cfg = Config(mode=mode, extra={"unused": True, "adamw": 0.1})
    results = LocalCluster(4).run(_unused_rank, cfg)
    _check_training(cfg, results)
    last = [r for r in results if r["pp"] == cfg.pp - 1]
    for r in last:
        assert "never" not in r["grads"] and "never_row" not in r["grads"], r["grads"]
        assert "sometimes" in r["grads"] and "sometimes_row" in r["grads"], r["grads"]
    params = merged_params(results)
    for name in ("never", "never_row"):
        np.testing.assert_array_equal(params[name], np.full(UNUSED[name], 0.5, np.float32), err_msg=name)


def _eval_rank() -> list[float]:
    trainer = Trainer(Config(mode="fsdp"))
    x, y = trainer.tensor(np.ones((8, 8), np.float32)), trainer.tensor(np.zeros((8, 8), np.float32))
    out = trainer.schedule.eval(x, target=y if trainer.stages[-1].is_last else None)
    p = get_platform()
    sharded = all(p.shape(p.param_data(q))[0] in (1, 4) for q in trainer.params)
    return [float(v) for v in out or []] + [sharded]


def test_eval_gathers_and_frees_fully_sharded_stages():
    import torch
    from dp_harness import torch_module, torch_mse, weights

    results = LocalCluster(4).run(_eval_rank)
    assert all(r[-1] is True for r in results)
    model = torch_module(0, 1, weights(), False)
    ref = float(torch_mse(model(torch.ones(2, 8)), torch.zeros(2, 8)).detach())
    losses = [r[:-1] for r in results if len(r) > 1]
    assert len(losses) == 2
    for values in losses:
        np.testing.assert_allclose(values, [ref] * 4, rtol=1e-6)


def _error_rank(case: str) -> None:
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    trainer = Trainer(Config(mode="none"), mesh)
    if case == "twice":
        data_parallel(trainer.schedule, mesh)
        data_parallel(trainer.schedule, mesh)
    elif case == "dim":
        data_parallel(trainer.schedule, mesh, dim="data")
    elif case == "lookahead":
        data_parallel(trainer.schedule, mesh, lookahead=0)
    elif case == "group":
        other = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        stage = trainer.stages[0]
        hp.fully_shard(stage.submodule, other)  # sharded over ranks that are not this stage's replicas
        data_parallel(trainer.schedule, mesh)


@pytest.mark.parametrize("case,match", [
    ("twice", "already applied"),
    ("dim", "no dimension 'data'"),
    ("lookahead", "lookahead must be an int >= 1, got 0"),
    ("group", r"fully sharded over ranks \[\d, \d\], but the data-parallel dimension through rank \d is"),
])
def test_data_parallel_errors(case, match):
    with pytest.raises(Exception, match=match):
        LocalCluster(4).run(_error_rank, case)


def _ckpt_rank(path: str, phase: str) -> dict:
    cfg = Config(mode="fsdp", steps=4)
    trainer = Trainer(cfg)
    if phase == "save":
        losses = trainer.train(range(2))
        hp.save_checkpoint(path, trainer.schedule, trainer.optimizer, extra={"step": 2})
        losses += trainer.train(range(2, 4))
        extra = None
    else:
        extra = hp.load_checkpoint(path, trainer.schedule, trainer.optimizer)
        losses = [[], []] + trainer.train(range(2, 4))
    return {"losses": losses, "params": trainer.full_params(), "dp": trainer.dp_index, "pp": trainer.pp,
            "extra": extra}


def test_torch_checkpoint_per_rank_files_resume_bitwise(tmp_path):
    path = str(tmp_path / "ckpt")
    first = LocalCluster(4).run(_ckpt_rank, path, "save")
    assert sorted(os.listdir(path)) == ["COMMITTED.json"] + [f"rank{r}.pt" for r in range(4)]
    second = LocalCluster(4).run(_ckpt_rank, path, "load")
    cfg = Config(mode="fsdp", steps=4)
    assert [r["extra"] for r in second] == [{"step": 2}] * 4
    for step in (2, 3):
        assert replica_losses(second, cfg, step) == replica_losses(first, cfg, step)
    a, b = merged_params(first), merged_params(second)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


# ------------------------------------------------------------------------------------- MindSpore
def _ms_train_both(mode: str) -> dict:
    out = {}
    for schedule in ("1f1b", "interleaved"):
        out[schedule] = _train(Config(framework="mindspore", mode=mode, schedule=schedule))
    return out


@pytest.mark.parametrize("mode", ["fsdp", "dp"])
def test_mindspore_pipeline_with_data_parallel_matches_one_rank(mode):
    results = LocalCluster(4, platform="mindspore").run(_ms_train_both, mode)
    for schedule in ("1f1b", "interleaved"):
        _check_training(Config(framework="mindspore", mode=mode, schedule=schedule), [r[schedule] for r in results])


def test_mindspore_tied_weight_failed_run_and_global_clipping():
    cfg = Config(framework="mindspore", mode="fsdp", tie=True)
    _check_tied(cfg, LocalCluster(4, platform="mindspore").run(_tied_rank, "fsdp", "mindspore"))


def _ms_ckpt_rank(path: str, phase: str) -> dict:
    cfg = Config(framework="mindspore", mode="fsdp", steps=4)
    trainer = Trainer(cfg)
    if phase == "save":
        losses = trainer.train(range(2))
        hp.save_checkpoint(path, trainer.schedule, trainer.optimizer, extra={"step": 2})
        losses += trainer.train(range(2, 4))
    else:
        assert hp.load_checkpoint(path, trainer.schedule, trainer.optimizer) == {"step": 2}
        losses = [[], []] + trainer.train(range(2, 4))
    return {"losses": losses, "params": trainer.full_params(), "dp": trainer.dp_index, "pp": trainer.pp}


_MS_RESUME = """
import pickle, sys
sys.path.insert(0, {here!r})
from test_fsdp_local import _ms_ckpt_rank
from hyper_parallel.platform.local import LocalCluster
results = LocalCluster(4, platform="mindspore").run(_ms_ckpt_rank, {path!r}, "load")
with open({out!r}, "wb") as f:
    pickle.dump(results, f)
"""


def test_mindspore_checkpoint_resumes_bitwise_in_a_new_process(tmp_path):
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "resumed.pkl")
    first = LocalCluster(4, platform="mindspore").run(_ms_ckpt_rank, path, "save")
    assert sorted(os.listdir(path)) == sorted(["COMMITTED.json"] + [f"rank{r}.ckpt" for r in range(4)] +
                                              [f"rank{r}.extra.pkl" for r in range(4)])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), HERE]))
    subprocess.run([sys.executable, "-c", _MS_RESUME.format(here=HERE, path=path, out=out)], check=True,
                   timeout=600, env=env, cwd=str(tmp_path))
    with open(out, "rb") as f:
        second = pickle.load(f)
    cfg = Config(framework="mindspore", mode="fsdp", steps=4)
    for step in (2, 3):
        assert replica_losses(second, cfg, step) == replica_losses(first, cfg, step)
    a, b = merged_params(first), merged_params(second)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
