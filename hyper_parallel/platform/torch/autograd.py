"""Stage autograd on PyTorch: forward keeping the graph, full / input-only / weight-only backward.

All backward passes go straight to the autograd engine so that an output whose storage
was released after sending (see ``TorchPlatform.release_storage``) can still be the root
of a backward: the engine checks the gradient against the recorded output metadata, not
against the (now empty) data.

A full backward walks the graph once. The dx/dW split (``split_backward``) runs every backward
formula once too: ``stage_backward_input`` computes the input gradients and keeps the gradient
arriving at each weight-consuming node, ``stage_backward_weight`` computes only the weight
gradients from those. The forward packs what the graph saves (``_SavedPool``), so the input
backward can free what only dx needs as it goes and the weight backward frees the rest.
Measured costs: ``benchmarks/results/autograd_split_cost.md``; see ``docs/zero_bubble.md``.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hyper_parallel.platform.activations.state import active_pool
from hyper_parallel.platform.base import ForwardRecord
from hyper_parallel.platform.torch.split_backward import (
    SplitPlan,
    direct_calls_work,
    gradient_edges,
    plan_split,
    run_engine,
)


class _Saved:
    """What the graph keeps for one saved tensor (packed by this module's saved-tensor hook).

    A saved-tensor hook turns off torch's own in-place check, so the item does it: ``version`` is
    the tensor's version counter when it was saved, compared when the backward unpacks it. Where
    a swap or a recompute replaces the tensor (``tensor = ...``), the tensor that leaves is checked
    then, and what comes back is checked from then on: a recompute's re-run may change what it
    saved in place exactly as the forward did (a swapped copy is changed by nobody).
    """

    __slots__ = ("_tensor", "version", "dx_only", "source", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor: torch.Tensor | None = tensor
        # int: the version to find at unpack; None: not checked; (saved, found): changed before it left
        try:
            self.version: Any = tensor._version
        except RuntimeError:  # no version counter (inference tensors; torch refuses to save those anyway)
            self.version = None
        self.dx_only = False  # only the input backward needs it (set by that backward)
        self.source: Any = None  # swap group / recompute region that restores ``tensor`` (platform.activations)

    @property
    def tensor(self) -> torch.Tensor | None:
        return self._tensor

    @tensor.setter
    def tensor(self, value: torch.Tensor | None) -> None:
        old, saved = self._tensor, self.version
        if isinstance(saved, int) and old is not None and old._version != saved:
            self.version = (saved, old._version)  # the unpack raises, whatever comes back
        elif not isinstance(saved, tuple):
            self.version = None if value is None else value._version
        self._tensor = value


def _modified_in_place(t: torch.Tensor, version: Any) -> RuntimeError:
    saved, found = version if isinstance(version, tuple) else (version, t._version)
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)} that this stage's forward saved "
        f"for its backward is at version {found}; expected version {saved} instead: it was changed in place after "
        "an operation had saved it (e.g. the result of relu_ changed with add_); change a copy, or compute "
        "out of place"
    )


class _SavedPool:
    """Hooks that pack what one forward saves, so that the input backward can free it early.

    While ``dropping`` is set (the input backward), a saved tensor marked ``dx_only`` is dropped
    as soon as its node has unpacked it, as a backward that frees the graph would do.
    """

    def __init__(self) -> None:
        self.storages: set[int] = set()  # storages the graph saved for its backward
        self.items: list[weakref.ref[_Saved]] = []  # every item packed (activation swap, memory accounting)
        self.dropping = False

    def pack(self, t: torch.Tensor) -> _Saved:
        if t.layout == torch.strided:
            self.storages.add(t.untyped_storage().data_ptr())
        item = _Saved(t)
        self.items.append(weakref.ref(item))
        return item

    def unpack(self, item: _Saved) -> torch.Tensor:
        t = item._tensor
        if t is None:
            if item.source is not None:
                item.source.materialize(item)  # offloaded (swap) or dropped for a recompute
                t = item._tensor
            if t is None:
                raise RuntimeError("this stage's backward already ran and freed what the forward saved for it; "
                                   "a forward record takes one backward (or one input + one weight backward)")
        version = item.version
        if version is not None and (version.__class__ is tuple or t._version != version):
            raise _modified_in_place(t, version)
        if self.dropping and item.dx_only:
            item._tensor = None
        return t


@dataclass
class _TorchState:
    leaves: tuple[Any, ...]  # per positional arg: the detached leaf, or None
    pool: _SavedPool | None  # None: forward run without the saved-tensor hook
    step: str = "forward"  # forward -> input_done -> done
    plan: SplitPlan | None = None  # kept between the input and the weight backward
    rewalk: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None  # (roots, grads) for the fallback
    # without a pool, several outputs: the storages the graph saved, read once (None: unreadable)
    graph_saved: frozenset[int] | None = None
    graph_read: bool = False

    def advance(self, expected: str, new: str, what: str) -> None:
        if self.step != expected:
            if self.step == "forward":
                raise RuntimeError(f"cannot run {what} before the input backward of this forward record")
            done = "its input backward" if self.step == "input_done" else "its backward"
            raise RuntimeError(f"cannot run {what} on a forward record that already ran {done}")
        self.step = new


def _flatten(result: Any) -> tuple[Any, ...]:
    """A tuple or list gives its items, anything else is one output; non-tensors are kept so
    that the caller can name the stage that returned one."""
    if isinstance(result, (tuple, list)):
        return tuple(result)
    return (result,)


def stage_forward(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    params: Sequence[Any],
    grad_args: Sequence[bool],
    saved_pool: bool = True,
) -> ForwardRecord:
    """The stage forward, recording the graph. With ``saved_pool`` (the default) a saved-tensor
    hook packs what the graph saves (needed by the dx/dW split, activation swap and memory
    accounting); without it the graph saves as torch does by itself, which costs two Python
    calls less per saved tensor (about a tenth of a small transformer block's forward + backward
    on the CPU), and `releasable` reads the graph instead of the pool."""
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
    if saved_pool:
        pool: _SavedPool | None = _SavedPool()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pool.pack, pool.unpack), active_pool(pool):
            result = fn(*call_args, **kwargs)
    else:
        pool = None
        with torch.enable_grad():
            result = fn(*call_args, **kwargs)
    return ForwardRecord(
        result=result,
        outputs=_flatten(result),
        grad_args=tuple(bool(g) for g in grad_args),
        params=tuple(params),
        native=_TorchState(leaves=tuple(leaves), pool=pool),
    )


def releasable(record: ForwardRecord, tensor: Any) -> bool:
    """Whether dropping ``tensor``'s data keeps the backward correct and frees memory.

    Only a tensor computed in this stage (it has a ``grad_fn``; so not a parameter, buffer,
    input or user tensor) whose storage the graph did not save for its backward. What a custom
    autograd Function keeps on ``ctx`` instead of ``save_for_backward`` is not seen (see
    ``PipelineStage``'s ``free_sent_outputs``).
    """
    state: _TorchState = record.native
    if not (isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None and tensor.layout == torch.strided):
        return False
    ptr = tensor.untyped_storage().data_ptr()
    if state.pool is not None:
        return ptr not in state.pool.storages
    return _not_saved_by_graph(record, tensor, ptr)


_SAVED_FIELDS: dict[type, tuple[str, ...]] = {}  # autograd node type -> its ``_raw_saved_*`` fields
_GENERATED_NODE = re.compile(r"[A-Za-z0-9_]+Backward[0-9]+$")  # the names of torch's generated nodes


def _saved_storages(node: Any) -> list[int] | None:
    """Storages ``node`` saved for its backward; None when that cannot be read. Readable: torch's
    generated nodes (``<Op>Backward<k>``) and custom Functions (what ``save_for_backward`` kept;
    like the pool, not what ``ctx`` holds otherwise); not: C++ custom nodes and anything a
    saved-tensor hook packed (e.g. inside ``torch.utils.checkpoint``)."""
    fields = _SAVED_FIELDS.get(type(node))
    if fields is None:
        name = type(node).__name__
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            fields = ("_raw_saved_tensors",)
        elif _GENERATED_NODE.match(name) is not None or name == "AccumulateGrad":
            fields = tuple(a for a in dir(type(node)) if a.startswith("_raw_saved_"))
        else:
            return None
        _SAVED_FIELDS[type(node)] = fields
    out = []
    for field in fields:
        try:
            raw = getattr(node, field)
            items = [None if item is None else item.data for item in (raw if isinstance(raw, (list, tuple)) else (raw,))]
        except RuntimeError:  # freed by a backward that ran already: cannot tell
            return None
        for data in items:
            if data is None:
                continue
            if not isinstance(data, torch.Tensor):
                return None
            if data.layout == torch.strided:
                out.append(data.untyped_storage().data_ptr())
    return out


def _not_saved_by_graph(record: ForwardRecord, tensor: torch.Tensor, ptr: int) -> bool:
    """`releasable` for a forward run without the pool: whether no node of the graph saved the
    storage of output ``tensor``, read from the graph; unsure means no.

    A view is never released (its base holds the storage). A tensor that is not a view got its
    storage from the node that made it (``grad_fn``) or, for an in-place result, from an earlier
    op whose saved copy the in-place change would already have invalidated; so with one output
    only ``grad_fn`` can have saved it. With several outputs (the runtime gives those stages the
    pool) every node of the graph is read, once per record."""
    if type(tensor) is not torch.Tensor or tensor._base is not None:  # subclasses (DTensor), views
        return False
    state: _TorchState = record.native
    outputs = [o for o in record.outputs if isinstance(o, torch.Tensor)]
    if len(outputs) == 1:
        saved = _saved_storages(tensor.grad_fn)
        return saved is not None and ptr not in saved
    if not state.graph_read:
        state.graph_saved, state.graph_read = _graph_saved(outputs), True
    saved = state.graph_saved
    return saved is not None and ptr not in saved


def _graph_saved(outputs: Sequence[torch.Tensor]) -> frozenset[int] | None:
    """Every storage the graph of ``outputs`` saved; None when a node cannot be read."""
    saved: set[int] = set()
    seen: set[int] = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        storages = _saved_storages(node)
        if storages is None:
            return None
        saved.update(storages)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return frozenset(saved)


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
    state.advance("forward", "done", "a backward")
    leaves = tuple(leaf for leaf in state.leaves if leaf is not None)
    if roots:
        run_engine(roots, root_grads, False, (), True)
    return _input_grads(state, {id(leaf): leaf.grad for leaf in leaves})


def stage_backward_input(record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
    state: _TorchState = record.native
    roots, root_grads = _roots(record, grads)
    state.advance("forward", "input_done", "an input backward")
    leaves = tuple(leaf for leaf in state.leaves if leaf is not None)
    if not roots:
        return _input_grads(state, {})
    if not direct_calls_work():  # fallback: keep the roots and walk the whole graph again for dW
        state.rewalk = (roots, root_grads)
        found = run_engine(roots, root_grads, True, leaves, False) if leaves else ()
    else:
        state.plan = plan = plan_split(gradient_edges(roots), root_grads, leaves)
        # free what only dx needs as the pass goes, like a backward that frees the graph
        pool = state.pool
        if pool is None:  # run without the hook: nothing to free early
            found = plan.run_input(roots, root_grads, leaves)
        else:
            for packed in plan.dx_only_saved():
                if isinstance(packed, _Saved):
                    packed.dx_only = True
            pool.dropping = True
            try:
                found = plan.run_input(roots, root_grads, leaves)
            finally:
                pool.dropping = False
    return _input_grads(state, {id(leaf): g for leaf, g in zip(leaves, found)})


def stage_backward_weight(record: ForwardRecord) -> None:
    state: _TorchState = record.native
    state.advance("input_done", "done", "a weight backward")
    plan, rewalk, state.plan, state.rewalk = state.plan, state.rewalk, None, None
    if plan is not None:
        kept = [packed for packed in plan.boundary_saved() if isinstance(packed, _Saved)]
        try:
            plan.run_weight()
        finally:  # the boundary nodes ran their last time; the rest of the graph freed itself
            for packed in kept:
                packed._tensor = None
    elif rewalk is not None:  # every leaf, as the full backward; the inputs' gradients came from dx
        run_engine(rewalk[0], rewalk[1], False, (), True)
        for leaf in state.leaves:
            if leaf is not None:
                leaf.grad = None
