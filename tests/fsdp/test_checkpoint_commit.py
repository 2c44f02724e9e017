"""The last steps of an atomic save on a LocalCluster (plain torch modules, per-rank files): what happens
once the new checkpoint is in place (a failing directory flush, the ``latest`` pointer of ``keep=``) and
a target that is a symbolic link."""

from __future__ import annotations

import errno
import json
import os

import pytest

import hyper_parallel as hp
from hyper_parallel.core.checkpoint import atomic
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster


def _model(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    return module, torch.optim.Adam(module.parameters(), lr=0.1)


def _save_rank(path: str, extra, keep=None) -> str | None:
    module, optimizer = _model()
    try:
        hp.save_checkpoint(path, module, optimizer, extra=extra, keep=keep)
    except hp.CheckpointError as exc:
        return str(exc)
    return None


def _load_rank(path: str):
    module, optimizer = _model(1)
    return hp.load_checkpoint(path, module, optimizer)


def test_a_failing_flush_after_the_rename_does_not_report_an_unchanged_checkpoint(tmp_path, monkeypatch):
    """Once the new folder is in place the save has happened: a failing flush of the parent folder (or of
    the removal of the old one) may not raise "nothing was changed" while the new checkpoint is there."""
    path = str(tmp_path / "ckpt")
    assert LocalCluster(2).run(_save_rank, path, 1) == [None, None]
    real = atomic._fsync_dir

    def failing(folder: str) -> None:
        if os.path.abspath(folder) == str(tmp_path):
            raise OSError(errno.EIO, "Input/output error (injected)")
        real(folder)

    monkeypatch.setattr(atomic, "_fsync_dir", failing)
    with pytest.warns(UserWarning, match="Input/output error"):
        results = LocalCluster(2).run(_save_rank, path, 2)
    assert results == [None, None]
    monkeypatch.setattr(atomic, "_fsync_dir", real)
    assert LocalCluster(2).run(_load_rank, path) == [2, 2]
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_save_through_a_symbolic_link_replaces_the_checkpoint_it_points_to(tmp_path):
    """``ckpt -> store/ckpt`` (a checkpoint kept on another disk): a save through the link writes beside
    the real folder and keeps the link, instead of putting a folder where the link was and leaving the
    link behind as a hidden leftover."""
    store = tmp_path / "store"
    store.mkdir()
    real, link = store / "ckpt", tmp_path / "ckpt"
    assert LocalCluster(2).run(_save_rank, str(real), 1) == [None, None]
    link.symlink_to(real, target_is_directory=True)
    assert LocalCluster(2).run(_save_rank, str(link), 2) == [None, None]
    assert link.is_symlink() and sorted(os.listdir(tmp_path)) == ["ckpt", "store"]
    assert sorted(os.listdir(store)) == ["ckpt"]
    assert LocalCluster(2).run(_load_rank, str(real)) == [2, 2]


def _keep_rank(parent: str) -> list:
    module, optimizer = _model()
    seen = []
    for step in (1, 2, 3):
        hp.save_checkpoint(os.path.join(parent, f"step{step}"), module, optimizer, extra=step, keep=1)
        latest = os.path.join(parent, atomic.LATEST)
        seen.append((open(latest).read() if os.path.exists(latest) else None, sorted(os.listdir(parent))))
        get_platform().barrier()
    return seen


def test_keep_returns_on_every_rank_only_once_latest_names_the_new_checkpoint(tmp_path):
    """``save_checkpoint(..., keep=k)`` is a collective: on no rank may it return before rank 0 pointed
    ``latest`` at the new checkpoint and pruned (a rank resuming from ``latest_checkpoint`` would get the
    previous one, which the pruning may be deleting under it)."""
    results = LocalCluster(2).run(_keep_rank, str(tmp_path))
    expected = [(f"step{s}\n", ["latest", f"step{s}"]) for s in (1, 2, 3)]
    assert results == [expected, expected]


def _load_error_rank(path: str) -> str | None:
    module, optimizer = _model(1)
    try:
        hp.load_checkpoint(path, module, optimizer)
    except hp.CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("marker", ["a list", "files as a list"])
def test_a_malformed_commit_marker_raises_checkpoint_error_on_every_rank(tmp_path, marker):
    """Valid JSON of another shape in ``COMMITTED.json`` is a damaged checkpoint like any other: the same
    CheckpointError on every rank (an AttributeError escaped the checks, and a rank raising outside the
    agreement leaves the others waiting)."""
    path = str(tmp_path / "ckpt")
    assert LocalCluster(2).run(_save_rank, path, 1) == [None, None]
    with open(os.path.join(path, atomic.MARKER)) as f:
        content = json.load(f)
    with open(os.path.join(path, atomic.MARKER), "w") as f:
        json.dump([] if marker == "a list" else dict(content, files=sorted(content["files"])), f)
    messages = set(LocalCluster(2).run(_load_error_rank, path))
    assert len(messages) == 1 and None not in messages
    assert "checking the files" in messages.pop()
