"""Helper threads of a LocalCluster rank: their communication runs on the rank's own thread.

A LocalCluster rank holds the cluster's turn while it computes, and its communicator refuses
calls from other threads (they would wait for the turn their own rank holds). A rank that
runs helper threads (``Communicator.run_threads``, used by ``CommComputeOverlap``) therefore
serves them: while they run, the rank's thread keeps the turn and executes every
communication call a helper hands over, so no other rank runs while a helper computes and the
other ranks run, as usual, while such a call waits.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(eq=False)
class _Call:
    """A communication call a helper thread hands to its rank's own thread."""

    run: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def execute(self) -> None:
        try:
            self.result = self.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the helper thread
            self.error = exc
        finally:
            self.done.set()


class _HasHelpers(Protocol):
    helpers: RankHelpers


def on_rank_thread(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for communicator methods: a call from a helper thread runs on the rank's thread."""

    @functools.wraps(method)
    def wrapper(self: _HasHelpers, *args: Any, **kwargs: Any) -> Any:
        return self.helpers.as_rank(lambda: method(self, *args, **kwargs))

    return wrapper


class RankHelpers:
    """The helper threads of one rank and the queue of calls they hand to the rank's thread."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._queues: dict[threading.Thread, queue.SimpleQueue[_Call | None]] = {}

    def as_rank(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the rank's own thread: at once on it, handed over from a helper thread."""
        requests = self._queues.get(threading.current_thread())
        if requests is None:
            return call()
        job = _Call(call)
        requests.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def run(self, targets: Sequence[Callable[[], None]]) -> None:
        """Start a helper thread per target and serve their calls until all have ended."""
        requests: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()

        def body(target: Callable[[], None]) -> None:
            try:
                target()
            finally:
                requests.put(None)

        threads = [
            threading.Thread(target=body, args=(target,), name=f"hyper-parallel-rank-{self.rank}-helper-{k}",
                             daemon=True)
            for k, target in enumerate(targets)
        ]
        for thread in threads:
            self._queues[thread] = requests
        started = 0
        try:
            for thread in threads:
                thread.start()
                started += 1
            running = started
            while running:
                job = requests.get()
                if job is None:
                    running -= 1
                else:
                    job.execute()
        finally:
            for thread in threads[:started]:
                thread.join()
            for thread in threads:
                self._queues.pop(thread, None)
