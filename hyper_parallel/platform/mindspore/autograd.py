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
    autograd at the same moment are unsafe. The dx/dW split keeps the graph after the dx pass and
    walks it again for dW. A Cell with an ``@ms.jit`` construct compiles its backward for the first
    pass only, so for such a stage the dx step also takes dW (kept for the weight step).

``recompute`` (public fallback)
    The forward runs without a graph and keeps ``fn``/args/kwargs; the backward re-runs the
    forward under the public ``ms.grad`` on the surrogate ``sum(out_i * grad_i)`` and uses the
    result at once, so ms.vjp's last-in-first-out limit never matters. Costs one extra forward
    per micro-batch; the dx step computes dx and dW together and keeps dW for the weight step.
    Randomness inside ``fn`` (dropout) is drawn again at backward time, and any side effect of
    ``fn`` happens twice.

Measured on this project's CPU machine (MindSpore 2.10, ``ms.runtime.launch_blocking()``, ms per
micro-batch, forward / backward; the default asynchronous dispatch was 4-10x slower and noisy on
2 shared cores):

=====================  ===========  ==========  ===========  ================
model, micro-batch     engine fwd   engine bwd  engine dx+dW recompute bwd
=====================  ===========  ==========  ===========  ================
2 Dense(8), batch 2    0.33         0.43        0.49         1.17 (fwd 0.30)
4 Dense(256), 32       0.88         1.11        1.31         2.74 (fwd 0.84)
4 Dense(1024), 64      5.7          11.0        14.4         17.1 (fwd 5.5)
=====================  ===========  ==========  ===========  ================

Parameter gradients accumulate, for both paths, in the engine's per-parameter slot
``param._grad`` (``None`` when there is none), which ``MindSporePlatform.get_grad`` reads; a
parameter no output reaches keeps ``None`` on the engine path and gets zeros on the recompute path.
Input gradients: one per positional argument; ``None`` for arguments not flagged in ``grad_args``
and for flagged non-floating tensors; a zeros tensor for a flagged input that no output with a
gradient depends on. Inputs share storage with the caller's tensors: do not overwrite an input
buffer before its backward ran.

``HYPER_PARALLEL_MS_AUTOGRAD=engine|recompute|auto`` chooses the path (``auto``: engine if its
start-up self-test passes, else recompute; ``engine`` raises if it is unavailable).
"""

from __future__ import annotations

import logging
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


def flatten_tensors(obj: Any) -> tuple[Any, ...]:
    """Tensors of a (nested) tuple/list/dict result, in order; other values are skipped."""
    if is_tensor(obj):
        return (obj,)
    if isinstance(obj, (tuple, list)):
        return tuple(t for item in obj for t in flatten_tensors(item))
    if isinstance(obj, dict):
        return tuple(t for item in obj.values() for t in flatten_tensors(item))
    return ()


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


# ---------------------------------------------------------------------------- engine path
class EngineAutograd:
    """Stage autograd on MindSpore's eager engine (private ``run_backward``)."""

    mode = "engine"

    def __init__(self) -> None:
        from mindspore._c_expression import run_backward
        from mindspore.graph.api import _pynative_executor

        self._executor = _pynative_executor
        self._run_backward = run_backward

    def self_test(self) -> None:
        """Forward + split backward on a tiny graph; raises if the engine misbehaves."""
        w = ms.Parameter(ms.Tensor([[2.0]], ms.float32), name="hyper_parallel_selftest_w")
        x = ms.Tensor([[3.0]], ms.float32)
        rec = self.forward(lambda a: ops.matmul(a, w) * a, (x,), {}, (w,), (True,))
        (dx,) = self.backward_input(rec, (ms.Tensor([[1.0]], ms.float32),))
        self.backward_weight(rec)
        rec = self.forward(lambda a: ops.matmul(a, w) + a, (x,), {}, (w,), (True,))
        (dx2,) = self.backward(rec, (ms.Tensor([[1.0]], ms.float32),))
        got = tuple(float(t.asnumpy()[0, 0]) for t in (dx, dx2, w._grad))
        if got != (12.0, 3.0, 12.0):
            raise RuntimeError(f"engine self-test gave dx, dx, dw = {got}, expected (12.0, 3.0, 12.0)")

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
        try:
            result = fn(*call_args, **kwargs)
        finally:
            executor.set_grad_flag(old_flag)
            executor.set_enable_grad(old_enable)
        state = _State(args=tuple(call_args), positions=positions)
        state.extra["jit"] = uses_jit(fn)
        return ForwardRecord(result, flatten_tensors(result), tuple(bool(f) for f in grad_args),
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
        if state.extra.get("jit"):
            # a jit Cell's backward is compiled for the gradients the first pass asks for, so a
            # later weight pass would find nothing: take dW now and keep it for the weight step
            params = tuple(record.params)
            values = self._grads_of(outs, sens, leaves + params, keep_graph=False)
            state.extra["weight_grads"] = values[len(leaves):]
            values = values[: len(leaves)]
        else:
            values = self._grads_of(outs, sens, leaves, keep_graph=True)
            state.pending = (outs, sens)
        grads_in = _input_grads(state.args, state.positions, values)
        state.args = ()
        return grads_in

    def backward_weight(self, record: ForwardRecord) -> None:
        state: _State = record.native
        state.advance("input_done", "done", "a weight backward")
        outs, sens = state.pending or ((), ())
        state.pending = None
        params = tuple(record.params)
        if state.extra.get("weight_grads") is not None:  # jit stage: computed by the input step
            values = state.extra.pop("weight_grads")
        else:
            values = self._grads_of(outs, sens, params, keep_graph=False)
            if outs and params and all(v is None for v in values):
                _warn_once("the weight backward of a stage reached none of its parameters; if the stage "
                           "calls @ms.jit functions outside a Cell's construct, its dx/dW split loses dW: "
                           f"use the full backward or {AUTOGRAD_ENV}=recompute")
        for param, grad in zip(params, values):
            if grad is not None:
                _accumulate(param, grad)


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
        return ForwardRecord(result, flatten_tensors(result), tuple(bool(f) for f in grad_args),
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
            outs = flatten_tensors(fn(*call_args, **kwargs))
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
