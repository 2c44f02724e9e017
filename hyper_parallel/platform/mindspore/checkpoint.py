"""Checkpoints on MindSpore: one ``mindspore.save_checkpoint`` file per rank.

``rank<r>.ckpt`` under the checkpoint folder holds this rank's parameters (``model.<key>``, the local
shards of fully sharded ones) and every parameter of each optimizer (``optim<j>.<name>``: moments,
step counters, learning rate; the model's own parameters an optimizer lists are not stored twice);
``rank<r>.extra.pkl`` holds the caller's object, pickled. Loading copies the values back in place
(``ops.assign``), so optimizers and modules keep their parameter objects. A checkpoint loads only on
the same pipeline and data-parallel split (each rank reads its own file). Load files you trust.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import mindspore as ms
from mindspore import ops


def _files(path: str, rank: int) -> tuple[str, str]:
    return os.path.join(path, f"rank{rank}.ckpt"), os.path.join(path, f"rank{rank}.extra.pkl")


def _entries(params: Mapping[str, Any], optimizers: Sequence[Any]) -> dict[str, Any]:
    out = {f"model.{key}": p for key, p in params.items()}
    model_ids = {id(p) for p in params.values()}
    for j, opt in enumerate(optimizers):
        for name, param in opt.parameters_and_names():
            if id(param) not in model_ids:
                out[f"optim{j}.{name}"] = param
    return out


def save(platform: Any, path: str, params: Mapping[str, Any], optimizers: Sequence[Any], extra: Any) -> None:
    os.makedirs(path, exist_ok=True)
    weights, extra_file = _files(path, platform.rank)
    ms.save_checkpoint([{"name": k, "data": ops.stop_gradient(v).copy()} for k, v in _entries(params, optimizers).items()],
                       weights)
    with open(extra_file, "wb") as f:
        pickle.dump(extra, f)
    platform.barrier()


def load(platform: Any, path: str, params: Mapping[str, Any], optimizers: Sequence[Any]) -> Any:
    weights, extra_file = _files(path, platform.rank)
    if not os.path.exists(weights):
        raise FileNotFoundError(f"no checkpoint file for rank {platform.rank} at {weights!r}")
    saved = ms.load_checkpoint(weights)
    entries = _entries(params, optimizers)
    missing = [k for k in entries if k not in saved]
    if missing:
        raise KeyError(f"the checkpoint {weights!r} has no entries {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for key, param in entries.items():
        value = saved[key]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint entry {key!r} has shape {list(value.shape)}, the model {list(param.shape)} "
                             "(MindSpore checkpoints load only on the same split)")
        param.copy_(value.astype(param.dtype))  # in place (ops.assign checks a stale shape on shards)
    with open(extra_file, "rb") as f:
        return pickle.load(f)
