"""Stage autograd on PyTorch: forward keeping the graph, full / input-only / weight-only backward.

All backward passes go straight to the autograd engine so that an output whose storage
was released after sending (see ``TorchPlatform.release_storage``) can still be the root
of a backward: the engine checks the gradient against the recorded output metadata, not
against the (now empty) data.

Costs (measured in the closing note of the foundation issue): a full backward walks the
graph once. The dx/dW split walks it twice: ``stage_backward_input`` keeps the graph and
computes only the input gradients, ``stage_backward_weight`` walks it again for the
parameters (about 1.3-1.7x a full backward in total on small models).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.variable import Variable

from hyper_parallel.platform.base import ForwardRecord


@dataclass
class _TorchState:
    leaves: tuple[Any, ...]  # per positional arg: the detached leaf, or None
    saved_storages: frozenset[int] = frozenset()  # storages the graph saved for its backward
    roots: tuple[Any, ...] = ()  # kept between the input and the weight backward
    root_grads: tuple[Any, ...] = ()


def _flatten(result: Any) -> tuple[Any, ...]:
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)):
        return tuple(result)
    raise TypeError(f"a stage must return a tensor or a tuple of tensors, got {type(result).__name__}")


def stage_forward(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    params: Sequence[Any],
    grad_args: Sequence[bool],
) -> ForwardRecord:
    if len(grad_args) != len(args):
        raise ValueError(f"grad_args has {len(grad_args)} flags for {len(args)} arguments")
    leaves = []
    call_args = []
    for arg, needs_grad in zip(args, grad_args, strict=True):
        if needs_grad:
            if not isinstance(arg, torch.Tensor):
                raise TypeError(f"a differentiable argument must be a tensor, got {type(arg).__name__}")
            arg = arg.detach().requires_grad_(True)
            leaves.append(arg)
        else:
            leaves.append(None)
        call_args.append(arg)
    saved: set[int] = set()

    def note_saved(t: torch.Tensor) -> torch.Tensor:
        if t.layout == torch.strided:
            saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(note_saved, lambda t: t):
        result = fn(*call_args, **kwargs)
    return ForwardRecord(
        result=result,
        outputs=_flatten(result),
        grad_args=tuple(bool(g) for g in grad_args),
        params=tuple(params),
        native=_TorchState(leaves=tuple(leaves), saved_storages=frozenset(saved)),
    )


def releasable(record: ForwardRecord, tensor: Any) -> bool:
    """Whether dropping ``tensor``'s data keeps the backward correct and frees memory.

    Only a tensor computed in this stage (it has a ``grad_fn``; so not a parameter, buffer,
    input or user tensor) whose storage the graph did not save for its backward.
    """
    state: _TorchState = record.native
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.grad_fn is not None
        and tensor.layout == torch.strided
        and tensor.untyped_storage().data_ptr() not in state.saved_storages
    )


def _roots(record: ForwardRecord, grads: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    if len(grads) != len(record.outputs):
        raise ValueError(f"got {len(grads)} output gradients for {len(record.outputs)} stage outputs")
    roots, root_grads = [], []
    for out, grad in zip(record.outputs, grads, strict=True):
        if grad is None or not isinstance(out, torch.Tensor) or out.grad_fn is None and not out.requires_grad:
            continue
        roots.append(out)
        root_grads.append(grad)
    return tuple(roots), tuple(root_grads)


def _engine(roots, root_grads, keep_graph: bool, inputs: tuple, accumulate: bool):  # type: ignore[no-untyped-def]
    return Variable._execution_engine.run_backward(
        roots, root_grads, keep_graph, False, inputs, True, accumulate_grad=accumulate
    )


def _input_grads(state: _TorchState, found: dict[int, Any]) -> tuple[Any, ...]:
    out = []
    for leaf in state.leaves:
        if leaf is None:
            out.append(None)
        else:
            grad = found.get(id(leaf))
            out.append(torch.zeros_like(leaf) if grad is None else grad)
    return tuple(out)


def stage_backward(record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
    state: _TorchState = record.native
    roots, root_grads = _roots(record, grads)
    leaves = tuple(leaf for leaf in state.leaves if leaf is not None)
    if roots:
        _engine(roots, root_grads, False, (), True)
    return _input_grads(state, {id(leaf): leaf.grad for leaf in leaves})


def stage_backward_input(record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
    state: _TorchState = record.native
    roots, root_grads = _roots(record, grads)
    state.roots, state.root_grads = roots, root_grads
    leaves = tuple(leaf for leaf in state.leaves if leaf is not None)
    if not roots or not leaves:
        return _input_grads(state, {})
    found = _engine(roots, root_grads, True, leaves, False)
    return _input_grads(state, {id(leaf): g for leaf, g in zip(leaves, found, strict=True)})


def stage_backward_weight(record: ForwardRecord) -> None:
    state: _TorchState = record.native
    params = tuple(p for p in record.params if p.requires_grad)
    if state.roots and params:
        _engine(state.roots, state.root_grads, False, params, True)
    state.roots, state.root_grads = (), ()
