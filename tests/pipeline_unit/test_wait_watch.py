"""The wait log: its interval variable and the log line of a wait that blocks."""

from __future__ import annotations

import logging
import threading

import pytest

from hyper_parallel.core.pipeline_parallel.runtime import wait_watch
from hyper_parallel.core.pipeline_parallel.runtime.wait_watch import WaitSlot, release_slot, wait_log_interval, wait_slot, watched


def test_the_interval_follows_the_variable_each_time_it_is_read(monkeypatch):
    monkeypatch.delenv("HYPER_PARALLEL_WAIT_LOG_INTERVAL", raising=False)
    assert wait_log_interval() == 30.0
    monkeypatch.setenv("HYPER_PARALLEL_WAIT_LOG_INTERVAL", "0.5")
    assert wait_log_interval() == 0.5
    monkeypatch.setenv("HYPER_PARALLEL_WAIT_LOG_INTERVAL", "0")
    assert wait_log_interval() == 0.0
    monkeypatch.setenv("HYPER_PARALLEL_WAIT_LOG_INTERVAL", "0.5")
    assert wait_log_interval() == 0.5


@pytest.mark.parametrize("value", ["abc", "-1", "", "nan"])
def test_a_bad_interval_is_refused_every_time(monkeypatch, value):
    monkeypatch.setenv("HYPER_PARALLEL_WAIT_LOG_INTERVAL", value)
    for _ in range(2):  # a refused value is not remembered as if it were valid
        with pytest.raises(ValueError, match="HYPER_PARALLEL_WAIT_LOG_INTERVAL must be"):
            wait_log_interval()


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        self.logged = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.logged.set()


def test_a_blocked_wait_is_logged_once_with_its_text_made_only_then(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_WAIT_LOG_INTERVAL", "0.05")
    handler = _Collect()
    logger = logging.getLogger("hyper_parallel")
    logger.addHandler(handler)
    made = []

    def what() -> str:
        made.append(1)
        return "rank 3: RECV_F.s3.m0 waiting for rank 2"

    try:
        with watched(what):  # the body blocks until the line is logged (or fails after 30 s)
            assert handler.logged.wait(30), "a wait blocked past the interval was never logged"
        monkeypatch.setenv("HYPER_PARALLEL_WAIT_LOG_INTERVAL", "30")
        with watched(what):  # a wait that ends before its interval: no line, and its text is never made
            pass
    finally:
        logger.removeHandler(handler)
    assert len(handler.messages) == 1, handler.messages
    assert "rank 3: RECV_F.s3.m0 waiting for rank 2 has waited" in handler.messages[0]
    assert made == [1]


def test_interval_zero_watches_nothing(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_WAIT_LOG_INTERVAL", "0")
    with watched(lambda: pytest.fail("the text of an unwatched wait was made")):
        pass


def test_a_wait_slot_logs_a_blocked_wait_once_and_makes_its_text_only_then():
    """The runtime's form: one slot per waiter, ``current`` set around each wait."""
    import time

    handler = _Collect()
    logger = logging.getLogger("hyper_parallel")
    logger.addHandler(handler)
    made = []

    def describe(step, peer) -> str:
        made.append((step, peer))
        return f"rank 1: {step} waiting for rank {peer}"

    slot = wait_slot(describe, 0.05)
    try:
        for k in range(3):  # waits that end at once: no line, no text
            slot.current = (time.monotonic(), f"RECV_B.s1.m{k}", 2)
            slot.current = None
        slot.current = (time.monotonic(), "RECV_F.s1.m4", 0)  # blocks past the interval
        assert handler.logged.wait(30), "a wait blocked past the interval was never logged"
        assert slot.logged == slot.current[0]  # marked: the watch does not log this wait again
        slot.current = None
    finally:
        logger.removeHandler(handler)
        release_slot(slot)
    assert made == [("RECV_F.s1.m4", 0)]
    assert len(handler.messages) == 1 and "rank 1: RECV_F.s1.m4 waiting for rank 0 has waited" in handler.messages[0]
    assert wait_slot(describe, 0.0) is None  # interval 0: nothing is watched


def _watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hyper-parallel-wait-watch" and t.is_alive()]


def test_the_watch_thread_lives_only_while_something_is_watched():
    """Released slots and closed waits stop the thread, joined before the call returns; a later
    wait starts a fresh one."""
    first, second = wait_slot(lambda *a: "one", 30.0), wait_slot(lambda *a: "two", 30.0)
    assert len(_watch_threads()) == 1
    release_slot(first)
    assert len(_watch_threads()) == 1  # the second slot is still watched
    with watched("a wait", 30.0):
        release_slot(second)
        assert len(_watch_threads()) == 1  # the open wait is still watched
    assert _watch_threads() == []
    for _ in range(3):  # start, stop, start again: never more than one thread, none left after
        slot = wait_slot(lambda *a: "again", 30.0)
        assert len(_watch_threads()) == 1
        release_slot(slot)
        assert _watch_threads() == []
    release_slot(None)  # an unwatched runtime (interval 0) releases nothing


def test_slots_of_many_threads_leave_no_watch_thread():
    """Ranks of a LocalCluster take and release slots at the same time."""
    barrier = threading.Barrier(4)

    def rank() -> None:
        for _ in range(20):
            slot = wait_slot(lambda *a: "rank", 30.0)
            with watched("rank wait", 30.0):
                pass
            barrier.wait(30)
            release_slot(slot)

    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert _watch_threads() == []


class _StopRacesAnOpen(wait_watch._Watch):
    """A watch whose stop (by ``stopper``) pauses once it found nothing watched, and completes at the
    opener's first look at the watch's state (``_thread`` or ``_stopping``): the worst moment."""

    def __init__(self) -> None:
        self.stopper: threading.Thread | None = None
        self.opener: threading.Thread | None = None
        self.stop_checked, self.go = threading.Event(), threading.Event()
        super().__init__()

    def _idle(self) -> bool:
        idle = super()._idle()
        if threading.current_thread() is self.stopper:
            self.stop_checked.set()
            self.go.wait(30)
        return idle


def _racing_state(name: str) -> property:
    def get(self: _StopRacesAnOpen) -> object:
        value = self.__dict__[name]
        if threading.current_thread() is self.opener:
            self.opener = None
            self.go.set()
            self.stopper.join(30)
        return value

    return property(get, lambda self, value: self.__dict__.__setitem__(name, value))


_StopRacesAnOpen._thread = _racing_state("_thread")
_StopRacesAnOpen._stopping = _racing_state("_stopping")


def test_a_wait_opened_while_the_last_release_stops_the_thread_is_watched():
    """The last slot's release decided to stop the thread just before another thread opened a wait;
    the stop completes while the opener looks at the watch's state: a thread must run for that wait
    (reading ``_thread`` before ``_stopping`` saw the old thread, then no stop, and started none)."""
    watch = _StopRacesAnOpen()
    slot = WaitSlot(lambda *a: "run", 30.0)
    watch.add_slot(slot)
    watch.stopper = threading.Thread(target=watch.release_slot, args=(slot,))
    watch.stopper.start()
    assert watch.stop_checked.wait(30)
    watch.opener = threading.current_thread()
    token = watch.open("a wait opened meanwhile", 30.0)
    watch.stopper.join(30)
    try:
        assert watch._thread is not None and watch._thread.is_alive()
    finally:
        watch.close(token)
    assert watch._thread is None
