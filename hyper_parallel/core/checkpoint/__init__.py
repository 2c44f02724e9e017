"""Saving and resuming the whole training state of a pipelined, (fully) sharded model.

``save_checkpoint(path, schedule, optimizer, extra=...)`` and ``load_checkpoint(path, schedule,
optimizer)`` are collectives: every rank of the job calls them. What is written:

* every parameter of the rank's stages, trainable or frozen, and every persistent buffer (BatchNorm's
  running statistics...), under a key that is its name in its stage module (``layers.3.weight``). A
  name two stages of the pipeline use for different tensors gets the stage as a prefix
  (``stage1.lin.weight``); the holders of one tied weight may share a name;
* each optimizer's state, per parameter (keyed like the parameter), with its group's options;
* each rank's random state (the framework's generators, as ``Platform.get_rng_state`` takes them);
* ``extra``: any picklable object (the step number, the data loader's position...).

Saving is atomic (``atomic.py``): the folder appears whole, with its commit marker, or the previous
checkpoint stays as it was, and every rank raises when any rank failed. Loading is transactional:
every rank checks the files and compares the checkpoint's entries with the model's (``strict``) and
the ranks agree that all succeeded before any tensor is changed.

The format is the framework's: ``torch.distributed.checkpoint`` in a torch.distributed job (each rank
writes its pieces; loading reshards, so a checkpoint written with one pipeline x data-parallel split
loads into another, provided the tensor names are the same: build stage modules that keep the
whole model's names), one file per rank on MindSpore and on a LocalCluster (loads on the same split).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyper_parallel.core.checkpoint import atomic
from hyper_parallel.core.checkpoint.keys import checkpoint_keys, state_keys
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.checkpoint_common import CheckpointError, agree


def _optimizers(optimizers: Any) -> list[Any]:
    if optimizers is None:
        return []
    if isinstance(optimizers, Sequence):
        return list(optimizers)
    return [optimizers]


def save_checkpoint(path: str, model: Any, optimizers: Any = None, extra: Any = None, *,
                    keep: int | None = None) -> None:
    """Write the parameters and buffers of ``model`` (a pipeline schedule, its stages, or a module), the
    state of ``optimizers`` (one or a list), each rank's random state and ``extra`` as the folder
    ``path``, atomically: it replaces a previous checkpoint there only once every rank's part is written
    and flushed. Raises :class:`CheckpointError` on every rank when any rank failed, leaving ``path``
    as it was. Every rank calls it.

    ``keep=k`` treats the folder holding ``path`` as a folder of checkpoints: once this one is committed,
    rank 0 writes the file ``latest`` there (this checkpoint's name, replaced atomically) and deletes all
    but the ``k`` newest complete checkpoints in it (by commit time; folders without a commit marker
    are never touched). :func:`latest_checkpoint` finds the newest."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 or None, got {keep!r}")
    p = get_platform()
    path = atomic.resolve(str(path))
    error, params, buffers = None, {}, {}
    try:
        params, buffers = state_keys(model)
    except (ValueError, TypeError, KeyError) as exc:
        error = exc
    folder = atomic.begin(p, path, error)
    try:
        error = None
        try:
            p.save_checkpoint(folder, params, _optimizers(optimizers), extra, buffers=buffers)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it and raises CheckpointError
            error = exc
        atomic.seal(p, path, folder, error, p.checkpoint_layout(), keep)
    except CheckpointError:
        atomic.abandon(p, folder)
        raise


def load_checkpoint(path: str, model: Any, optimizers: Any = None, *, strict: bool = True,
                    verify: bool = True) -> Any:
    """Load what :func:`save_checkpoint` wrote into ``model`` and ``optimizers`` in place, restore each
    rank's random state, and return ``extra``. Build the model (fully sharded as wanted) and the
    optimizers first; every rank calls it.

    Nothing changes unless every rank can load: each checks the commit marker and every file (present,
    of the saved size and, with ``verify``, its share of the CRC-32 checksums), then compares the
    checkpoint's entries with the model's; any failure raises the same :class:`CheckpointError` on
    every rank. ``strict=True``: the checkpoint must hold exactly the model's parameters and buffers
    and the optimizers' states, with the same shapes and dtypes. ``strict=False`` allows entries the
    checkpoint has and the model lacks (ignored) and entries the model has and the checkpoint lacks
    (left as they are); shapes and dtypes of the entries both hold must still match."""
    p = get_platform()
    path = str(path)
    atomic.verify(p, path, p.checkpoint_layout(), checksums=verify)
    error, params, buffers = None, {}, {}
    try:
        params, buffers = state_keys(model)
    except (ValueError, TypeError, KeyError) as exc:
        error = exc
    agree(p, "load", path, error, where="listing the model's tensors")
    return p.load_checkpoint(path, params, _optimizers(optimizers), buffers=buffers, strict=strict)


def latest_checkpoint(folder: str) -> str | None:
    """The newest complete checkpoint in ``folder`` (where ``save_checkpoint(..., keep=k)`` saves):
    the one its ``latest`` file names, else the newest by commit time; ``None`` if it holds none."""
    return atomic.latest(str(folder))


__all__ = ["CheckpointError", "checkpoint_keys", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]
