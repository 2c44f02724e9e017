"""Checkpoints on torch: ``torch.distributed.checkpoint`` in a torch.distributed job, one file per rank on
a LocalCluster.

The state is one flat dict (keys from ``hyper_parallel/core/checkpoint.py``):

* ``model.<key>``: every parameter (a ``DTensor`` shard under FSDP2, else the whole tensor);
* ``optim<j>.<key>.<state>``: optimizer ``j``'s per-parameter state, keyed by its parameter's key
  (so it follows the parameter when the pipeline or data-parallel split changes);
* ``optim<j>.<key>.hparams``: the options of the parameter's group (``lr``, ``betas``...), pickled;
* ``extra``: the caller's object, pickled.

With ``torch.distributed.checkpoint`` every rank writes its own pieces and loading reshards: a
parameter saved as FSDP shards over 2 ranks loads into shards over 4 ranks, into an unsharded
parameter, or onto another pipeline rank. Optimizer states that do not exist yet (torch creates them
at the first ``step``) are created for loading from the checkpoint's metadata, laid out like their
parameter. Non-tensor values travel pickled: load checkpoints you trust.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch

STATE_SEP = "."


def _distributed(platform: Any) -> bool:
    from hyper_parallel.platform.torch.comm import TorchCommunicator

    return isinstance(platform.comm, TorchCommunicator)


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank}.pt")


def _param_keys(params: Mapping[str, Any]) -> dict[int, str]:
    return {id(p): key for key, p in params.items()}


def _optimizer_entries(optimizers: Sequence[Any], params: Mapping[str, Any]) -> list[tuple[int, Any, dict, str]]:
    """(optimizer index, parameter, its group, its key) for every parameter an optimizer updates."""
    keys = _param_keys(params)
    out = []
    for j, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for param in group["params"]:
                key = keys.get(id(param))
                if key is None:
                    raise ValueError(
                        f"optimizer {j} updates a parameter of shape {list(param.shape)} that is not a parameter "
                        "of the model being checkpointed"
                    )
                out.append((j, param, group, key))
    return out


def state_dict(params: Mapping[str, Any], optimizers: Sequence[Any], extra: Any) -> dict[str, Any]:
    state: dict[str, Any] = {f"model.{key}": p.detach() for key, p in params.items()}
    for j, param, group, key in _optimizer_entries(optimizers, params):
        for name, value in optimizers[j].state.get(param, {}).items():
            state[f"optim{j}.{key}.{name}"] = value if isinstance(value, torch.Tensor) else pickle.dumps(value)
        state[f"optim{j}.{key}.hparams"] = pickle.dumps({k: v for k, v in group.items() if k != "params"})
    state["extra"] = pickle.dumps(extra)
    return state


def save(platform: Any, path: str, params: Mapping[str, Any], optimizers: Sequence[Any], extra: Any) -> None:
    state = state_dict(params, optimizers, extra)
    if _distributed(platform):
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=path)
        return
    os.makedirs(path, exist_ok=True)
    torch.save({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()},
               _rank_file(path, platform.rank))
    platform.barrier()


def _saved_entries(platform: Any, path: str) -> dict[str, Any]:
    """Key -> ``(shape, dtype)`` of a saved tensor, or ``None`` for a pickled value."""
    if _distributed(platform):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
        return {k: (tuple(m.size), m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
                for k, m in metadata.items()}
    saved = torch.load(_rank_file(path, platform.rank), weights_only=False)
    return {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for k, v in saved.items()}


def _destination(entry: Any, param: Any) -> Any:
    if entry is None:
        return b""
    shape, dtype = entry
    if shape == tuple(param.shape):  # laid out like the parameter (a DTensor shard under FSDP)
        return torch.zeros_like(param.detach(), dtype=dtype)
    return torch.zeros(shape, dtype=dtype, device=param.device)


def load(platform: Any, path: str, params: Mapping[str, Any], optimizers: Sequence[Any]) -> Any:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    saved = _saved_entries(platform, path)
    missing = [key for key in params if f"model.{key}" not in saved]
    if missing:
        raise KeyError(f"the checkpoint at {path!r} has no parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
    dest: dict[str, Any] = {f"model.{key}": p.detach() for key, p in params.items()}
    by_param: dict[tuple[int, str], list[str]] = {}
    for full in saved:
        if full.startswith("optim"):
            head, name = full.rsplit(STATE_SEP, 1)
            j, key = head.split(STATE_SEP, 1)
            by_param.setdefault((int(j[len("optim"):]), key), []).append(name)
    entries = _optimizer_entries(optimizers, params)
    for j, param, _group, key in entries:
        for name in by_param.get((j, key), []):
            dest[f"optim{j}.{key}.{name}"] = _destination(saved[f"optim{j}.{key}.{name}"], param)
    dest["extra"] = b""
    _read(platform, path, dest)
    for j, param, group, key in entries:
        for name in by_param.get((j, key), []):
            value = dest[f"optim{j}.{key}.{name}"]
            if name == "hparams":
                group.update(pickle.loads(value))
            else:
                optimizers[j].state[param][name] = value if isinstance(value, torch.Tensor) else pickle.loads(value)
    return pickle.loads(dest["extra"])


def _read(platform: Any, path: str, dest: dict[str, Any]) -> None:
    if _distributed(platform):
        import torch.distributed.checkpoint as dcp

        dcp.load(dest, checkpoint_id=path)
        return
    saved = torch.load(_rank_file(path, platform.rank), weights_only=False)
    with torch.no_grad():
        for key, target in dest.items():
            value = saved[key]
            if isinstance(target, torch.Tensor):
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"checkpoint entry {key!r} has shape {list(value.shape)}, the model "
                                     f"{list(target.shape)} (without torch.distributed a checkpoint loads "
                                     "only on the same split)")
                target.copy_(value)
            else:
                dest[key] = value
