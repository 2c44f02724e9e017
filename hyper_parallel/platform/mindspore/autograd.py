"""Stage autograd for MindSpore (PyNative): the one module that touches private engine APIs.

Two interchangeable paths implement ``stage_forward`` / ``stage_backward`` /
``stage_backward_input`` / ``stage_backward_weight`` (semantics in ``platform/base.py``):

``engine`` (default when available)
    MindSpore's eager autograd engine (``_pynative_executor`` + ``_c_expression.run_backward``,
    both private). The forward records a graph (the grad flag is per thread and ``ms.grad`` resets
    it, so it is set on every forward call); differentiable arguments become fresh leaves
    (``ops.stop_gradient``, which shares storage, then ``requires_grad_``) so a backward never
    reaches an earlier stage's graph. Works in any micro-batch order, and from several threads
    that take turns (even when the turn passes in the middle of a forward); two threads running
    autograd at the same moment are unsafe. The dx/dW split (``_SplitPlan``) captures the gradient
    at each boundary node (input-side node with edges into the weight side) during dx, then cuts
    those nodes' input-side edges and runs the engine once from the captured gradients for dW, so
    the input side is walked once; if its self-test fails, dW walks the whole graph again. The
    gradient captured at a boundary node already went through the tensor hooks of that node's
    outputs (``Tensor.register_hook`` inside the stage), and the engine would run them again when
    the weight pass starts there: the hooks registered during the forward are recorded
    (``_record_hooks``) and those on input-side nodes, all fired by then, are removed after dx, so
    every tensor hook fires once per backward, as in the full backward. (Hooks on a backward node
    itself, the private ``_grad_node.register_prehook``, cannot be found that way: on a boundary
    node they run in both passes.) A Cell
    with an ``@ms.jit`` construct compiles its backward for the first pass only, so for such a
    stage the dx step also takes dW (kept for the weight step).

``recompute`` (public fallback)
    The forward runs without a graph and keeps ``fn``/args/kwargs; the backward re-runs the
    forward under the public ``ms.grad`` on the surrogate ``sum(out_i * grad_i)`` and uses the
    result at once, so ms.vjp's last-in-first-out limit never matters. Costs one extra forward
    per micro-batch; the dx step computes dx and dW together and keeps dW for the weight step.
    Randomness inside ``fn`` (dropout) is drawn again at backward time, and any side effect of
    ``fn`` happens twice.

Measured on this project's CPU machine (MindSpore 2.10, ``ms.runtime.launch_blocking()``, ms per
micro-batch through ``MindSporePlatform``, wall time, median of 40, the variants alternating in one
process; a ``SequentialCell`` of Dense layers; the default asynchronous dispatch was 4-10x slower
and noisy on 2 shared cores). "walk twice" is the split this module falls back to:

=====================  ==========  ==========  ============  ===========  ===================
model, micro-batch     engine fwd  engine bwd  engine dx+dW  walk twice   recompute bwd (fwd)
=====================  ==========  ==========  ============  ===========  ===================
2 Dense(8), batch 2    1.47        0.51        1.03          0.92         4.36 (1.36)
4 Dense(256), 32       3.17        1.50        2.59          2.55         4.19 (2.77)
4 Dense(1024), 64      8.59        14.69       17.60         22.14        23.88 (8.51)
=====================  ==========  ==========  ============  ===========  ===================

For a stage of a few layers both splits cost the same (fixed costs dominate: every boundary node
runs in both steps, and each executed backward node costs tens of microseconds before any
arithmetic); the engine split wins as stages grow (GPT stage of ``benchmarks/autograd_split_cost.py``:
see its results table and ``docs/zero_bubble.md``).

The parameters differentiated are the stage's plus, on the last stage, the trainable ones of a
``loss_fn`` Cell (``with_loss_params``; the platform's stage runner adds them). Parameter gradients
accumulate, for both paths, in the engine's per-parameter slot
``param._grad`` (``None`` when there is none), which ``MindSporePlatform.get_grad`` reads; a
parameter no output reaches keeps ``None`` on the engine path and gets zeros on the recompute path.
Input gradients: one per positional argument; ``None`` for arguments not flagged in ``grad_args``
and for flagged non-floating tensors; a zeros tensor for a flagged input that no output with a
gradient depends on. Inputs share storage with the caller's tensors: do not overwrite an input
buffer before its backward ran.

``HYPER_PARALLEL_MS_AUTOGRAD=engine|recompute|auto`` chooses the path (``auto``: engine if its
start-up self-test passes, else recompute; ``engine`` raises if it is unavailable). Whether a
stage's Cell runs compiled, and how GRAPH_MODE is handled, is ``compiled.py``'s job.
"""

from __future__ import annotations

import logging
import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mindspore as ms
from mindspore import ops

from hyper_parallel.platform.base import ForwardRecord

AUTOGRAD_ENV = "HYPER_PARALLEL_MS_AUTOGRAD"
AUTOGRAD_MODES = ("auto", "engine", "recompute")
_logger = logging.getLogger("hyper_parallel")


# ---------------------------------------------------------------------------- helpers
def is_tensor(obj: Any) -> bool:
    return isinstance(obj, ms.Tensor)


def stage_outputs(result: Any) -> tuple[Any, ...]:
    """The outputs of a stage's result, as the torch backend sees them.

    A tuple or list gives its items, anything else is one output. Non-tensors are kept in
    place (not skipped), so the caller can name the stage that returned one instead of the
    next stage finding an argument missing.
    """
    if isinstance(result, (tuple, list)):
        return tuple(result)
    return (result,)


_FLOAT_DTYPES = (ms.float16, ms.float32, ms.float64, ms.bfloat16)


def _is_float(t: Any) -> bool:
    return t.dtype in _FLOAT_DTYPES


def _check_grad_args(args: Sequence[Any], grad_args: Sequence[bool]) -> tuple[int, ...]:
    if len(grad_args) != len(args):
        raise ValueError(f"grad_args has {len(grad_args)} flags for {len(args)} positional arguments")
    positions = []
    for i, (arg, flag) in enumerate(zip(args, grad_args)):
        if not flag:
            continue
        if not is_tensor(arg):
            raise TypeError(f"positional argument {i} is flagged differentiable but is a {type(arg).__name__}")
        if _is_float(arg):
            positions.append(i)
    return tuple(positions)


def _check_grads(record: ForwardRecord, grads: Sequence[Any]) -> list[tuple[Any, Any]]:
    """(output, grad) pairs that carry a gradient."""
    if len(grads) != len(record.outputs):
        raise ValueError(f"got {len(grads)} output gradients for {len(record.outputs)} outputs")
    pairs = []
    for i, (out, grad) in enumerate(zip(record.outputs, grads)):
        if grad is None:
            continue
        if not is_tensor(grad):
            raise TypeError(f"gradient of output {i} must be a Tensor or None, got {type(grad).__name__}")
        if not is_tensor(out):
            raise TypeError(f"output {i} is a {type(out).__name__}, not a tensor: it cannot take a gradient")
        if tuple(grad.shape) != tuple(out.shape):
            raise ValueError(f"gradient of output {i} has shape {tuple(grad.shape)}, output has {tuple(out.shape)}")
        pairs.append((out, grad))
    return pairs


def _accumulate(param: Any, grad: Any) -> None:
    current = getattr(param, "_grad", None)
    param._grad = grad if current is None else current + grad


def _input_grads(args: Sequence[Any], positions: Sequence[int], values: Sequence[Any]) -> tuple[Any, ...]:
    """One entry per positional argument; zeros where a differentiable input was not reached."""
    result: list[Any] = [None] * len(args)
    for pos, value in zip(positions, values):
        result[pos] = ops.zeros_like(args[pos]) if value is None else value
    return tuple(result)


_JIT_CELLS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _trainable(params: Sequence[Any]) -> tuple[Any, ...]:
    """Parameters that take gradients (one frozen after the stage was built is left out)."""
    return tuple(p for p in params if getattr(p, "requires_grad", True))


def with_loss_params(fn: Any, params: Sequence[Any]) -> tuple[Any, ...]:
    """``params`` and, for the pipeline's last-stage closure (it names its loss with
    ``hyper_parallel_loss_fn``, found through ``__wrapped__``), the trainable parameters of a
    ``loss_fn`` Cell that are not among them: the backward differentiates with respect to exactly
    these, so without them a loss Cell's own parameters would get no gradient."""
    loss = None
    while loss is None and fn is not None and not isinstance(fn, ms.nn.Cell):
        loss = getattr(fn, "hyper_parallel_loss_fn", None)
        fn = getattr(fn, "__wrapped__", None)
    params = tuple(params)
    if not isinstance(loss, ms.nn.Cell):
        return params
    seen = {id(p) for p in params}
    return params + tuple(p for p in _trainable(loss.trainable_params()) if id(p) not in seen)


def uses_jit(fn: Any) -> bool:
    """Whether ``fn`` is an ``@ms.jit`` function or a Cell with an ``@ms.jit`` construct inside.

    A wrapper (e.g. the pipeline runtime's loss closure) points at what it wraps with ``__wrapped__``.
    """
    while not isinstance(fn, ms.nn.Cell) and hasattr(fn, "__wrapped__"):
        if getattr(fn, "__wrapped_by_jit__", False):
            return True
        fn = fn.__wrapped__
    if getattr(fn, "__wrapped_by_jit__", False):
        return True
    if not isinstance(fn, ms.nn.Cell):
        return False
    found = _JIT_CELLS.get(fn)
    if found is None:
        found = any(getattr(c.construct, "__wrapped_by_jit__", False) for _, c in fn.cells_and_names())
        _JIT_CELLS[fn] = found
    return found


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        _logger.warning("hyper_parallel: %s", message)


@dataclass
class _State:
    """Backend-private part of a :class:`ForwardRecord`."""

    args: tuple[Any, ...]
    positions: tuple[int, ...]
    step: str = "forward"  # forward -> input_done -> done
    pending: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def advance(self, expected: str, new: str, what: str) -> None:
        if self.step != expected:
            if self.step == "forward":
                raise RuntimeError(f"cannot run {what} before the input backward of this forward record")
            done = "its input backward" if self.step == "input_done" else "its backward"
            raise RuntimeError(f"cannot run {what} on a forward record that already ran {done}")
        self.step = new


# ---------------------------------------------------------------------------- tensor hooks
_HOOKS = threading.local()  # .recording: list of (handle, node id) while a stage forward runs here


def _record_hooks() -> None:
    """Make ``Tensor.register_hook`` (and ``Parameter``'s, which calls it) also note, while this
    thread runs a stage forward, each hook's handle and the backward node of its tensor. Installed
    once per process; outside a stage forward it only reads a thread-local."""
    original = ms.Tensor.register_hook
    if getattr(original, "_hyper_parallel_records", False):
        return

    @functools.wraps(original)
    def register_hook(self: Any, hook: Any) -> Any:
        handle = original(self, hook)
        recording = getattr(_HOOKS, "recording", None)
        if recording is not None:
            recording.append((handle, _node_id(self)))
        return handle

    register_hook._hyper_parallel_records = True  # type: ignore[attr-defined]
    ms.Tensor.register_hook = register_hook


def _remove_fired_hooks(state: _State, input_side: set[int]) -> None:
    """Take the hooks of input-side nodes (fired by the input backward) off before the weight pass."""
    for handle, node in state.extra.pop("hooks", ()):
        if node in input_side:
            handle.remove()


# ---------------------------------------------------------------------------- engine path
class EngineAutograd:
    """Stage autograd on MindSpore's eager engine (private ``run_backward``)."""

    mode = "engine"

    def __init__(self) -> None:
        from mindspore._c_expression import run_backward
        from mindspore.graph.api import _pynative_executor

        self._executor = _pynative_executor
        self._run_backward = run_backward
        self.cut_split = _CUT_SPLIT[0] if _CUT_SPLIT else True  # see ``_SplitPlan``; off if its self-test fails
        _record_hooks()

    def self_test(self) -> None:
        """Forward + split backward on a tiny graph; raises if the engine misbehaves. If only the
        cheap dx/dW split misbehaves, falls back (for this process) to the split that walks twice."""
        try:
            self._check()
        except Exception as exc:  # noqa: BLE001 - retried below without the cheap split
            if not self.cut_split:
                raise
            self.cut_split = False
            self._check()
            _warn_once(f"the cheap dx/dW split failed its self-test ({type(exc).__name__}: {exc}); "
                       "the weight backward walks the whole graph again")
        _CUT_SPLIT[:] = [self.cut_split]

    def _check(self) -> None:
        w = ms.Parameter(ms.Tensor([[2.0]], ms.float32), name="hyper_parallel_selftest_w")
        x = ms.Tensor([[3.0]], ms.float32)
        rec = self.forward(lambda a: ops.matmul(a, w) * a, (x,), {}, (w,), (True,))
        (dx,) = self.backward_input(rec, (ms.Tensor([[1.0]], ms.float32),))
        split_dw = None if w._grad is None else float(w._grad.asnumpy()[0, 0])
        self.backward_weight(rec)
        rec = self.forward(lambda a: ops.matmul(a, w) + a, (x,), {}, (w,), (True,))
        (dx2,) = self.backward(rec, (ms.Tensor([[1.0]], ms.float32),))
        got = tuple(float(t.asnumpy()[0, 0]) for t in (dx, dx2, w._grad))
        if got != (12.0, 3.0, 12.0) or split_dw is not None:
            raise RuntimeError(f"engine self-test gave dx, dx, dw = {got} (dW after dx: {split_dw}), "
                               "expected (12.0, 3.0, 12.0) (None)")

    def forward(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        params: Sequence[Any],
        grad_args: Sequence[bool],
    ) -> ForwardRecord:
        positions = _check_grad_args(args, grad_args)
        call_args = list(args)
        for pos in positions:
            leaf = ops.stop_gradient(args[pos])
            leaf.requires_grad_()
            call_args[pos] = leaf
        executor = self._executor
        old_flag, old_enable = executor.grad_flag(), executor.enable_grad()
        executor.set_grad_flag(True)  # per thread; ms.grad & co. reset it
        executor.set_enable_grad(True)
        hooks: list[tuple[Any, int | None]] = []
        outer, _HOOKS.recording = getattr(_HOOKS, "recording", None), hooks
        try:
            result = fn(*call_args, **kwargs)
        finally:
            _HOOKS.recording = outer
            executor.set_grad_flag(old_flag)
            executor.set_enable_grad(old_enable)
        if outer is not None:  # a stage forward inside another one: the outer record sees these too
            outer.extend(hooks)
        state = _State(args=tuple(call_args), positions=positions)
        state.extra["jit"] = uses_jit(fn)
        if hooks:
            state.extra["hooks"] = hooks
        return ForwardRecord(result, stage_outputs(result), tuple(bool(f) for f in grad_args),
                             _trainable(params), state)

    @staticmethod
    def _roots(record: ForwardRecord, grads: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        pairs = [(o, g) for o, g in _check_grads(record, grads)
                 if o._requires_grad or o._grad_node is not None]
        return tuple(o for o, _ in pairs), tuple(g for _, g in pairs)

    def _grads_of(self, outs: tuple[Any, ...], sens: tuple[Any, ...], targets: tuple[Any, ...],
                  keep_graph: bool) -> Sequence[Any]:
        """Gradients of ``targets`` (``None`` where unreached); never ``accumulate_grad=True``:
        when one gradient tensor must land in two leaves' ``_grad`` the engine clones it, and
        the CPU build has no Clone kernel ("The kernel Clone unregistered")."""
        if not outs or not targets:
            return [None] * len(targets)
        return self._run_backward(outs, sens, keep_graph, False, targets, True, accumulate_grad=False)

    def backward(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        state: _State = record.native
        outs, sens = self._roots(record, grads)
        state.advance("forward", "done", "a backward")
        leaves = tuple(state.args[p] for p in state.positions)
        values = self._grads_of(outs, sens, leaves + tuple(record.params), keep_graph=False)
        for param, grad in zip(record.params, values[len(leaves):]):
            if grad is not None:
                _accumulate(param, grad)
        grads_in = _input_grads(state.args, state.positions, values[: len(leaves)])
        state.args = ()
        return grads_in

    def backward_input(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        state: _State = record.native
        outs, sens = self._roots(record, grads)
        state.advance("forward", "input_done", "an input backward")
        leaves = tuple(state.args[p] for p in state.positions)
        params = tuple(record.params)
        if state.extra.get("jit"):
            # a jit Cell's backward is compiled for the gradients the first pass asks for, so a
            # later weight pass would find nothing: take dW now and keep it for the weight step
            values = self._grads_of(outs, sens, leaves + params, keep_graph=False)
            state.extra["weight_grads"] = values[len(leaves):]
            values = values[: len(leaves)]
        elif self.cut_split and outs and leaves:
            plan = _plan_split(outs, leaves, params)
            handles = [node.register_prehook(functools.partial(_store, plan.captured, i))
                       for i, (node, _) in enumerate(plan.boundary)]
            try:
                values = self._grads_of(outs, sens, leaves, keep_graph=True)
            finally:
                for handle in handles:
                    handle.remove()
            plan.weight_roots = tuple((o, g) for o, g in zip(outs, sens) if _node_id(o) in plan.weight_side_roots)
            _remove_fired_hooks(state, plan.input_side)
            state.pending = plan
        else:
            values = self._grads_of(outs, sens, leaves, keep_graph=True)
            state.pending = (outs, sens)
        grads_in = _input_grads(state.args, state.positions, values)
        state.args = ()
        return grads_in

    def backward_weight(self, record: ForwardRecord) -> None:
        state: _State = record.native
        state.advance("input_done", "done", "a weight backward")
        pending, state.pending = state.pending, None
        params = tuple(record.params)
        if state.extra.get("weight_grads") is not None:  # jit stage: computed by the input step
            values = state.extra.pop("weight_grads")
        elif isinstance(pending, _SplitPlan):
            values = self._weight_grads(pending, params)
        else:
            outs, sens = pending or ((), ())
            values = self._grads_of(outs, sens, params, keep_graph=False)
        if params and all(v is None for v in values) and pending:
            _warn_once("the weight backward of a stage reached none of its parameters; if the stage "
                       "calls @ms.jit functions outside a Cell's construct, its dx/dW split loses dW: "
                       f"use the full backward or {AUTOGRAD_ENV}=recompute")
        for param, grad in zip(params, values):
            if grad is not None:
                _accumulate(param, grad)

    def _weight_grads(self, plan: _SplitPlan, params: tuple[Any, ...]) -> Sequence[Any]:
        """Weight gradients from the gradients captured at the boundary nodes (see ``_SplitPlan``)."""
        from mindspore.graph.api import _GradientEdge

        roots: list[Any] = []
        sens: list[Any] = []
        for (node, weight), captured in zip(plan.boundary, plan.captured):
            if captured is None:
                continue
            for k in range(len(node.next_functions)):
                if k not in weight:
                    node._set_next_edge(k, None)  # the input side is done: cut it off
            for slot, grad in enumerate(captured):
                if grad is not None:
                    roots.append(_GradientEdge(node, slot, None))
                    sens.append(grad)
        for out, grad in plan.weight_roots:
            roots.append(out)
            sens.append(grad)
        plan.captured = []
        return self._grads_of(tuple(roots), tuple(sens), params, keep_graph=False)


def _store(captured: list[Any], index: int, grads: Any) -> None:
    captured[index] = tuple(grads)


def _node_id(tensor: Any) -> int | None:
    node = tensor._grad_node
    return None if node is None else node._unique_id()


@dataclass
class _SplitPlan:
    """What the engine's input backward keeps for the weight backward.

    The graph below a stage's outputs splits into an input side (nodes from which a differentiable
    input can be reached) and a weight side (the other nodes from which a parameter can be
    reached). Boundary nodes are input-side nodes with edges into the weight side (the MatMul of
    a Dense layer). The input backward captures the gradient arriving at each boundary node with
    a prehook; the weight backward cuts each boundary node's input-side edges and runs the engine
    once from the captured gradients, so it computes weight gradients only and never walks the
    input side again.
    """

    boundary: list[tuple[Any, tuple[int, ...]]]  # (node, indices of its weight-side edges)
    weight_side_roots: set[int]  # ids of output nodes on the weight side (outputs of parameters only)
    input_side: set[int] = field(default_factory=set)  # ids of the input-side nodes (run by dx)
    captured: list[Any] = field(default_factory=list)
    weight_roots: tuple[tuple[Any, Any], ...] = ()


def _plan_split(outs: Sequence[Any], leaves: Sequence[Any], params: Sequence[Any]) -> _SplitPlan:
    """Walk the graph below ``outs`` once (post-order; node wrappers are keyed by ``_unique_id``)."""
    input_ids = {_node_id(t) for t in leaves}
    param_ids = {_node_id(p) for p in params if getattr(p, "_grad_node", None) is not None}
    side: dict[int, int] = {}  # node id -> 0 neither, 1 input side, 2 weight side
    boundary: list[tuple[Any, tuple[int, ...]]] = []
    for out in outs:
        root = out._grad_node
        if root is None or root._unique_id() in side:
            continue
        stack = [(root, root.next_functions, 0)]
        side[root._unique_id()] = -1  # on the stack
        while stack:
            node, nexts, k = stack[-1]
            while k < len(nexts) and (nexts[k][0] is None or nexts[k][0]._unique_id() in side):
                k += 1
            if k < len(nexts):
                stack[-1] = (node, nexts, k + 1)
                child = nexts[k][0]
                side[child._unique_id()] = -1
                stack.append((child, child.next_functions, 0))
                continue
            stack.pop()
            uid = node._unique_id()
            if node.is_leaf():
                side[uid] = 1 if uid in input_ids else 2 if uid in param_ids else 0
                continue
            kinds = [0 if c is None else side[c._unique_id()] for c, _ in nexts]
            if 1 in kinds:
                side[uid] = 1
                weight = tuple(i for i, kind in enumerate(kinds) if kind == 2)
                if weight:
                    boundary.append((node, weight))
            else:
                side[uid] = 2 if 2 in kinds else 0
    weight_roots = {i for i in (_node_id(o) for o in outs) if i is not None and side.get(i) == 2}
    input_side = {uid for uid, kind in side.items() if kind == 1}
    return _SplitPlan(boundary, weight_roots, input_side, [None] * len(boundary))


# ---------------------------------------------------------------------------- recompute path
class RecomputeAutograd:
    """Stage autograd on public APIs only: re-run the forward under ``ms.grad`` at backward time."""

    mode = "recompute"

    def __init__(self) -> None:
        try:  # optional: only saves recording a graph nobody uses in the forward
            from mindspore.graph.api import _pynative_executor
        except ImportError:
            _pynative_executor = None
        self._executor = _pynative_executor

    def forward(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        params: Sequence[Any],
        grad_args: Sequence[bool],
    ) -> ForwardRecord:
        positions = _check_grad_args(args, grad_args)
        call_args = list(args)
        for pos in positions:
            call_args[pos] = ops.stop_gradient(args[pos])
        executor = self._executor
        old_flag = executor.grad_flag() if executor is not None else None
        if executor is not None:
            executor.set_grad_flag(False)
        try:
            result = fn(*call_args, **kwargs)
        finally:
            if executor is not None:
                executor.set_grad_flag(old_flag)
        state = _State(args=tuple(call_args), positions=positions)
        state.extra.update(fn=fn, kwargs=dict(kwargs))
        return ForwardRecord(result, stage_outputs(result), tuple(bool(f) for f in grad_args),
                             _trainable(params), state)

    def _gradients(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[list[Any], tuple[Any, ...]]:
        """(input grads at the differentiable positions, parameter grads) of one record."""
        state: _State = record.native
        pairs = [(i, g) for i, (o, g) in enumerate(zip(record.outputs, grads))
                 if g is not None and _is_float(o)]
        n_in, params = len(state.positions), tuple(record.params)
        if not pairs or (n_in == 0 and not params):
            return [None] * n_in, ()
        fn, kwargs, args = state.extra["fn"], state.extra["kwargs"], state.args

        def surrogate(*diff: Any) -> Any:
            call_args = list(args)
            for pos, value in zip(state.positions, diff):
                call_args[pos] = value
            outs = stage_outputs(fn(*call_args, **kwargs))
            total = None
            for i, g in pairs:
                term = (outs[i] * g).sum()
                total = term if total is None else total + term
            return total

        grad_position = tuple(range(n_in)) if n_in else None
        result = ms.grad(surrogate, grad_position=grad_position, weights=params or None)(
            *[args[p] for p in state.positions])
        if n_in and params:
            dx, dw = result
        elif n_in:
            dx, dw = result, ()
        else:
            dx, dw = (), result
        dx = [dx] if is_tensor(dx) else list(dx)
        return dx, tuple(dw)

    def backward(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        state: _State = record.native
        _check_grads(record, grads)
        state.advance("forward", "done", "a backward")
        dx, dw = self._gradients(record, grads)
        for p, g in zip(record.params, dw):
            _accumulate(p, g)
        out = _input_grads(state.args, state.positions, dx)
        state.args, state.extra = (), {}
        return out

    def backward_input(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        state: _State = record.native
        _check_grads(record, grads)
        state.advance("forward", "input_done", "an input backward")
        dx, dw = self._gradients(record, grads)
        state.pending = dw
        out = _input_grads(state.args, state.positions, dx)
        state.args, state.extra = (), {}
        return out

    def backward_weight(self, record: ForwardRecord) -> None:
        state: _State = record.native
        state.advance("input_done", "done", "a weight backward")
        for p, g in zip(record.params, state.pending or ()):
            _accumulate(p, g)
        state.pending = None


# ---------------------------------------------------------------------------- selection
StageAutograd = EngineAutograd | RecomputeAutograd


def requested_mode() -> str:
    mode = os.environ.get(AUTOGRAD_ENV, "auto").strip().lower() or "auto"
    if mode not in AUTOGRAD_MODES:
        raise ValueError(f"{AUTOGRAD_ENV}={mode!r} is not valid; choose one of {', '.join(AUTOGRAD_MODES)}")
    return mode


def create_autograd(mode: str | None = None) -> StageAutograd:
    """The stage-autograd backend for ``mode`` (default: ``HYPER_PARALLEL_MS_AUTOGRAD``)."""
    mode = requested_mode() if mode is None else mode
    if mode not in AUTOGRAD_MODES:
        raise ValueError(f"autograd mode {mode!r} is not valid; choose one of {', '.join(AUTOGRAD_MODES)}")
    if mode == "recompute":
        return RecomputeAutograd()
    problem = _engine_problem()
    if problem is None:
        return EngineAutograd()
    if mode == "engine":
        raise RuntimeError(
            f"{AUTOGRAD_ENV}=engine, but MindSpore {ms.__version__}'s eager autograd engine is not usable "
            f"({problem}); unset it to fall back to the recompute path"
        )
    _logger.warning("hyper_parallel: MindSpore eager autograd engine unavailable (%s); using the "
                    "recompute path (one extra forward per micro-batch)", problem)
    return RecomputeAutograd()


_ENGINE_CHECK: list[str | None] = []  # the start-up self-test runs once per process
_CUT_SPLIT: list[bool] = []  # whether the cheap dx/dW split passed it
_ENGINE_CHECK_LOCK = threading.Lock()


def _engine_problem() -> str | None:
    """``None`` when the private engine imports and passes its self-test, else what went wrong."""
    with _ENGINE_CHECK_LOCK:
        if not _ENGINE_CHECK:
            try:
                EngineAutograd().self_test()
                _ENGINE_CHECK.append(None)
            except Exception as exc:  # noqa: BLE001 - any failure means the private engine is unusable
                _ENGINE_CHECK.append(f"{type(exc).__name__}: {exc}")
    return _ENGINE_CHECK[0]
