"""A log line for waits that take long: which step of which rank waits on which peer.

A communication wait fails after ``HYPER_PARALLEL_COMM_TIMEOUT`` seconds (default 300). Before
that, a user looking at a silent job wants to know what it waits for: a wait still blocked after
``HYPER_PARALLEL_WAIT_LOG_INTERVAL`` seconds (default 30; 0 turns it off) is logged once, at
WARNING level on the ``hyper_parallel`` logger. One daemon thread per process looks at the open
waits; opening and closing a wait only writes a dictionary entry (`watched`), or one attribute of
a `WaitSlot` that a waiter registered once (the runtime: hundreds of waits per step).

The thread lives only while there is something to watch: when the last open wait closes and the
last slot is released (`release_slot`, at the end of every run, failed or not), it is stopped and
joined before that call returns, so no thread of the library outlives a run.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Union

_logger = logging.getLogger("hyper_parallel")
Describe = Union[str, Callable[[], str]]  # what waits; a callable is only called if the wait is logged


def wait_log_interval() -> float:
    """Seconds after which a blocked wait is logged (``HYPER_PARALLEL_WAIT_LOG_INTERVAL``; 0 = never)."""
    value = os.environ.get("HYPER_PARALLEL_WAIT_LOG_INTERVAL", "30")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"HYPER_PARALLEL_WAIT_LOG_INTERVAL must be a number of seconds, got {value!r}") from None
    if not seconds >= 0:  # negative or nan
        raise ValueError(f"HYPER_PARALLEL_WAIT_LOG_INTERVAL must be >= 0, got {value!r}")
    return seconds


class WaitSlot:
    """The current wait of one waiter, watched without an entry per wait: the waiter sets
    ``current = (time.monotonic(), *what)`` before it blocks and ``None`` after (one attribute
    store each); a wait still blocked after ``interval`` is logged once, ``describe(*what)``
    making its text only then. Get one from `wait_slot`."""

    __slots__ = ("current", "interval", "describe", "logged", "__weakref__")

    def __init__(self, describe: Callable[..., str], interval: float) -> None:
        self.current: tuple[Any, ...] | None = None
        self.interval = interval
        self.describe = describe
        self.logged: float | None = None  # ``current[0]`` of the wait already logged


class _Watch:
    def __init__(self) -> None:
        self._open: dict[int, tuple[float, float, Describe]] = {}  # token -> (start, interval, what)
        self._slots: weakref.WeakSet[WaitSlot] = weakref.WeakSet()
        self._tokens = itertools.count()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False  # set (under _life) while a stop is being decided or joined
        self._exit = False  # tells the loop to return
        self._lock = threading.Lock()  # the slot set (the loop takes it too)
        self._life = threading.Lock()  # starting and stopping the thread (never taken by the loop)

    def open(self, what: Describe, interval: float) -> int:
        token = next(self._tokens)
        self._open[token] = (time.monotonic(), interval, what)
        if self._stopping or self._thread is None:  # this order: see `_stop_if_idle`
            self._start()
        return token

    def close(self, token: int) -> None:
        self._open.pop(token, None)
        if not self._open and self._thread is not None:
            self._stop_if_idle()

    def add_slot(self, slot: WaitSlot) -> None:
        with self._lock:
            self._slots.add(slot)
        if self._stopping or self._thread is None:  # this order: see `_stop_if_idle`
            self._start()

    def release_slot(self, slot: WaitSlot) -> None:
        with self._lock:
            self._slots.discard(slot)
        slot.current = None
        self._stop_if_idle()

    def _start(self) -> None:
        with self._life:  # waits for a stop in progress to finish, then starts a fresh thread
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hyper-parallel-wait-watch", daemon=True)
                self._thread.start()

    def _idle(self) -> bool:
        with self._lock:
            return not self._open and not len(self._slots)

    def _stop_if_idle(self) -> None:
        """Stop the thread and join it when nothing is watched (an open or add racing with this either
        is seen here, or sees ``_stopping`` and starts a fresh thread once the old one is joined).
        ``_stopping`` is set before the idle check and cleared only after ``_thread = None``, so an
        opener that reads ``_stopping`` first, then ``_thread``, sees one of the two however the stop
        interleaves (read the other way round, a stop completing between the reads went unseen)."""
        with self._life:
            thread = self._thread
            if thread is None:
                return
            self._stopping = True
            try:
                if not self._idle():
                    return
                self._exit = True
                self._wake.set()
                thread.join()
                self._thread = None
                self._exit = False
                self._wake.clear()
            finally:
                self._stopping = False

    def _loop(self) -> None:
        while not self._exit:
            now = time.monotonic()
            soonest = 1.0
            for token, (start, interval, what) in list(self._open.items()):
                waited = now - start
                if waited >= interval:
                    if self._open.pop(token, None) is not None:
                        text = what() if callable(what) else what
                        _logger.warning("hyper_parallel: %s has waited %.0f s so far", text, waited)
                else:
                    soonest = min(soonest, interval - waited)
            with self._lock:
                slots = list(self._slots)
            for slot in slots:
                current = slot.current
                if current is None or current[0] == slot.logged:
                    continue
                waited = now - current[0]
                if waited >= slot.interval:
                    slot.logged = current[0]
                    _logger.warning("hyper_parallel: %s has waited %.0f s so far", slot.describe(*current[1:]), waited)
                else:
                    soonest = min(soonest, slot.interval - waited)
            if not self._exit:
                self._wake.wait(max(soonest, 0.01))


_WATCH = _Watch()


class watched:  # noqa: N801 - used like a function: ``with watched(what):``
    """Log ``what`` (a string, or a callable making it) once if the body is still running after the
    wait-log interval. A plain class, not a generator context manager: the runtime opens one per
    wait, several hundred per step (and reads the interval once per run, passing it here)."""

    __slots__ = ("_interval", "_token", "_what")

    def __init__(self, what: Describe, interval: float | None = None) -> None:
        self._what = what
        self._interval = interval  # None: read HYPER_PARALLEL_WAIT_LOG_INTERVAL now
        self._token: int | None = None

    def __enter__(self) -> None:
        interval = wait_log_interval() if self._interval is None else self._interval
        if interval > 0:
            self._token = _WATCH.open(self._what, interval)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _WATCH.close(self._token)


def wait_slot(describe: Callable[..., str], interval: float | None = None) -> WaitSlot | None:
    """A `WaitSlot` watched from now on (``interval`` None: read ``HYPER_PARALLEL_WAIT_LOG_INTERVAL``);
    None when the interval is 0 (nothing is watched)."""
    interval = wait_log_interval() if interval is None else interval
    if interval <= 0:
        return None
    slot = WaitSlot(describe, interval)
    _WATCH.add_slot(slot)
    return slot


def release_slot(slot: WaitSlot | None) -> None:
    """Stop watching ``slot`` (None: nothing to do); when nothing else is watched the watch thread
    is stopped and joined before this returns."""
    if slot is not None:
        _WATCH.release_slot(slot)
