"""Compiled stages and graph mode for the MindSpore backend.

MindSpore's ``GRAPH_MODE`` compiles every ``Cell`` call into a graph that the eager autograd
engine never sees: a stage run that way computes correct outputs but records nothing to
differentiate, so its backward finds no gradient (and nothing says so). This module makes
stages run compiled *and* differentiable, in either mode:

* While a stage's forward or backward runs, the context is switched to ``PYNATIVE_MODE``
  (and back; :class:`PyNativeScope`). Ops outside compiled graphs then record for autograd,
  so the loss of the last stage and anything else the stage function computes around its
  Cell get their gradients, whatever the user's mode.
* The stage's Cell is called through a cached ``ms.jit`` function (:func:`compiled_call`):
  one compiled graph per input signature, run as one node of the eager engine, whose backward
  is a compiled graph too (no forward recompute). With the pipeline's last stage the Cell
  sits in a loss closure; :func:`route` finds it among the closure's variables and swaps in
  the compiled call (``fn.__wrapped__`` names it).

``HYPER_PARALLEL_MS_COMPILE`` (or ``MindSporePlatform(compile=...)``) chooses:

``auto`` (default)
    compile stages when the user's context is ``GRAPH_MODE``; in ``PYNATIVE_MODE`` run them as
    written (a construct the user decorated with ``@ms.jit`` is compiled by MindSpore itself).
``jit``
    compile stages in both modes.
``eager``
    never compile: in ``GRAPH_MODE`` the stages run op by op in PyNative (correct, slow; for
    debugging a stage that does not compile).

A compiled stage computes dW in the same compiled backward as dx: its input backward takes
both and keeps dW for the weight step (a compiled node runs its backward once: a second pass
for dW gives ``None``, measured). Measured costs and the choice between paths: ``docs/mindspore.md``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import mindspore as ms

COMPILE_ENV = "HYPER_PARALLEL_MS_COMPILE"
COMPILE_MODES = ("auto", "jit", "eager")
_logger = logging.getLogger("hyper_parallel")


def requested_compile(value: str | None = None) -> str:
    """The compile mode asked for by ``value`` or, when ``None``, by ``HYPER_PARALLEL_MS_COMPILE``."""
    source = f"compile={value!r}" if value is not None else f"{COMPILE_ENV}"
    mode = (os.environ.get(COMPILE_ENV, "auto") if value is None else value).strip().lower() or "auto"
    if mode not in COMPILE_MODES:
        raise ValueError(f"{source}: {mode!r} is not a compile mode; choose one of {', '.join(COMPILE_MODES)}")
    return mode


def is_graph_mode(mode: int) -> bool:
    return mode == ms.GRAPH_MODE


# ---------------------------------------------------------------------------- mode switch
def _set_mode(mode: int) -> None:
    ms.set_context(mode=mode)
    # ``set_context(mode=...)`` appends a record to a per-thread list nothing reads; drop it so
    # that switching twice per stage step does not grow it for the whole run.
    with contextlib.suppress(Exception):
        from mindspore import context as ms_context

        stack = ms_context._context()._context_switches.context_stack
        if stack:
            stack.pop()


class PyNativeScope:
    """Runs its body in ``PYNATIVE_MODE`` and restores the user's mode after it.

    Process-wide and reentrant across threads (LocalCluster ranks are threads that take turns,
    and a turn can pass inside a stage's forward): the first entry saves the user's mode and
    the last exit restores it, so ranks never see each other's half-restored context.
    """

    _lock = threading.Lock()
    _depth = 0
    _saved: int | None = None

    def __enter__(self) -> int:
        """Returns the user's mode (``GRAPH_MODE`` or ``PYNATIVE_MODE``)."""
        cls = type(self)
        with cls._lock:
            if cls._depth == 0:
                cls._saved = ms.get_context("mode")
                if is_graph_mode(cls._saved):
                    _set_mode(ms.PYNATIVE_MODE)
            cls._depth += 1
            assert cls._saved is not None
            return cls._saved

    def __exit__(self, *exc: object) -> None:
        cls = type(self)
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0 and cls._saved is not None and is_graph_mode(cls._saved):
                _set_mode(cls._saved)


def user_mode() -> int:
    """The user's context mode, also while a stage step runs in :class:`PyNativeScope` (on this or
    another rank thread)."""
    with PyNativeScope._lock:
        if PyNativeScope._depth > 0 and PyNativeScope._saved is not None:
            return PyNativeScope._saved
        return ms.get_context("mode")


# ---------------------------------------------------------------------------- compiled calls
# Held for the life of the process, not weakly: MindSpore caches what it compiled by the identity of
# the function, and a class freed (with its construct) lets a new one take the same address and be
# handed the old graph (seen as "the parameters number of the function is 1, but ... 4" when classes
# were made on the fly). Classes are few; the Cells (and their parameters) stay weakly held below.
_CONSTRUCTS: dict[type, Callable[..., Any]] = {}
_COMPILED: weakref.WeakKeyDictionary[Any, CompiledCell] = weakref.WeakKeyDictionary()
_COMPILED_LOCK = threading.Lock()


class CompiledCell:
    """Calls a Cell's construct compiled by ``ms.jit`` (like ``@ms.jit`` on the class's construct:
    one jit function per Cell class, one compiled graph per instance and input signature, i.e.
    shapes, dtypes and the values of non-tensor arguments). Holds the Cell weakly. Like any
    graph it skips ``Cell.__call__``'s Python hooks."""

    __wrapped_by_jit__ = True  # what ``autograd.uses_jit`` looks for

    def __init__(self, cell: ms.nn.Cell, construct: Callable[..., Any]) -> None:
        self._cell = weakref.ref(cell)
        self._construct = construct

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._construct(self._cell(), *args, **kwargs)


def compiled_call(cell: ms.nn.Cell) -> CompiledCell:
    """The :class:`CompiledCell` of ``cell``, made once per Cell."""
    with _COMPILED_LOCK:
        fn = _COMPILED.get(cell)
        if fn is None:
            cls = type(cell)
            construct = _CONSTRUCTS.get(cls)
            if construct is None:
                construct = ms.jit(cls.construct)
                _CONSTRUCTS[cls] = construct
            fn = CompiledCell(cell, construct)
            _COMPILED[cell] = fn
    return fn


def _is_compiled(fn: Any) -> bool:
    from hyper_parallel.platform.mindspore.autograd import uses_jit

    return uses_jit(fn)


def route(fn: Callable[..., Any]) -> tuple[Callable[..., Any], bool]:
    """``fn`` with its stage Cell called through :func:`compiled_call`, and whether that worked.

    ``fn`` is the Cell itself, or a function that calls it through a closure variable and names
    it with ``__wrapped__`` (the pipeline's loss closure). A Cell whose construct is already an
    ``@ms.jit`` function is left as it is (and counts as compiled).
    """
    if isinstance(fn, ms.nn.Cell):
        if _is_compiled(fn):
            return fn, True
        return (compiled_call(fn), True) if "construct" not in vars(fn) else (fn, False)
    cell = getattr(fn, "__wrapped__", None)
    if not isinstance(cell, ms.nn.Cell) or not isinstance(fn, types.FunctionType):
        return fn, False
    if _is_compiled(cell):
        return fn, True
    if "construct" in vars(cell):  # an instance's own construct: not the class's to compile
        return fn, False
    closure = fn.__closure__ or ()
    slots = [i for i, c in enumerate(closure) if _cell_contents(c) is cell]
    if not slots:
        return fn, False
    compiled = compiled_call(cell)
    new_closure = tuple(types.CellType(compiled) if i in slots else c for i, c in enumerate(closure))
    routed = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, new_closure)
    routed.__kwdefaults__ = fn.__kwdefaults__
    routed.__wrapped__ = compiled  # type: ignore[attr-defined]  # tells the engine it is compiled
    return routed, True


def _cell_contents(closure_cell: Any) -> Any:
    try:
        return closure_cell.cell_contents
    except ValueError:  # an empty closure cell
        return None


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        _logger.warning("hyper_parallel: %s", message)


# ---------------------------------------------------------------------------- the platform's stage runner
class StageRunner:
    """What ``MindSporePlatform.stage_*`` call: an autograd path (engine or recompute, see
    ``autograd.py``) with every step run in :class:`PyNativeScope` and, where the compile mode
    says so, the stage's Cell compiled (:func:`route`)."""

    def __init__(self, autograd: str | None = None, compile: str | None = None) -> None:  # noqa: A002
        self._autograd_request = autograd
        self.compile_mode = requested_compile(compile)
        self._backend: Any = None
        self._lock = threading.Lock()

    @property
    def backend(self) -> Any:
        # created on first use: no tensor exists before communication.init() on Ascend
        if self._backend is None:
            from hyper_parallel.platform.mindspore.autograd import create_autograd

            with self._lock, PyNativeScope():
                if self._backend is None:
                    self._backend = create_autograd(self._autograd_request)
        return self._backend

    @property
    def mode(self) -> str:
        return self.backend.mode

    def compiles(self, user_mode: int) -> bool:
        """Whether stages are compiled when the user's context is ``user_mode``."""
        return self.compile_mode == "jit" or (self.compile_mode == "auto" and is_graph_mode(user_mode))

    def forward(self, fn: Callable[..., Any], args: Any, kwargs: dict[str, Any], params: Any, grad_args: Any) -> Any:
        from hyper_parallel.platform.mindspore.autograd import with_loss_params

        backend = self.backend
        params = with_loss_params(fn, params)  # before route(): it drops the closure's attributes
        with PyNativeScope() as user_mode:
            compiled = False
            if self.compiles(user_mode):
                fn, compiled = route(fn)
                if not compiled:
                    warn_once(f"cannot compile the stage function {fn!r}: only a Cell (with its class's "
                              "construct) or a function calling one through a closure variable and naming it "
                              "with __wrapped__ can be; it runs op by op (correct, not compiled)")
            try:
                record = backend.forward(fn, args, kwargs, params, grad_args)
            except Exception as exc:
                if compiled:
                    exc.add_note(f"hyper_parallel: the stage ran compiled by ms.jit ({COMPILE_ENV}="
                                 f"{self.compile_mode}); {COMPILE_ENV}=eager runs it op by op instead")
                raise
        if backend.mode == "engine":
            _check_recorded(record)
        return record

    def backward(self, record: Any, grads: Any) -> tuple[Any, ...]:
        with PyNativeScope():
            return self.backend.backward(record, grads)

    def backward_input(self, record: Any, grads: Any) -> tuple[Any, ...]:
        with PyNativeScope():
            return self.backend.backward_input(record, grads)

    def backward_weight(self, record: Any) -> None:
        with PyNativeScope():
            self.backend.backward_weight(record)


def _check_recorded(record: Any) -> None:
    """Raise when a forward with something to differentiate recorded no autograd graph at all
    (no floating output has a graph node): its backward would silently give no gradient."""
    if not record.params and not record.native.positions:
        return
    floats = [o for o in record.outputs if isinstance(o, ms.Tensor) and o.dtype in _FLOATS]
    if not floats or any(o._grad_node is not None or o._requires_grad for o in floats):
        return
    raise RuntimeError(
        f"the stage's forward recorded nothing to differentiate: it has {len(record.params)} trainable "
        f"parameter(s) and {len(record.native.positions)} differentiable input(s), but none of its "
        f"{len(floats)} floating output(s) is connected to them in MindSpore's autograd engine, so its "
        "backward would give no gradient. Causes: every output goes through ops.stop_gradient, or the "
        "stage computes them in a compiled graph the engine does not record (a Cell called in GRAPH_MODE "
        "from another thread or another scope than the stage's own forward)."
    )


_FLOATS = (ms.float16, ms.float32, ms.float64, ms.bfloat16)
