"""Splitting a batch into micro-batches and merging outputs back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hyper_parallel.platform.base import Platform


@dataclass(frozen=True)
class BatchDimSpec:
    """Along which dimension an input is split; ``BatchDimSpec(None)`` passes it whole."""

    dim: int | None = 0

    def __post_init__(self) -> None:
        if self.dim is not None and (isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0):
            raise ValueError(f"BatchDimSpec.dim must be a non-negative int or None, got {self.dim!r}")


SpecLike = int | BatchDimSpec | None


def to_spec(spec: SpecLike, what: str) -> BatchDimSpec:
    """``None`` -> dim 0, ``-1`` -> whole, int -> that dim."""
    if spec is None:
        return BatchDimSpec(0)
    if isinstance(spec, BatchDimSpec):
        return spec
    if isinstance(spec, bool) or not isinstance(spec, int):
        raise TypeError(f"{what}: batch dim must be an int, BatchDimSpec or None, got {spec!r}")
    if spec == -1:
        return BatchDimSpec(None)
    return BatchDimSpec(spec)


def _arg_specs(args: Sequence[Any], args_batch_dim: Any) -> list[BatchDimSpec]:
    if isinstance(args_batch_dim, (list, tuple)):
        if len(args_batch_dim) != len(args):
            raise ValueError(f"args_batch_dim has {len(args_batch_dim)} entries for {len(args)} positional arguments")
        return [to_spec(s, f"args_batch_dim[{i}]") for i, s in enumerate(args_batch_dim)]
    spec = to_spec(args_batch_dim, "args_batch_dim")
    return [spec] * len(args)


def _kwarg_specs(kwargs: Mapping[str, Any], kwargs_batch_dim: Any) -> dict[str, BatchDimSpec]:
    if isinstance(kwargs_batch_dim, Mapping):
        unknown = set(kwargs_batch_dim) - set(kwargs)
        if unknown:
            raise ValueError(f"kwargs_batch_dim names arguments that were not passed: {sorted(unknown)}")
        return {k: to_spec(kwargs_batch_dim.get(k), f"kwargs_batch_dim[{k!r}]") for k in kwargs}
    spec = to_spec(kwargs_batch_dim, "kwargs_batch_dim")
    return dict.fromkeys(kwargs, spec)


def _split_one(platform: Platform, value: Any, spec: BatchDimSpec, num: int, name: str) -> list[Any]:
    if spec.dim is None or not platform.is_tensor(value):
        return [value] * num
    shape = platform.shape(value)
    if spec.dim >= len(shape):
        raise ValueError(f"{name} has {len(shape)} dims; cannot split along dim {spec.dim}")
    size = shape[spec.dim]
    if size % num:
        raise ValueError(
            f"{name} has size {size} along dim {spec.dim}, which does not divide into micro_batch_num={num}"
        )
    return platform.chunk(value, num, spec.dim)


def split_inputs(
    platform: Platform,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    num: int,
    args_batch_dim: Any = None,
    kwargs_batch_dim: Any = None,
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``num`` pairs of (args, kwargs), one per micro-batch."""
    arg_parts = [
        _split_one(platform, a, s, num, f"argument {i}")
        for i, (a, s) in enumerate(zip(args, _arg_specs(args, args_batch_dim), strict=True))
    ]
    kw_specs = _kwarg_specs(kwargs, kwargs_batch_dim)
    kw_parts = {k: _split_one(platform, v, kw_specs[k], num, f"keyword argument {k!r}") for k, v in kwargs.items()}
    return [
        (tuple(parts[i] for parts in arg_parts), {k: parts[i] for k, parts in kw_parts.items()}) for i in range(num)
    ]


def split_target(platform: Platform, target: Any, num: int, name: str = "target") -> list[Any]:
    """Split a target (a tensor, or a tuple/list/dict of them) along dim 0 into ``num`` parts."""
    if isinstance(target, (tuple, list)):
        parts = [split_target(platform, t, num, f"{name}[{k}]") for k, t in enumerate(target)]
        return [type(target)(p[i] for p in parts) for i in range(num)]
    if isinstance(target, Mapping):
        split = {k: split_target(platform, v, num, f"{name}[{k!r}]") for k, v in target.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(num)]
    if not platform.is_tensor(target):
        raise TypeError(f"{name} must be a tensor or a tuple/list/dict of tensors, got {type(target).__name__}")
    return _split_one(platform, target, BatchDimSpec(0), num, name)


def merge_outputs(platform: Platform, outputs: Sequence[Any], dim: int) -> Any:
    """Concatenate per-micro-batch outputs (tensors or tuples of tensors) along ``dim``."""
    first = outputs[0]
    if isinstance(first, (tuple, list)):
        return tuple(merge_outputs(platform, [o[k] for o in outputs], dim) for k in range(len(first)))
    return platform.cat(list(outputs), dim)
