"""Checkpoints on MindSpore: one ``mindspore.save_checkpoint`` file per rank, in the folder the core made
(``hyper_parallel/core/checkpoint/atomic.py``).

``rank<r>.ckpt`` holds this rank's parameters, trainable or frozen (``model.<key>``, the local shards of
fully sharded ones; BatchNorm's moving statistics are frozen parameters on MindSpore), the persistent
buffers a Cell registered (``buffer.<key>``) and every parameter of each optimizer (``optim<j>.<name>``: moments,
step counters, learning rate; the model's own parameters an optimizer lists are not stored twice);
``rank<r>.extra.pkl`` holds the caller's object and the rank's random state
(``MindSporePlatform.get_rng_state``), pickled. Loading reads the whole file first, compares it with
the model, and copies the values in place only once every rank could (so optimizers and modules keep
their parameter objects). A checkpoint loads only on the same pipeline and data-parallel split (each
rank reads its own file). Load files you trust.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import mindspore as ms
from mindspore import ops

from hyper_parallel.platform.checkpoint_common import Spec, agree, mismatches


def files(path: str, rank: int) -> tuple[str, str]:
    return os.path.join(path, f"rank{rank}.ckpt"), os.path.join(path, f"rank{rank}.extra.pkl")


def _spec(value: Any) -> Spec:
    return tuple(int(d) for d in value.shape), str(value.dtype)


def _entries(params: Mapping[str, Any], optimizers: Sequence[Any], buffers: Mapping[str, Any]) -> dict[str, Any]:
    out = {f"model.{key}": p for key, p in params.items()}
    out.update({f"buffer.{key}": b for key, b in buffers.items()})
    model_ids = {id(p) for p in params.values()}
    for j, opt in enumerate(optimizers):
        for name, param in opt.parameters_and_names():
            if id(param) not in model_ids:
                out[f"optim{j}.{name}"] = param
    return out


def write_rank_file(entries: list[dict[str, Any]], file: str) -> None:
    """Write one rank's tensors (the seam where a full disk shows as an ``OSError``)."""
    ms.save_checkpoint(entries, file)


def read_rank_file(file: str) -> dict[str, Any]:
    """Read one rank's tensors into memory (the seam where an I/O error shows)."""
    return ms.load_checkpoint(file)


def save(platform: Any, folder: str, params: Mapping[str, Any], optimizers: Sequence[Any], extra: Any,
         buffers: Mapping[str, Any]) -> None:
    weights, extra_file = files(folder, platform.rank)
    write_rank_file([{"name": k, "data": ops.stop_gradient(v).copy()}
                     for k, v in _entries(params, optimizers, buffers).items()], weights)
    with open(extra_file, "wb") as f:
        pickle.dump({"extra": extra, "rng": platform.get_rng_state()}, f)
        f.flush()
        os.fsync(f.fileno())


def load(platform: Any, path: str, params: Mapping[str, Any], optimizers: Sequence[Any],
         buffers: Mapping[str, Any], strict: bool) -> Any:
    weights, extra_file = files(path, platform.rank)
    error, saved, rest, entries = None, {}, {}, {}
    try:
        entries = _entries(params, optimizers, buffers)
        saved = read_rank_file(weights)
        with open(extra_file, "rb") as f:
            rest = pickle.load(f)
        problems = mismatches({k: _spec(v) for k, v in saved.items()}, {k: _spec(v) for k, v in entries.items()},
                              strict)
        if problems:
            raise ValueError(f"{weights!r} does not match the model{'' if strict else ' (strict=False)'}: "
                             + "; ".join(problems))
    except Exception as exc:  # noqa: BLE001 - every rank learns of it before anything changes
        error = exc
    agree(platform, "load", path, error, where=f"reading {weights!r}")
    for key, target in entries.items():
        if key in saved:
            target.copy_(saved[key].astype(target.dtype))  # in place (ops.assign checks a stale shape on shards)
    if rest.get("rng") is not None:
        platform.set_rng_state(rest["rng"])
    return rest.get("extra")
