"""Overlap one micro-batch's forward with another's backward on two threads (DualPipe style).

An MoE layer's expert-parallel all-to-all (dispatch before the experts, combine after them,
and the all-to-alls of their gradients in the backward) leaves the device idle unless other
work runs meanwhile. `CommComputeOverlap.run` runs the forward of one micro-batch and the
backward of another in two threads, and sync points around every dispatch and combine make
the two threads take turns so that while one side's all-to-all is in flight the other side
computes.

The two threads are used as coroutines: exactly one of them runs at any moment (it holds the
*turn*), and the turn changes hands only at sync points. MindSpore forbids two threads running
autograd at once; torch would allow it, but the order of collectives must be the same on every
rank, and taking turns makes it deterministic.

**Sync points and roles.** At a sync point the calling side says what it does next: ``COMM``
(issue a communication) or ``COMPUTE``. A side about to communicate keeps the turn: its
communication is issued before the other side, which waits to compute, goes on. A side about to
compute hands the turn to the other side and waits until it comes back. So each side runs
"compute, then issue a communication" and passes the turn on at its next sync point, and the
other side computes while that communication is in flight (the waiting side is always one that
is about to compute).
On engines whose collectives block the calling thread (gloo, LocalCluster) the communication
is complete when the turn passes: results are the same, nothing overlaps in time.

The sync points are differentiable (``Platform.sync_point``): the backward crosses them in the
reverse order and takes turns too, so the all-to-alls of the gradients are ordered the same way.
A sync point outside a running session, in a thread that is not one of the two sides, or in a
thread that re-runs a forward for activation recomputation (see `recomputing`; the re-runs of
``checkpoint_wrapper`` modules count too) does nothing.

**Threads and communication.** The two sides run on helper threads of the calling rank
(``Platform.run_helper_threads``): ``get_platform()`` there returns the rank's platform and the
sides' collectives run as the rank's. On a LocalCluster a rank's communication must run on the
rank's own thread (``LocalCommunicator._check_thread``): while the sides run, the rank's thread
executes the communication calls they hand over and keeps the cluster's turn, so no other
rank computes meanwhile. An autograd engine that runs a backward on a worker thread of its own
(torch on accelerators) is supported: a sync point called from an unknown thread during a
session counts for the side that holds the turn.
"""

from __future__ import annotations

import enum
import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.activations.state import is_recomputing as _activations_recomputing
from hyper_parallel.platform.base import Platform, default_comm_timeout


class HookRole(enum.Enum):
    """What a side does right after a sync point."""

    COMM = "comm"
    """It issues a communication (dispatch / combine all-to-all or their gradients)."""

    COMPUTE = "compute"
    """It computes (attention, experts, ... or their backward)."""


class OverlapAborted(RuntimeError):
    """Raised in one side at its next sync point when the other side failed."""


class OverlapError(RuntimeError):
    """One side of `CommComputeOverlap.run` failed; the original exception is ``__cause__``."""

    def __init__(self, side: str, micro_index: int | None, error: BaseException) -> None:
        where = f"the {side} side" + ("" if micro_index is None else f" (micro-batch {micro_index})")
        super().__init__(f"{where} of an overlapped step failed: {type(error).__name__}: {error}")
        self.side = side
        self.micro_index = micro_index
        self.error = error


_thread = threading.local()


@contextmanager
def recomputing() -> Iterator[None]:
    """Sync points reached by the calling thread inside this block do nothing.

    Activation recomputation re-runs a forward during the backward; its sync points must not
    take part in the turn-taking (the recomputed graph's backward sync points do, as usual).
    """
    previous = getattr(_thread, "recomputing", False)
    _thread.recomputing = True
    try:
        yield
    finally:
        _thread.recomputing = previous


def is_recomputing() -> bool:
    """Whether the calling thread is inside `recomputing`, or re-runs the forward of a module
    wrapped by ``checkpoint_wrapper`` (``hyper_parallel.core.activation_checkpoint``; its own
    per-thread flag, which the sync points must honour too)."""
    return bool(getattr(_thread, "recomputing", False)) or _activations_recomputing()


Trace = Callable[[str, str, "HookRole | None"], None]


class HookCoordinator:
    """Turn-taking of two named sides at sync points (see the module docstring).

    A session starts with :meth:`enable` (``first`` holds the turn, ``second`` waits to start). Each side's thread runs inside ``with coordinator.side(name):``,
    which waits for the side's first turn and, at the end, leaves the session (the other side
    then runs alone). :meth:`sync` is a sync point; :meth:`depart` lets a side finish early;
    :meth:`abort` stops the session because a side failed; :meth:`disable` ends it.

    ``trace(event, side, role)`` (optional) is called, with an internal lock held, on
    ``"wait"`` (a side starts waiting for the turn), ``"resume"`` (it got it), ``"keep"`` (a
    side keeps the turn to communicate first) and ``"depart"``. Waits for the turn fail with
    TimeoutError after ``timeout`` seconds (default ``HYPER_PARALLEL_COMM_TIMEOUT``).
    """

    def __init__(self, timeout: float | None = None, trace: Trace | None = None) -> None:
        self.timeout = default_comm_timeout() if timeout is None else float(timeout)
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self._trace = trace
        self._cond = threading.Condition()
        self._enabled = False
        self._sides: tuple[str, str] = ("", "")
        self._turn: str | None = None
        self._waiting: set[str] = set()  # sides waiting for the turn (each about to compute)
        self._departed: set[str] = set()
        self._left: set[str] = set()
        self._threads: dict[int, str] = {}
        self._failure: tuple[str, BaseException] | None = None

    # ------------------------------------------------------------------ session
    @property
    def enabled(self) -> bool:
        """Whether a session runs (between :meth:`enable` and :meth:`disable`)."""
        return self._enabled

    @property
    def failure(self) -> tuple[str, BaseException] | None:
        """``(side, exception)`` of the first :meth:`abort` of this session, if any."""
        return self._failure

    def enable(self, first: str, second: str) -> None:
        """Start a session of sides ``first`` (holds the turn) and ``second``."""
        if not (isinstance(first, str) and isinstance(second, str)) or first == second:
            raise ValueError(f"a session needs two different side names, got {first!r} and {second!r}")
        with self._cond:
            if self._enabled:
                raise RuntimeError(f"a session of sides {self._sides} is already running on this coordinator")
            self._enabled = True
            self._sides = (first, second)
            self._turn = first
            self._waiting = {second}
            self._departed, self._left, self._threads = set(), set(), {}
            self._failure = None

    def disable(self) -> None:
        """End the session: every sync point does nothing and a waiting side resumes at once.

        From then on the two sides may run at the same moment; call it when one of them is
        done or gone (``CommComputeOverlap.run`` calls it after both finished).
        """
        with self._cond:
            self._enabled = False
            self._cond.notify_all()

    def abort(self, side: str, error: BaseException) -> None:
        """``side`` failed: the other side raises OverlapAborted where it waits for the turn."""
        with self._cond:
            if self._failure is None:
                self._failure = (side, error)
            self._cond.notify_all()

    @contextmanager
    def side(self, name: str) -> Iterator[None]:
        """Run the block as side ``name``: wait for its first turn; leave the session at the end."""
        with self._cond:
            if not self._enabled or name not in self._sides:
                raise RuntimeError(f"side {name!r} is not part of a running session (sides {self._sides})")
            if name in self._threads.values() or name in self._left:
                raise RuntimeError(f"side {name!r} already joined this session")
            self._threads[threading.get_ident()] = name
            try:
                self._wait_for_turn(name)
            except BaseException:
                self._leave(name)
                raise
        try:
            yield
        finally:
            with self._cond:
                self._leave(name)

    # ------------------------------------------------------------------ sync points
    def sync(self, role: HookRole) -> None:
        """A sync point of the calling side, whose next work is ``role``."""
        if not isinstance(role, HookRole):
            raise TypeError(f"role must be a HookRole, got {role!r}")
        if is_recomputing():
            return
        with self._cond:
            name = self._caller()
            if name is None or name in self._departed:
                return
            self._raise_if_aborted(name)
            partner = self._partner(name)
            if self._turn != name:
                raise RuntimeError(
                    f"the {name} side reached a sync point while the {partner} side holds the turn"
                )
            if partner not in self._waiting:  # the partner left: run alone
                return
            if role is HookRole.COMM:  # communicate first, the partner computes afterwards
                self._emit("keep", name, role)
                return
            self._pass_turn(name)
            self._wait_for_turn(name)

    def depart(self) -> None:
        """The calling side finishes early: its later sync points do nothing, so it keeps the
        turn until it leaves the session; then the other side runs alone."""
        if is_recomputing():
            return
        with self._cond:
            name = self._caller()
            if name is None or name in self._departed:
                return
            self._departed.add(name)
            self._emit("depart", name, None)

    # ------------------------------------------------------------------ internals
    def _caller(self) -> str | None:
        if not self._enabled:
            return None
        name = self._threads.get(threading.get_ident())
        if name is None and self._threads:  # an engine's worker thread running a side's backward
            name = self._turn
        return name

    def _partner(self, name: str) -> str:
        first, second = self._sides
        return second if name == first else first

    def _emit(self, event: str, side: str, role: HookRole | None) -> None:
        if self._trace is not None:
            self._trace(event, side, role)

    def _raise_if_aborted(self, name: str) -> None:
        if self._failure is not None and self._failure[0] != name:
            raise OverlapAborted(f"the {name} side stopped: the {self._failure[0]} side failed")

    def _pass_turn(self, name: str) -> None:
        partner = self._partner(name)
        self._waiting.discard(partner)
        self._waiting.add(name)
        self._turn = partner
        self._cond.notify_all()

    def _wait_for_turn(self, name: str) -> None:
        """Block (``_cond`` held) until ``name`` holds the turn, the session ends or aborts."""
        if self._turn == name or not self._enabled:
            self._waiting.discard(name)
            return
        self._emit("wait", name, None)
        remaining = self.timeout
        while True:
            self._raise_if_aborted(name)
            if self._turn == name or not self._enabled:
                self._waiting.discard(name)
                self._emit("resume", name, None)
                return
            if remaining <= 0:
                raise TimeoutError(
                    f"the {name} side waited {self.timeout:g}s for its turn while the "
                    f"{self._partner(name)} side held it"
                )
            started = time.monotonic()
            self._cond.wait(remaining)
            remaining -= time.monotonic() - started

    def _leave(self, name: str) -> None:
        """``name`` is done (``_cond`` held): the turn goes to the other side for good."""
        self._left.add(name)
        self._departed.add(name)
        self._waiting.discard(name)
        self._threads = {ident: side for ident, side in self._threads.items() if side != name}
        if self._turn == name:
            partner = self._partner(name)
            self._turn = partner if partner in self._waiting else None
            self._waiting.discard(partner)
        self._cond.notify_all()


class CommComputeOverlap:
    """Sync points around an MoE layer's all-to-alls, and the two-thread overlapped step.

    Wrap the layer's dispatch and combine functions once (``wrap_dispatch``, ``wrap_combine``)
    and use the wrapped ones in every step; outside `run` their sync points do nothing. Then run
    an overlapped pair with ``run(fwd_fn, bwd_fn)``. ``backward_first`` (default, as in an
    ``OVERLAP_B_F`` step) gives the backward side the first turn.
    """

    def __init__(
        self, platform: Platform | None = None, timeout: float | None = None, backward_first: bool = True
    ) -> None:
        self._platform = platform
        self.coordinator = HookCoordinator(timeout)
        self.backward_first = bool(backward_first)

    @property
    def platform(self) -> Platform:
        """The platform given at construction, else the calling rank's."""
        return self._platform if self._platform is not None else get_platform()

    # ------------------------------------------------------------------ sync points
    def sync_point(self, tensor: Any, forward: HookRole, backward: HookRole) -> Any:
        """``tensor`` through a sync point: role ``forward`` in the forward, ``backward`` when
        the backward crosses it. Use the returned tensor in place of ``tensor``."""
        for name, role in (("forward", forward), ("backward", backward)):
            if not isinstance(role, HookRole):
                raise TypeError(f"{name} role must be a HookRole, got {role!r}")
        coordinator = self.coordinator
        return self.platform.sync_point(tensor, lambda: coordinator.sync(forward), lambda: coordinator.sync(backward))

    def wrap_dispatch(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(x, ...)`` (the dispatch all-to-all) with a sync point on ``x`` before it and on
        its result (its first element if a tuple/list) after it.

        Forward: before = COMM (the dispatch goes out), after = COMPUTE (the experts).
        Backward: after = COMM (the dispatch's gradient all-to-all), before = COMPUTE.
        """
        return self._wrap(fn, "dispatch", after_forward=HookRole.COMPUTE)

    def wrap_combine(self, fn: Callable[..., Any], is_last_layer: bool = False) -> Callable[..., Any]:
        """``fn(x, ...)`` (the combine all-to-all) with sync points like `wrap_dispatch`.

        With ``is_last_layer`` (the chunk's last MoE layer) the forward side finishes early
        after this combine (`HookCoordinator.depart`): no all-to-all of its own follows, so the
        rest of its forward runs at once and the backward side then finishes alone. The
        backward crosses the point as usual (it is the first sync point of its backward).
        """
        return self._wrap(fn, "combine", after_forward=None if is_last_layer else HookRole.COMPUTE)

    def _wrap(self, fn: Callable[..., Any], what: str, after_forward: HookRole | None) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"{what} function must be callable, got {fn!r}")

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            platform = self.platform
            if not args or not platform.is_tensor(args[0]):
                raise TypeError(f"the wrapped {what} function needs a tensor as its first argument")
            first = self.sync_point(args[0], HookRole.COMM, HookRole.COMPUTE)
            result = fn(first, *args[1:], **kwargs)
            return self._after(result, what, after_forward)

        return wrapped

    def _after(self, result: Any, what: str, after_forward: HookRole | None) -> Any:
        platform, coordinator = self.platform, self.coordinator

        def on_forward() -> None:
            if after_forward is None:
                coordinator.depart()
            else:
                coordinator.sync(after_forward)

        def point(tensor: Any) -> Any:
            return platform.sync_point(tensor, on_forward, lambda: coordinator.sync(HookRole.COMM))

        if platform.is_tensor(result):
            return point(result)
        if isinstance(result, (tuple, list)) and result and platform.is_tensor(result[0]):
            return type(result)([point(result[0]), *result[1:]])
        raise TypeError(f"the wrapped {what} function must return a tensor or a tuple/list starting with one")

    # ------------------------------------------------------------------ the overlapped step
    def run(
        self,
        fwd_fn: Callable[[], Any],
        bwd_fn: Callable[[], Any],
        *,
        forward_micro: int | None = None,
        backward_micro: int | None = None,
    ) -> tuple[Any, Any]:
        """Run ``fwd_fn()`` and ``bwd_fn()`` on two helper threads taking turns; return their
        results ``(forward, backward)``.

        If a side raises, the other stops at its next sync point, both threads are joined and
        OverlapError names the failed side and its micro-batch (``forward_micro`` /
        ``backward_micro``), with the original exception as ``__cause__``.
        """
        for name, fn in (("fwd_fn", fwd_fn), ("bwd_fn", bwd_fn)):
            if not callable(fn):
                raise TypeError(f"{name} must be callable, got {fn!r}")
        platform = self.platform
        functions = {"forward": fwd_fn, "backward": bwd_fn}
        micro = {"forward": forward_micro, "backward": backward_micro}
        order = ("backward", "forward") if self.backward_first else ("forward", "backward")
        coordinator = self.coordinator
        results: dict[str, Any] = {}

        def side(name: str) -> Callable[[], None]:
            def body() -> None:
                try:
                    with coordinator.side(name):
                        results[name] = functions[name]()
                except BaseException as exc:  # noqa: BLE001 - reported by run() below
                    coordinator.abort(name, exc)

            return body

        coordinator.enable(*order)
        try:
            platform.run_helper_threads([side(name) for name in order])
        finally:
            failure = coordinator.failure
            coordinator.disable()
        if failure is not None:
            name, error = failure
            raise OverlapError(name, micro[name], error) from error
        return results["forward"], results["backward"]
