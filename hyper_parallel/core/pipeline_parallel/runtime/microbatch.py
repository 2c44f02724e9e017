"""Splitting a batch into micro-batches and merging outputs back.

Arguments may be tensors or any nesting of tuples, lists and dicts around them; every tensor
inside is split along its batch dim, every other leaf (numbers, strings, None...) is given
whole to each micro-batch, and each micro-batch gets the same nesting back (same container
types, same keys).

Batch-dim specs (``args_batch_dim`` / ``kwargs_batch_dim``) are spec trees. A leaf is an
int (that dim), a `BatchDimSpec`, ``None`` (dim 0), or ``-1`` / ``BatchDimSpec(None)``
(pass whole); a leaf applies to every tensor below the place it stands for. A tuple/list
spec must match a tuple/list argument entry by entry; a dict spec matches a dict argument
key by key, a key the spec leaves out is split along dim 0 (as for ``kwargs_batch_dim``).

- ``args_batch_dim``: one spec tree for every positional argument, or a list/tuple holding
  one spec tree per positional argument (so a tuple argument split entry by entry needs its
  own tuple inside that list: ``args_batch_dim=[(0, 1)]``).
- ``kwargs_batch_dim``: one spec tree for every keyword argument, or a dict from keyword name
  to spec tree.

Errors name the argument by its path, e.g. ``args[0]['x'][1]`` or ``kwargs['mask']``.

A ``DTensor`` is split through its local piece: every rank cuts its own piece into micro-batches
and each part keeps the layout (so a batch dimension sharded over ``dp`` gives every ``dp`` rank
micro-batches of its own rows). Merging concatenates the local pieces the same way.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hyper_parallel.core.dtensor import DTensor
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


def _is_leaf_spec(spec: Any) -> bool:
    return not isinstance(spec, (Mapping, list, tuple))


def _kind(value: Any) -> str:
    name = "dict" if isinstance(value, Mapping) else type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _rebuild_sequence(like: Sequence[Any], items: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # namedtuple
        return type(like)(*items)
    return tuple(items) if isinstance(like, tuple) else list(items)


def _rebuild_mapping(like: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    if isinstance(like, dict):
        out = copy.copy(like)  # keeps the dict type (OrderedDict, defaultdict's factory...)
        out.clear()
        out.update(items)
        return out
    return dict(items)


def _split_tensor(platform: Platform, value: Any, spec: BatchDimSpec, num: int, path: str) -> list[Any]:
    if spec.dim is None:
        return [value] * num
    shape = platform.shape(value)
    if spec.dim >= len(shape):
        raise ValueError(f"{path} has {len(shape)} dims; cannot split along dim {spec.dim}")
    size = shape[spec.dim]
    if size % num:
        raise ValueError(
            f"{path} has size {size} along dim {spec.dim}, which does not divide into micro_batch_num={num}"
        )
    return platform.chunk(value, num, spec.dim)


def _split_dtensor(platform: Platform, value: DTensor, spec: BatchDimSpec, num: int, path: str) -> list[Any]:
    if spec.dim is None:
        return [value] * num
    pieces = _split_tensor(platform, value.to_local(), spec, num, f"the local piece of {path}")
    return [DTensor.from_local(piece, value.layout) for piece in pieces]


def _map_children(value: Any, path: str, fn: Callable[[Any, str, Any], list[Any]], num: int) -> list[Any] | None:
    """Split each child of a container with ``fn(child, child_path, key)``; None if not a container."""
    if isinstance(value, Mapping):
        parts = {k: fn(v, f"{path}[{k!r}]", k) for k, v in value.items()}
        return [_rebuild_mapping(value, {k: p[i] for k, p in parts.items()}) for i in range(num)]
    if isinstance(value, (list, tuple)):
        seq = [fn(v, f"{path}[{k}]", k) for k, v in enumerate(value)]
        return [_rebuild_sequence(value, [p[i] for p in seq]) for i in range(num)]
    return None


def _split_all(platform: Platform, value: Any, spec: BatchDimSpec, num: int, path: str) -> list[Any]:
    """Split every tensor inside ``value`` with one leaf spec; other leaves go whole."""
    if platform.is_tensor(value):
        return _split_tensor(platform, value, spec, num, path)
    if isinstance(value, DTensor):
        return _split_dtensor(platform, value, spec, num, path)
    split = _map_children(value, path, lambda v, p, _k: _split_all(platform, v, spec, num, p), num)
    return [value] * num if split is None else split


def _split_tree(platform: Platform, value: Any, spec: Any, num: int, path: str) -> list[Any]:
    """Split ``value`` following the spec tree ``spec``; ``path`` names ``value`` in errors."""
    if _is_leaf_spec(spec):
        return _split_all(platform, value, to_spec(spec, f"batch dim of {path}"), num, path)
    if isinstance(spec, Mapping):
        if platform.is_tensor(value) or not isinstance(value, Mapping):
            raise ValueError(f"{path}: the batch-dim spec is a dict but the argument is {_kind(value)}")
        unknown = [k for k in spec if k not in value]
        if unknown:
            raise ValueError(f"{path}: the batch-dim spec names keys the argument does not have: {unknown}")
        return _map_children(value, path, lambda v, p, k: _split_tree(platform, v, spec.get(k), num, p), num)
    if platform.is_tensor(value) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{path}: the batch-dim spec is a {type(spec).__name__} but the argument is {_kind(value)}")
    if len(spec) != len(value):
        raise ValueError(f"{path}: the batch-dim spec has {len(spec)} entries but the argument has {len(value)}")
    return _map_children(value, path, lambda v, p, k: _split_tree(platform, v, spec[k], num, p), num)


def _arg_specs(args: Sequence[Any], args_batch_dim: Any) -> list[Any]:
    if isinstance(args_batch_dim, (list, tuple)):
        if len(args_batch_dim) != len(args):
            raise ValueError(f"args_batch_dim has {len(args_batch_dim)} entries for {len(args)} positional arguments")
        return list(args_batch_dim)
    if isinstance(args_batch_dim, Mapping):
        raise TypeError(
            "args_batch_dim must be one spec for every positional argument or a list/tuple of one spec per "
            f"positional argument, got a dict {args_batch_dim!r}"
        )
    to_spec(args_batch_dim, "args_batch_dim")
    return [args_batch_dim] * len(args)


def _kwarg_specs(kwargs: Mapping[str, Any], kwargs_batch_dim: Any) -> dict[str, Any]:
    if isinstance(kwargs_batch_dim, Mapping):
        unknown = set(kwargs_batch_dim) - set(kwargs)
        if unknown:
            raise ValueError(f"kwargs_batch_dim names arguments that were not passed: {sorted(unknown)}")
        return {k: kwargs_batch_dim.get(k) for k in kwargs}
    if isinstance(kwargs_batch_dim, (list, tuple)):
        raise TypeError(
            "kwargs_batch_dim must be one spec for every keyword argument or a dict from keyword name to spec, "
            f"got {kwargs_batch_dim!r}"
        )
    to_spec(kwargs_batch_dim, "kwargs_batch_dim")
    return dict.fromkeys(kwargs, kwargs_batch_dim)


def split_inputs(
    platform: Platform,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    num: int,
    args_batch_dim: Any = None,
    kwargs_batch_dim: Any = None,
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``num`` pairs of (args, kwargs), one per micro-batch (see the module docstring)."""
    arg_parts = [
        _split_tree(platform, a, s, num, f"args[{i}]")
        for i, (a, s) in enumerate(zip(args, _arg_specs(args, args_batch_dim), strict=True))
    ]
    kw_specs = _kwarg_specs(kwargs, kwargs_batch_dim)
    kw_parts = {k: _split_tree(platform, v, kw_specs[k], num, f"kwargs[{k!r}]") for k, v in kwargs.items()}
    return [
        (tuple(parts[i] for parts in arg_parts), {k: parts[i] for k, parts in kw_parts.items()}) for i in range(num)
    ]


def split_target(platform: Platform, target: Any, num: int, name: str = "target") -> list[Any]:
    """Split a target (a tensor, or a tuple/list/dict of them, nested) along dim 0 into ``num`` parts."""
    if platform.is_tensor(target):
        return _split_tensor(platform, target, BatchDimSpec(0), num, name)
    if isinstance(target, DTensor):
        return _split_dtensor(platform, target, BatchDimSpec(0), num, name)
    split = _map_children(target, name, lambda v, p, _k: split_target(platform, v, num, p), num)
    if split is None:
        raise TypeError(f"{name} must be a tensor or a tuple/list/dict of tensors, got {type(target).__name__}")
    return split


def _structure(platform: Platform, value: Any) -> str | None:
    """What merging must find the same in every micro-batch; None for a non-tensor leaf."""
    if platform.is_tensor(value):
        return "a tensor"
    if isinstance(value, DTensor):
        return f"a DTensor laid out as {value.layout!r}"
    if isinstance(value, Mapping):
        return f"a dict with keys {list(value)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return None


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except (TypeError, ValueError):  # e.g. arrays, whose == gives no single truth value
        return False


def merge_outputs(platform: Platform, outputs: Sequence[Any], dim: int, name: str = "output") -> Any:
    """Concatenate per-micro-batch outputs along ``dim``: tensors, or tuples/lists/dicts of them
    (nested), rebuilt with the first micro-batch's containers; 0-d tensors become a 1-d tensor of
    one value per micro-batch. A non-tensor leaf that is the same
    in every micro-batch is kept once; one that differs becomes the list of per-micro-batch values.
    Outputs whose structure differs between micro-batches raise ValueError naming the path."""
    first = outputs[0]
    expected = _structure(platform, first)
    for i, out in enumerate(outputs):
        found = _structure(platform, out)
        if found != expected:
            raise ValueError(
                f"{name}: micro-batch {i} gives {found or _kind(out)} where micro-batch 0 gives "
                f"{expected or _kind(first)}; the outputs cannot be merged"
            )
    if platform.is_tensor(first):
        if not platform.shape(first):  # scalars (e.g. a last stage's own loss): one value per micro-batch
            return platform.cat([platform.reshape(o, (1,)) for o in outputs], 0)
        return platform.cat(list(outputs), dim)
    if isinstance(first, DTensor):
        return DTensor.from_local(platform.cat([o.to_local() for o in outputs], dim), first.layout)
    if isinstance(first, Mapping):
        merged = {k: merge_outputs(platform, [o[k] for o in outputs], dim, f"{name}[{k!r}]") for k in first}
        return _rebuild_mapping(first, merged)
    if isinstance(first, (list, tuple)):
        items = [merge_outputs(platform, [o[k] for o in outputs], dim, f"{name}[{k}]") for k in range(len(first))]
        return _rebuild_sequence(first, items)
    if all(_same(out, first) for out in outputs):
        return first
    return list(outputs)
