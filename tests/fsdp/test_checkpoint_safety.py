"""Checkpoints that never lose or mix data, on a LocalCluster (torch: per-rank files, the library's FSDP;
MindSpore: per-rank ``.ckpt`` files): a save that fails on one rank at any step raises on every rank and
leaves the previous checkpoint byte for byte; a load that would fail on one rank raises the same error
on every rank and changes nothing; entries must match (``strict``); buffers, frozen parameters and the
random state resume bit for bit."""

from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import pytest
from dp_harness import Config, Trainer

import hyper_parallel as hp
from hyper_parallel.core.checkpoint import atomic
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

CheckpointError = hp.CheckpointError


def _tree(path: str) -> dict[str, bytes]:
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), path)] = fh.read()
    return out


def _fail_on(rank: int, real, error: OSError | None = None):
    def patched(*args, **kwargs):
        if get_platform().rank == rank:
            raise error or OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(*args, **kwargs)

    return patched


def _torch_optimizer_state(optimizer) -> dict:
    return {(i, name): (v.clone() if hasattr(v, "clone") else v)
            for i, state in enumerate(optimizer.state.values()) for name, v in state.items()}


def _same_optimizer_state(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


# ----------------------------------------------------------------------------------- atomic save
def _save_twice_rank(path: str) -> dict:
    trainer = Trainer(Config(mode="fsdp", steps=4))
    trainer.train(range(2))
    hp.save_checkpoint(path, trainer.schedule, trainer.optimizer, extra={"step": 2})
    trainer.train(range(2, 3))
    error = None
    try:
        hp.save_checkpoint(path, trainer.schedule, trainer.optimizer, extra={"step": 3})
    except CheckpointError as exc:
        error = exc
    return {"error": str(error) if error else None, "is_exception": isinstance(error, Exception),
            "cause": type(error.__cause__).__name__ if error is not None and error.__cause__ is not None else None}


@pytest.mark.parametrize("where,rank,seam", [
    ("write", 1, ("hyper_parallel.platform.torch.checkpoint", "write_rank_file")),
    ("flush", 2, ("hyper_parallel.core.checkpoint.atomic", "file_digest")),
    ("commit", 0, ("hyper_parallel.core.checkpoint.atomic", "_commit")),
])
def test_failed_save_raises_everywhere_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where, rank, seam):
    import importlib

    path = str(tmp_path / "ckpt")
    module = importlib.import_module(seam[0])
    real = getattr(module, seam[1])
    armed = {"on": False}

    def seam_fn(*args, **kwargs):
        if armed["on"] and get_platform().rank == rank:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, seam[1], seam_fn)
    before: dict[str, bytes] = {}

    real_seal = atomic.seal

    def seal(p, target, folder, *args):
        real_seal(p, target, folder, *args)
        p.barrier()
        if p.rank == 0:
            before.update(_tree(target))
        p.barrier()
        armed["on"] = True  # the second save fails

    monkeypatch.setattr(atomic, "seal", seal)
    results = LocalCluster(4).run(_save_twice_rank, path)
    armed["on"] = False
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and None not in messages, messages  # every rank raised the same error
    message = messages.pop()
    assert f"rank {rank}: " in message and "No space left on device" in message, message
    assert results[rank]["is_exception"] and results[rank]["cause"] == "OSError"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary folder left behind
    assert _tree(path) == before  # the step-2 checkpoint, byte for byte
    loaded = LocalCluster(4).run(_load_extra_rank, path)
    assert loaded == [{"step": 2}] * 4


def _load_extra_rank(path: str) -> dict:
    trainer = Trainer(Config(mode="fsdp", steps=4))
    return hp.load_checkpoint(path, trainer.schedule, trainer.optimizer)


def _save_rank(path: str, steps: int) -> dict:
    trainer = Trainer(Config(mode="fsdp", steps=4))
    trainer.train(range(steps))
    try:
        hp.save_checkpoint(path, trainer.schedule, trainer.optimizer, extra={"step": steps})
    except CheckpointError as exc:
        return {"error": str(exc)}
    return {"error": None}


@pytest.mark.parametrize("obstacle", ["file", "unmarked folder"])
def test_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path, obstacle):
    path = tmp_path / "ckpt"
    if obstacle == "file":
        path.write_text("mine")
    else:
        path.mkdir()
        (path / "notes.txt").write_text("mine")
    results = LocalCluster(4).run(_save_rank, str(path), 1)
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and None not in messages
    assert "rank 0: " in messages.pop()
    assert (path.read_text() if obstacle == "file" else (path / "notes.txt").read_text()) == "mine"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def _foreign_optimizer_rank(path: str) -> str | None:
    import torch

    trainer = Trainer(Config(mode="fsdp", steps=4))
    params = list(trainer.params) + ([torch.nn.Parameter(torch.zeros(3))] if get_platform().rank == 2 else [])
    try:
        hp.save_checkpoint(path, trainer.schedule, torch.optim.Adam(params))
    except CheckpointError as exc:
        return str(exc)
    return None


def test_a_rank_that_cannot_collect_its_state_fails_the_save_everywhere(tmp_path):
    messages = set(LocalCluster(4).run(_foreign_optimizer_rank, str(tmp_path / "ckpt")))
    assert len(messages) == 1 and None not in messages
    message = messages.pop()
    assert "rank 2: " in message and "not a parameter of the model" in message, message
    assert os.listdir(tmp_path) == []


def _keep_rank(parent: str) -> list:
    trainer = Trainer(Config(mode="fsdp", steps=4))
    seen = []
    for step in range(1, 5):
        trainer.train(range(step - 1, step))
        hp.save_checkpoint(os.path.join(parent, f"step{step}"), trainer.schedule, trainer.optimizer,
                           extra={"step": step}, keep=2)
        get_platform().barrier()
        seen.append(sorted(os.listdir(parent)))
    fresh = Trainer(Config(mode="fsdp", steps=4))
    seen.append(hp.load_checkpoint(hp.latest_checkpoint(parent), fresh.schedule, fresh.optimizer))
    return seen


def test_keep_prunes_older_checkpoints_and_latest_names_the_newest(tmp_path):
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    assert hp.latest_checkpoint(str(tmp_path)) is None
    results = LocalCluster(4).run(_keep_rank, str(tmp_path))
    assert results[0][:4] == [["latest", "notes", "step1"], ["latest", "notes", "step1", "step2"],
                              ["latest", "notes", "step2", "step3"], ["latest", "notes", "step3", "step4"]]
    assert [r[4] for r in results] == [{"step": 4}] * 4
    assert (tmp_path / "latest").read_text() == "step4\n"
    assert hp.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step4")
    with pytest.raises(ValueError, match="keep must be an int >= 1 or None, got 0"):
        hp.save_checkpoint(str(tmp_path / "x"), torch_linear(), keep=0)


def torch_linear():
    import torch

    return torch.nn.Linear(2, 2)


# ------------------------------------------------------------------------------ transactional load
def _load_rank(path: str, strict: bool = True, tweak: str | None = None) -> dict:
    import torch

    trainer = Trainer(Config(mode="fsdp", steps=4))
    trainer.train(range(1))  # the state a failed load must leave alone (optimizer states exist)
    if tweak == "reshape" and get_platform().rank == 3:
        trainer.stages[0].submodule.gain.data = torch.zeros(1, 9)  # the same parameter, another shape
    if tweak == "lacks" and trainer.pp == 1:
        del trainer.stages[0].submodule.gain  # the checkpoint holds a parameter this model lacks
        trainer.optimizer = torch.optim.Adam(trainer.stages[0].submodule.parameters(), lr=trainer.cfg.lr)
    params, state = trainer.full_params(), _torch_optimizer_state(trainer.optimizer)
    error, extra = None, None
    try:
        extra = hp.load_checkpoint(path, trainer.schedule, trainer.optimizer, **({} if strict else {"strict": False}))
    except CheckpointError as exc:
        error = str(exc)
    after = trainer.full_params()
    unchanged = all(np.array_equal(after[k], params[k]) for k in params) and _same_optimizer_state(
        state, _torch_optimizer_state(trainer.optimizer))
    return {"error": error, "unchanged": unchanged, "extra": extra}


def _damage(path: str, how: str, other: str) -> str:
    """Damage the checkpoint ``path``; returns the file the error must name."""
    victim = os.path.join(path, "rank1.pt")
    if how == "truncated":
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    elif how == "deleted":
        os.remove(victim)
    elif how == "foreign":  # rank 1's file of a checkpoint of another step, of the same size
        shutil.copy(os.path.join(other, "rank1.pt"), victim)
    elif how == "no marker":
        os.remove(os.path.join(path, atomic.MARKER))
        return atomic.MARKER
    return victim


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("saved")
    LocalCluster(4).run(_save_rank, str(base / "step2"), 2)
    LocalCluster(4).run(_save_rank, str(base / "step3"), 3)
    return base


@pytest.mark.parametrize("how", ["truncated", "deleted", "foreign", "no marker"])
def test_damaged_checkpoint_raises_on_every_rank_and_changes_nothing(saved, tmp_path, how):
    path = str(tmp_path / "ckpt")
    shutil.copytree(saved / "step2", path)
    named = _damage(path, how, str(saved / "step3"))
    results = LocalCluster(4).run(_load_rank, path)
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and None not in messages, messages
    assert named in messages.pop()
    assert all(r["unchanged"] for r in results)


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_a_read_failure_on_one_rank_raises_everywhere_and_changes_nothing(saved, tmp_path, monkeypatch, framework):
    if framework == "torch":
        from hyper_parallel.platform.torch import checkpoint as module

        path, run = str(saved / "step2"), lambda: LocalCluster(4).run(_load_rank, path)
    else:
        from hyper_parallel.platform.mindspore import checkpoint as module

        path = str(tmp_path / "ckpt")
        LocalCluster(4, platform="mindspore").run(_ms_rank, path, "save")
        run = lambda: LocalCluster(4, platform="mindspore").run(_ms_rank, path, "load")  # noqa: E731
    monkeypatch.setattr(module, "read_rank_file", _fail_on(2, module.read_rank_file, OSError(errno.EIO, "I/O error")))
    results = run()
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and None not in messages, messages
    assert "rank 2: reading" in next(iter(messages)) and "I/O error" in next(iter(messages))
    assert all(r["unchanged"] for r in results)


@pytest.mark.parametrize("tweak,expected", [
    ("lacks", "entries the model lacks: model.gain, optim0.gain.exp_avg"),
    ("reshape", "rank 3: comparing")
])
def test_entries_that_differ_raise_on_every_rank_and_change_nothing(saved, tweak, expected):
    results = LocalCluster(4).run(_load_rank, str(saved / "step2"), True, tweak)
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and None not in messages, messages
    assert expected in messages.pop()
    assert all(r["unchanged"] for r in results)


def test_strict_false_ignores_an_entry_the_model_lacks(saved):
    results = LocalCluster(4).run(_load_rank, str(saved / "step2"), False, "lacks")
    assert [r["error"] for r in results] == [None] * 4
    assert [r["extra"] for r in results] == [{"step": 2}] * 4


def test_strict_false_still_refuses_another_shape(saved):
    results = LocalCluster(4).run(_load_rank, str(saved / "step2"), False, "reshape")
    assert all(r["error"] and "entry 'model.gain': the checkpoint has shape [1, 8] torch.float32, the model "
               "shape [1, 9] torch.float32" in r["error"] for r in results)
    assert all(r["unchanged"] for r in results)


# ------------------------------------------------------- buffers, frozen parameters, random state
def _bn_module(stage: int):
    import torch
    from torch import nn

    torch.manual_seed(stage)
    if stage == 0:
        return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.3))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)
            self.scale = nn.Parameter(torch.ones(6), requires_grad=False)  # frozen
            self.drop = nn.Dropout(0.3)

        def forward(self, x):
            return self.drop(self.lin(x)) * self.scale

    return Head()


def _bn_rank(path: str, phase: str) -> dict:
    import torch

    p = get_platform()
    module = _bn_module(p.rank)
    stage = hp.PipelineStage(module, p.rank, 2)
    schedule = hp.Schedule1F1B(stage, 2, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    optimizer = torch.optim.Adam([q for q in module.parameters() if q.requires_grad], lr=0.05)
    if phase == "save" and p.rank == 1:
        with torch.no_grad():
            module.scale.fill_(1.5)  # a frozen value the resumed run must get from the checkpoint
    losses = []
    steps = range(4) if phase == "save" else range(2, 4)
    if phase == "load":
        torch.manual_seed(1234)  # whatever the new process drew before: the checkpoint's state wins
        assert hp.load_checkpoint(path, schedule, optimizer) == {"step": 2}
    for step in steps:
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=data), torch.randn(8, 6, generator=data)
        optimizer.zero_grad()
        losses.append([float(v) for v in schedule.run(x, target=y if p.rank == 1 else None)])
        optimizer.step()
        if phase == "save" and step == 1:
            hp.save_checkpoint(path, schedule, optimizer, extra={"step": 2})
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"losses": losses[-2:], "state": state}


def test_batchnorm_frozen_parameter_and_dropout_resume_bitwise(tmp_path):
    import torch

    path = str(tmp_path / "ckpt")
    first = LocalCluster(2).run(_bn_rank, path, "save")
    second = LocalCluster(2).run(_bn_rank, path, "load")
    assert first[1]["losses"] == second[1]["losses"]
    for a, b in zip(first, second):
        assert a["state"].keys() == b["state"].keys()
        for k in a["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), k
    assert int(second[0]["state"]["1.num_batches_tracked"]) == 8  # 4 steps x 2 micro-batches


# ------------------------------------------------------------------------------------- MindSpore
def _ms_rank(path: str, phase: str) -> dict:
    trainer = Trainer(Config(framework="mindspore", mode="fsdp", steps=4))
    if phase == "save":
        trainer.train(range(2))
        hp.save_checkpoint(path, trainer.schedule, trainer.optimizer, extra={"step": 2})
        return {}
    params = trainer.full_params()
    error = None
    try:
        hp.load_checkpoint(path, trainer.schedule, trainer.optimizer)
    except CheckpointError as exc:
        error = str(exc)
    after = trainer.full_params()
    return {"error": error, "unchanged": all(np.array_equal(after[k], params[k]) for k in params)}


def _ms_save_fail_rank(path: str) -> dict:
    trainer = Trainer(Config(framework="mindspore", mode="fsdp", steps=4))
    trainer.train(range(1))
    try:
        hp.save_checkpoint(path, trainer.schedule, trainer.optimizer, extra={"step": 3})
    except CheckpointError as exc:
        return {"error": str(exc)}
    return {"error": None}


def test_mindspore_failed_save_keeps_the_checkpoint_and_damaged_load_changes_nothing(tmp_path, monkeypatch):
    from hyper_parallel.platform.mindspore import checkpoint as ms_checkpoint

    path = str(tmp_path / "ckpt")
    LocalCluster(4, platform="mindspore").run(_ms_rank, path, "save")
    before = _tree(path)
    monkeypatch.setattr(ms_checkpoint, "write_rank_file", _fail_on(2, ms_checkpoint.write_rank_file))
    results = LocalCluster(4, platform="mindspore").run(_ms_save_fail_rank, path)
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and None not in messages and "rank 2: " in next(iter(messages))
    assert _tree(path) == before and sorted(os.listdir(tmp_path)) == ["ckpt"]
    monkeypatch.undo()
    with open(os.path.join(path, "rank1.ckpt"), "r+b") as f:
        f.truncate(100)
    results = LocalCluster(4, platform="mindspore").run(_ms_rank, path, "load")
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and None not in messages and "rank1.ckpt" in next(iter(messages))
    assert all(r["unchanged"] for r in results)


def _ms_bn_rank(path: str, phase: str) -> dict:
    import mindspore as ms
    from mindspore import nn, ops

    p = get_platform()
    ms.set_seed(p.rank)

    class StageNet(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Dense(6, 6)
            self.bn = nn.BatchNorm1d(6)
            self.scale = ms.Parameter(ops.ones(6, ms.float32), name="scale", requires_grad=False)

        def construct(self, x):
            # ops.dropout draws from MindSpore's seed counters, which the checkpoint holds (nn.Dropout's
            # primitive keeps a generator of its own that cannot be read: see docs/parallelism.md)
            return ops.dropout(self.bn(self.lin(x)), p=0.3, training=self.training) * self.scale

    module = StageNet()
    module.set_train(True)
    stage = hp.PipelineStage(module, p.rank, 2)
    schedule = hp.Schedule1F1B(stage, 2, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    params = schedule.parameters()
    optimizer = nn.Adam(params, learning_rate=0.05)
    if phase == "save":
        module.scale.set_data(ms.Tensor(np.full((6,), 1.5 + p.rank, np.float32)))  # frozen: only the checkpoint knows
    else:
        ms.set_seed(99)
        assert hp.load_checkpoint(path, schedule, optimizer) == {"step": 2}
    losses = []
    for step in range(4) if phase == "save" else range(2, 4):
        rng = np.random.default_rng(step)
        x, y = (ms.Tensor(rng.standard_normal((8, 6)).astype(np.float32)) for _ in range(2))
        schedule.zero_grad()
        losses.append([float(v) for v in schedule.run(x, target=y if p.rank == 1 else None)])
        optimizer(tuple(p.get_grad(q) for q in params))
        if phase == "save" and step == 1:
            hp.save_checkpoint(path, schedule, optimizer, extra={"step": 2})
    return {"losses": losses[-2:], "state": {q.name: q.asnumpy().copy() for q in module.get_parameters()}}


def test_mindspore_batchnorm_frozen_parameter_and_dropout_resume_bitwise(tmp_path):
    path = str(tmp_path / "ckpt")
    first = LocalCluster(2, platform="mindspore").run(_ms_bn_rank, path, "save")
    second = LocalCluster(2, platform="mindspore").run(_ms_bn_rank, path, "load")
    assert first[1]["losses"] == second[1]["losses"]
    for a, b in zip(first, second):
        assert a["state"].keys() == b["state"].keys()
        for k in a["state"]:
            np.testing.assert_array_equal(a["state"][k], b["state"][k], err_msg=k)


def test_a_missing_checkpoint_names_what_an_interrupted_swap_left(tmp_path):
    left = tmp_path / ".ckpt.saving-0123abcd"
    left.mkdir()
    (left / atomic.MARKER).write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"left the complete folders \['.ckpt.saving-0123abcd'\]"):
        atomic.read_marker(str(tmp_path / "ckpt"))


def _ms_buffers_rank(path: str, phase: str, cache: int):
    import mindspore as ms
    from mindspore import nn, ops

    class Net(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Dense(3, 3)
            self.register_buffer("cache", ops.ones(cache, ms.float32) * cache, persistent=False)  # derived
            self.register_buffer("count", ops.ones(1, ms.float32) * cache)  # state

    net = Net()
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.1)
    if phase == "save":
        hp.save_checkpoint(path, net, optimizer, extra=1)
        return None
    return hp.load_checkpoint(path, net, optimizer), net.cache.asnumpy().tolist(), net.count.asnumpy().tolist()


def test_mindspore_non_persistent_buffers_are_not_saved(tmp_path):
    """As on torch: a buffer registered with ``persistent=False`` (a cache the model derives) is no part
    of the checkpoint; a resumed model that derives another one loads, the persistent buffer comes back."""
    path = str(tmp_path / "ckpt")
    LocalCluster(1, platform="mindspore").run(_ms_buffers_rank, path, "save", 2)
    assert LocalCluster(1, platform="mindspore").run(_ms_buffers_rank, path, "load", 3) == [(1, [3.0] * 3, [2.0])]
