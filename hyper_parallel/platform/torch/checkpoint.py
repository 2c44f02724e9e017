"""Checkpoints on torch: ``torch.distributed.checkpoint`` in a torch.distributed job, one file per rank on
a LocalCluster. Both write into the folder the core made (``hyper_parallel/core/checkpoint/atomic.py``).

The state is one flat dict (keys from ``hyper_parallel/core/checkpoint/keys.py``):

* ``model.<key>``: every parameter, trainable or frozen (a ``DTensor`` shard under FSDP2, else the whole
  tensor);
* ``buffer.<key>`` (per-rank files) or ``buffer.<rank>.<key>`` (torch.distributed.checkpoint: every
  rank's own copy, since data-parallel replicas' running statistics differ): persistent buffers;
* ``optim<j>.<key>.<state>``: optimizer ``j``'s per-parameter state, keyed by its parameter's key
  (so it follows the parameter when the pipeline or data-parallel split changes);
* ``optim<j>.<key>.hparams``: the options of the parameter's group (``lr``, ``betas``...), pickled;
* ``rng`` / ``rng.<rank>``: the rank's random state (CPU and accelerator generators), pickled;
* ``extra`` / ``extra.<rank>``: the caller's object, pickled (each rank's own: it may differ per rank).

With ``torch.distributed.checkpoint`` every rank writes its own pieces and loading reshards: a
parameter saved as FSDP shards over 2 ranks loads into shards over 4 ranks, into an unsharded
parameter, or onto another pipeline rank. A buffer (and ``extra``) loads from the copy the same rank
saved, else from the lowest rank that saved one; the random state only on a rank that saved one. Loading
reads into new tensors first and copies them in once every rank read its part (a load needs memory for a second
copy of the rank's state). Optimizer states that do not exist yet (torch creates them at the first
``step``) are created from the checkpoint's metadata, laid out like their parameter. Non-tensor values
travel pickled: load checkpoints you trust.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hyper_parallel.platform.checkpoint_common import EngineError, Spec, agree, mismatches

STATE_SEP = "."
DCP_LAYOUT = "torch.distributed.checkpoint"
FILES_LAYOUT = "torch per-rank files"


def _distributed(platform: Any) -> bool:
    from hyper_parallel.platform.torch.comm import TorchCommunicator

    return isinstance(platform.comm, TorchCommunicator)


def layout(platform: Any) -> str:
    return DCP_LAYOUT if _distributed(platform) else FILES_LAYOUT


def rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank}.pt")


def _spec(value: Any) -> Spec:
    return (tuple(value.shape), str(value.dtype)) if isinstance(value, torch.Tensor) else None


def _optimizer_entries(optimizers: Sequence[Any], params: Mapping[str, Any]) -> list[tuple[int, Any, dict, str]]:
    """(optimizer index, parameter, its group, its key) for every parameter an optimizer updates."""
    keys = {id(p): key for key, p in params.items()}
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


def state_dict(platform: Any, params: Mapping[str, Any], optimizers: Sequence[Any], extra: Any,
               buffers: Mapping[str, Any]) -> dict[str, Any]:
    own = f".{platform.rank}" if _distributed(platform) else ""
    state: dict[str, Any] = {f"model.{key}": p.detach() for key, p in params.items()}
    state.update({f"buffer{own}.{key}": b.detach() for key, b in buffers.items()})
    for j, param, group, key in _optimizer_entries(optimizers, params):
        for name, value in optimizers[j].state.get(param, {}).items():
            state[f"optim{j}.{key}.{name}"] = value if isinstance(value, torch.Tensor) else pickle.dumps(value)
        state[f"optim{j}.{key}.hparams"] = pickle.dumps({k: v for k, v in group.items() if k != "params"})
    state[f"rng{own}"] = pickle.dumps(platform.get_rng_state())
    state[f"extra{own}"] = pickle.dumps(extra)  # per rank: one key all ranks wrote would keep one rank's
    return state


def write_rank_file(state: dict[str, Any], file: str) -> None:
    """Write one rank's state (the seam where a full disk shows as an ``OSError``)."""
    torch.save(state, file)


def dcp_save(state: dict[str, Any], folder: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=True))


def _engine(platform: Any, action: str, path: str, call: Any) -> None:
    """Run a collective of torch.distributed.checkpoint, its failure as an ``Exception``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        call()
    except CheckpointException as exc:
        raise EngineError(platform.rank, action, path, exc) from exc


def save(platform: Any, folder: str, params: Mapping[str, Any], optimizers: Sequence[Any], extra: Any,
         buffers: Mapping[str, Any]) -> None:
    if _distributed(platform):
        error, state = None, {}
        try:
            state = state_dict(platform, params, optimizers, extra, buffers)
        except Exception as exc:  # noqa: BLE001 - reported to every rank before the collective write
            error = exc
        agree(platform, "save", folder, error, where="collecting the state")
        _engine(platform, "save", folder, lambda: dcp_save(state, folder))
        return
    state = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
             for k, v in state_dict(platform, params, optimizers, extra, buffers).items()}
    write_rank_file(state, rank_file(folder, platform.rank))


# ------------------------------------------------------------------------------------------------ load
def _saved(platform: Any, path: str) -> tuple[dict[str, Spec], dict[str, Any] | None]:
    """Key -> spec of every saved entry, and (per-rank files) the rank's loaded values."""
    if _distributed(platform):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
        return {k: (tuple(m.size), str(m.properties.dtype)) if isinstance(m, TensorStorageMetadata) else None
                for k, m in metadata.items()}, None
    values = read_rank_file(rank_file(path, platform.rank))
    return {k: _spec(v) for k, v in values.items()}, values


def read_rank_file(file: str) -> dict[str, Any]:
    """Read one rank's whole state into memory (the seam where an I/O error shows)."""
    return torch.load(file, weights_only=False, map_location="cpu")


def _buffer_sources(saved: Mapping[str, Spec], rank: int, distributed: bool) -> dict[str, str]:
    """Logical ``buffer.<key>`` -> the saved entry this rank loads it from."""
    if not distributed:
        return {k: k for k in saved if k.startswith("buffer.")}
    out: dict[str, tuple[int, str]] = {}
    for k in saved:
        if k.startswith("buffer."):
            src, key = k[len("buffer."):].split(STATE_SEP, 1)
            order = -1 if int(src) == rank else int(src)
            if f"buffer.{key}" not in out or order < out[f"buffer.{key}"][0]:
                out[f"buffer.{key}"] = (order, k)
    return {logical: k for logical, (_, k) in out.items()}


def _extra_source(saved: Mapping[str, Spec], rank: int, distributed: bool) -> str | None:
    """The ``extra`` entry this rank loads: its own, else (a rank the saving job lacked) the lowest rank's."""
    if not distributed:
        return "extra" if "extra" in saved else None
    ranks = sorted(int(k.split(STATE_SEP, 1)[1]) for k in saved if k.startswith("extra."))
    if not ranks:
        return None
    return f"extra.{rank if rank in ranks else ranks[0]}"


def _optim_key(full: str) -> tuple[int, str, str]:
    head, name = full.rsplit(STATE_SEP, 1)
    j, key = head.split(STATE_SEP, 1)
    return int(j[len("optim"):]), key, name


def _by_param(keys: Any) -> dict[tuple[int, str], list[str]]:
    """(optimizer index, parameter key) -> that parameter's ``optim`` entries among ``keys``."""
    out: dict[tuple[int, str], list[str]] = {}
    for full in keys:
        if full.startswith("optim"):
            j, key, _ = _optim_key(full)
            out.setdefault((j, key), []).append(full)
    return out


def _wanted(params: Mapping[str, Any], buffers: Mapping[str, Any], optimizers: Sequence[Any]) -> dict[str, Spec]:
    wanted: dict[str, Spec] = {f"model.{k}": _spec(p) for k, p in params.items()}
    wanted.update({f"buffer.{k}": _spec(b) for k, b in buffers.items()})
    for j, param, _group, key in _optimizer_entries(optimizers, params):
        wanted[f"optim{j}.{key}.hparams"] = None
        for name, value in optimizers[j].state.get(param, {}).items():
            wanted[f"optim{j}.{key}.{name}"] = _spec(value) if isinstance(value, torch.Tensor) else None
    return wanted


def _destination(spec: Spec, like: Any) -> Any:
    if spec is None:
        return b""
    shape, _ = spec
    dtype = getattr(torch, spec[1].replace("torch.", ""))
    if shape == tuple(like.shape):  # laid out like the parameter (a DTensor shard under FSDP)
        return torch.empty_like(like.detach(), dtype=dtype)
    return torch.zeros(shape, dtype=dtype, device=like.device)


def load(platform: Any, path: str, params: Mapping[str, Any], optimizers: Sequence[Any],
         buffers: Mapping[str, Any], strict: bool) -> Any:
    distributed = _distributed(platform)
    rng = f"rng.{platform.rank}" if distributed else "rng"
    where = path if distributed else rank_file(path, platform.rank)
    error, saved, values, wanted = None, {}, None, {}
    try:
        wanted = _wanted(params, buffers, optimizers)
        saved, values = _saved(platform, path)
    except Exception as exc:  # noqa: BLE001 - every rank learns of it
        error = exc
    # torch.distributed.checkpoint holds every rank's entries: which are extra, only all ranks together know
    everyone = agree(platform, "load", path, error, where=f"reading {where!r}",
                     payload=list(wanted) if distributed else None)
    error, dest, targets, extra = None, {}, {}, None
    try:
        sources = _buffer_sources(saved, platform.rank, distributed)
        logical = {k: v for k, v in saved.items() if not k.startswith(("buffer.", "rng", "extra"))}
        logical.update({name: saved[src] for name, src in sources.items()})
        known = {k for keys in everyone for k in keys} if distributed else set(wanted)
        # an optimizer creates its states at its first step: those of a parameter it updates are not extra
        pairs = {k.rsplit(STATE_SEP, 1)[0] for k in known if k.startswith("optim")}
        known |= {k for k in logical if k.startswith("optim") and k.rsplit(STATE_SEP, 1)[0] in pairs}
        problems = mismatches(logical, wanted, strict, known)
        if problems:
            raise ValueError(f"{where!r} does not match the model{'' if strict else ' (strict=False)'}: "
                             + "; ".join(problems))
        targets = {f"model.{k}": p for k, p in params.items() if f"model.{k}" in saved}
        targets.update({sources[f"buffer.{k}"]: b for k, b in buffers.items() if f"buffer.{k}" in sources})
        dest = {k: torch.empty_like(t.detach()) for k, t in targets.items()}
        by_param = _by_param(logical)
        for j, param, _group, key in _optimizer_entries(optimizers, params):
            for full in by_param.get((j, key), ()):
                dest[full] = _destination(logical[full], param)
        extra = _extra_source(saved, platform.rank, distributed)
        dest.update({k: b"" for k in (rng, extra) if k is not None and k in saved})
    except Exception as exc:  # noqa: BLE001
        error = exc
    agree(platform, "load", path, error, where=f"comparing {where!r} with the model")
    error = None
    try:
        if distributed:
            import torch.distributed.checkpoint as dcp

            _engine(platform, "load", path, lambda: dcp.load(dest, checkpoint_id=path))
        else:
            dest = {k: values[k] for k in dest}
    except Exception as exc:  # noqa: BLE001
        error = exc
    agree(platform, "load", path, error, where=f"reading {where!r}")
    return _apply(platform, dest, targets, optimizers, params, rng, extra)


def _on_param_device(value: Any, name: str, group: Mapping[str, Any], param: Any) -> Any:
    """A state read onto the host goes where its optimizer keeps it: beside its parameter, except a
    ``step`` counter of an optimizer that is neither capturable nor fused (torch keeps that one on the host)."""
    if name == "step" and not (group.get("capturable") or group.get("fused")):
        return value
    return value.to(device=param.device)


def _apply(platform: Any, dest: dict[str, Any], targets: Mapping[str, Any], optimizers: Sequence[Any],
           params: Mapping[str, Any], rng: str, extra: str | None) -> Any:
    """Copy what every rank read successfully into the model, the optimizers and the generators."""
    with torch.no_grad():
        for k, target in targets.items():
            target.detach().copy_(dest[k])
    by_param = _by_param(dest)
    for j, param, group, key in _optimizer_entries(optimizers, params):
        for full in by_param.get((j, key), ()):
            name, value = _optim_key(full)[2], dest[full]
            if name == "hparams":
                group.update(pickle.loads(value))
            else:
                optimizers[j].state[param][name] = (_on_param_device(value, name, group, param)
                                                    if isinstance(value, torch.Tensor) else pickle.loads(value))
    if rng in dest:
        platform.set_rng_state(pickle.loads(dest[rng]))
    return pickle.loads(dest[extra]) if extra in dest else None
