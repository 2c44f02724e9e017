"""A log line for waits that take long: which step of which rank waits on which peer.

A communication wait fails after ``HYPER_PARALLEL_COMM_TIMEOUT`` seconds (default 300). Before
that, a user looking at a silent job wants to know what it waits for: a wait still blocked after
``HYPER_PARALLEL_WAIT_LOG_INTERVAL`` seconds (default 30; 0 turns it off) is logged once, at
WARNING level on the ``hyper_parallel`` logger. One daemon thread per process looks at the open
waits; opening and closing a wait only writes a dictionary entry.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Union

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


class _Watch:
    def __init__(self) -> None:
        self._open: dict[int, tuple[float, float, Describe]] = {}  # token -> (start, interval, what)
        self._tokens = itertools.count()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def open(self, what: Describe, interval: float) -> int:
        token = next(self._tokens)
        self._open[token] = (time.monotonic(), interval, what)
        if self._thread is None:
            self._start()
        return token

    def close(self, token: int) -> None:
        self._open.pop(token, None)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hyper-parallel-wait-watch", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
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
