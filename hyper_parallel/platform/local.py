"""LocalCluster: a whole multi-rank job inside one process, for tests, dry runs and debugging.

Each rank is a thread with its own :class:`Platform` (``get_platform()`` inside it reports
that rank). Communication goes through in-memory mailboxes with the semantics of the real
engines: sends are eager (the data is copied when the send is issued), the k-th receive
posted on rank ``b`` from rank ``a`` gets the k-th message ``a`` sent to ``b`` (FIFO, as NCCL
matches), and collectives meet when every rank of the group has called them.

Exactly one rank runs at any moment: a rank holds the cluster lock while it computes and
hands it over only while it waits for a message or a collective. MindSpore forbids two
threads running autograd at once; this makes that impossible by construction, and makes a
run deterministic.

Randomness is per rank, as in separate processes: each rank has its own copy of the framework's
default random state (``Platform.get_rng_state``) and of numpy's global ``np.random`` state,
starting from the caller's state at ``run`` (like a fork), and swapped in whenever the compute
turn passes to another rank. The caller's own state is the same after ``run`` as before it.
Python's ``random`` module and user-created generator objects are shared, as any object is.

A rank may run helper threads that communicate as the rank (``Communicator.run_threads``,
used by ``CommComputeOverlap``): their communication calls run on the rank's own thread, which
keeps the cluster's turn while they compute (``local_helpers.py``).

A rank that raises stops the others (their next wait raises) and ``run`` re-raises in the
caller naming the rank. A wait that can never be satisfied fails at once with the state of
every rank (deadlock detection); any wait also fails after ``timeout`` seconds.
"""

from __future__ import annotations

import ctypes
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hyper_parallel.platform import bind_thread_platform, local_cluster_running, platform_class
from hyper_parallel.platform.base import (
    WaitAborted,
    CompletedHandle,
    Communicator,
    Group,
    Handle,
    P2POp,
    Platform,
    check_reduce_op,
    default_comm_timeout,
)
from hyper_parallel.platform.local_helpers import RankHelpers, on_rank_thread

_NUMPY_REDUCE = {
    "sum": lambda arrays: np.sum(arrays, axis=0),
    "avg": lambda arrays: np.sum(arrays, axis=0) / len(arrays),
    "max": lambda arrays: np.max(arrays, axis=0),
    "min": lambda arrays: np.min(arrays, axis=0),
    "prod": lambda arrays: np.prod(arrays, axis=0),
}


class ClusterAborted(WaitAborted):
    """Raised in a rank's wait when another rank failed."""


class DeadlockError(WaitAborted):
    """Every live rank waits for something no rank can provide any more."""


class RankFailedError(RuntimeError):
    """A rank of a LocalCluster raised; the original exception is the ``__cause__``."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"rank {rank} failed: {type(error).__name__}: {error}")
        self.rank = rank
        self.error = error


@dataclass
class _Message:
    payload: Any
    tag: int
    src: int


@dataclass
class _Mailbox:
    """Messages from one rank to another, matched in order."""

    messages: dict[int, _Message] = field(default_factory=dict)
    sent: int = 0
    posted: int = 0


@dataclass
class _Meeting:
    """One collective call of a group: what each rank brought, then what each gets."""

    kind: str
    brought: dict[int, Any] = field(default_factory=dict)
    results: dict[int, Any] | None = None


_MT19937_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937 state struct: the key words, then the position


@dataclass(frozen=True)
class _NumpyState:
    """numpy's global (legacy) random state, and a cheap fingerprint of it."""

    full: tuple[Any, ...]  # np.random.get_state(): (name, key, pos, has_gauss, cached_gaussian)
    fingerprint: bytes | None  # the generator's raw key + position (None: not readable)

    @property
    def gauss(self) -> tuple[int, float]:
        return int(self.full[3]), float(self.full[4])


def _numpy_fingerprint() -> bytes | None:
    generator = getattr(np.random.mtrand._rand, "_bit_generator", None)
    if type(generator).__name__ != "MT19937":
        return None
    return ctypes.string_at(generator.ctypes.state_address, _MT19937_STATE_BYTES)


def _numpy_state() -> _NumpyState:
    return _NumpyState(np.random.get_state(), _numpy_fingerprint())


class _RankRandomness:
    """Per-rank copies of the process-wide random states, swapped when the turn changes hands.

    The framework's state comes from the platform (``get_rng_state``: about a microsecond for
    torch). numpy's ``get_state``/``set_state`` cost tens of microseconds each, so numpy's state
    is only copied when it changed: a rank whose generator words and position are as they were
    when its turn began, with no cached gaussian it could have consumed, still has the state it
    started the turn with; and a rank's state is only installed when it differs from the one in
    place. Call every method with the cluster lock held.
    """

    def __init__(self, platform: Platform, world_size: int) -> None:
        self._platform = platform
        self._caller = (platform.get_rng_state(), _numpy_state())
        self._ranks = [self._caller] * world_size
        self._owner: int | None = None  # whose state is installed (None: the caller's)
        self._numpy_installed = self._caller[1]  # the numpy state in place, as last known exactly

    def switch_to(self, rank: int) -> None:
        """Install ``rank``'s states, saving those of the rank that ran before (cheap if it is ``rank``)."""
        if self._owner == rank:
            return
        if self._owner is not None:
            self._ranks[self._owner] = (self._platform.get_rng_state(), self._current_numpy())
        framework, numpy_state = self._ranks[rank]
        self._platform.set_rng_state(framework)
        self._install_numpy(numpy_state)
        self._owner = rank

    def restore_caller(self) -> None:
        """Put the caller's states back (after every rank finished)."""
        if self._owner is not None:
            self._current_numpy()  # learn what the last rank left in place
        self._platform.set_rng_state(self._caller[0])
        self._install_numpy(self._caller[1])
        self._owner = None

    def _current_numpy(self) -> _NumpyState:
        known = self._numpy_installed
        if known.fingerprint is not None and known.gauss[0] == 0 and _numpy_fingerprint() == known.fingerprint:
            return known  # nothing drawn since it was installed (drawing moves the position)
        self._numpy_installed = _numpy_state()
        return self._numpy_installed

    def _install_numpy(self, state: _NumpyState) -> None:
        known = self._numpy_installed
        if not (state.fingerprint is not None and state.fingerprint == known.fingerprint
                and state.gauss == known.gauss):
            np.random.set_state(state.full)
        self._numpy_installed = state


class _ClusterState:
    def __init__(self, world_size: int, timeout: float, detect_deadlock: bool) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.detect_deadlock = detect_deadlock
        self.randomness: _RankRandomness | None = None  # per-rank random states (set by LocalCluster.run)
        self.cond = threading.Condition()
        self.mailboxes: dict[tuple[int, int, str], _Mailbox] = {}
        self.meetings: dict[tuple[tuple[int, ...], int], _Meeting] = {}
        self.meeting_counts: dict[tuple[tuple[int, ...], int], int] = {}
        self.waiting: dict[int, tuple[Callable[[], bool], str]] = {}
        self.live: set[int] = set()
        self.failure: tuple[int, BaseException] | None = None

    def mailbox(self, src: int, dst: int, kind: str) -> _Mailbox:
        key = (src, dst, kind)
        box = self.mailboxes.get(key)
        if box is None:
            box = self.mailboxes[key] = _Mailbox()
        return box

    def take_turn(self, rank: int) -> None:
        """``rank`` (holding ``cond``) computes from now on: give it its own random state."""
        if self.randomness is not None:
            self.randomness.switch_to(rank)

    def pause(self, rank: int, seconds: float) -> None:
        """Let the other ranks run for up to ``seconds``; the caller holds ``cond``."""
        self.cond.wait(seconds)
        self.take_turn(rank)

    def wait_until(self, rank: int, ready: Callable[[], bool], what: str, timeout: float | None) -> None:
        """Block (releasing the lock) until ``ready()``; the caller holds ``cond``."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        self.waiting[rank] = (ready, what)
        try:
            while not ready():
                if self.failure is not None:
                    raise ClusterAborted(f"rank {rank} stopped while {what}: rank {self.failure[0]} failed")
                if self.detect_deadlock and self._nobody_can_progress():
                    raise DeadlockError(self._describe_waits())
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"rank {rank} timed out after {limit:g}s {what}")
                self.cond.wait(remaining)  # the turn is only taken when this rank goes on (below)
        finally:
            del self.waiting[rank]
            self.take_turn(rank)

    def _nobody_can_progress(self) -> bool:
        if not self.live <= self.waiting.keys():
            return False
        return not any(ready() for ready, _ in self.waiting.values())

    def _describe_waits(self) -> str:
        lines = ["deadlock: every live rank is waiting for something no rank will provide"]
        for rank in sorted(self.waiting):
            lines.append(f"  rank {rank}: {self.waiting[rank][1]}")
        finished = sorted(set(range(self.world_size)) - self.live)
        if finished:
            lines.append(f"  finished ranks: {finished}")
        return "\n".join(lines)


class _RecvHandle(Handle):
    def __init__(self, comm: LocalCommunicator, buffer: Any, src: int, tag: int, ticket: int, kind: str) -> None:
        self._comm = comm
        self._buffer = buffer
        self._src = src
        self._tag = tag
        self._ticket = ticket
        self._kind = kind
        self._done = False

    def is_completed(self) -> bool:
        """True once the message arrived (its data is then in the buffer, as with the engines)."""
        return bool(self._comm.helpers.as_rank(self._is_completed))

    def _is_completed(self) -> bool:
        if self._done:
            return True
        state = self._comm.state
        with state.cond:
            box = state.mailbox(self._src, self._comm.rank, self._kind)
            if self._ticket not in box.messages:
                # Let the other ranks run for a moment, so a caller polling in a loop makes progress.
                state.pause(self._comm.rank, 0.001)
            if self._ticket not in box.messages:
                return False
        self.wait()
        return True

    def wait(self, timeout: float | None = None) -> None:
        self._comm.helpers.as_rank(lambda: self._wait(timeout))

    def _wait(self, timeout: float | None) -> None:
        if self._done:
            return
        self._comm._check_thread()
        state, me = self._comm.state, self._comm.rank
        with state.cond:
            box = state.mailbox(self._src, me, self._kind)
            state.wait_until(
                me,
                lambda: self._ticket in box.messages,
                f"receiving message #{self._ticket} from rank {self._src}",
                timeout,
            )
            message = box.messages.pop(self._ticket)
        self._comm.deliver(message, self._buffer, self._tag)
        self._done = True


class LocalCommunicator(Communicator):
    """The in-memory transport of one LocalCluster rank."""

    def __init__(self, state: _ClusterState, rank: int) -> None:
        self.state = state
        self._rank = rank
        self._world = Group(tuple(range(state.world_size)))
        self.platform: Platform | None = None  # set by LocalCluster right after creation
        self.thread: threading.Thread | None = None  # the rank's own thread, set when it starts
        self.helpers = RankHelpers(rank)  # helper threads whose communication runs here

    def _check_thread(self) -> None:
        # A rank's helper thread would wait for the lock its own rank holds: refuse instead of hanging.
        if self.thread is not None and threading.current_thread() is not self.thread:
            raise RuntimeError(
                f"rank {self._rank}: LocalCluster communication must run on the rank's own thread, "
                f"not on {threading.current_thread().name!r}"
            )

    def run_threads(self, targets: Sequence[Callable[[], None]]) -> None:
        """Run the targets on helper threads of this rank; their communication runs on this thread
        (see ``local_helpers.py``)."""
        self._check_thread()
        self.helpers.run(targets)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def world_group(self) -> Group:
        return self._world

    def new_group(self, ranks: Sequence[int]) -> Group:
        ranks = tuple(sorted(int(r) for r in ranks))  # group order is global-rank order, as torch does
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"invalid group ranks {list(ranks)} for world size {self.world_size}")
        return self._world if ranks == self._world.ranks else Group(ranks, native=ranks)

    @property
    def _p(self) -> Platform:
        assert self.platform is not None
        return self.platform

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == self._rank:
            raise ValueError(f"rank {self._rank}: invalid peer rank {peer} (world size {self.world_size})")

    # P2P ----------------------------------------------------------------------------
    def _post_send(self, payload: Any, dst: int, tag: int, kind: str) -> None:
        self._check_thread()
        self._check_peer(dst)
        state = self.state
        with state.cond:
            box = state.mailbox(self._rank, dst, kind)
            box.messages[box.sent] = _Message(payload, tag, self._rank)
            box.sent += 1
            state.cond.notify_all()

    def _post_recv(self, src: int, kind: str) -> int:
        self._check_thread()
        self._check_peer(src)
        with self.state.cond:
            box = self.state.mailbox(src, self._rank, kind)
            ticket = box.posted
            box.posted += 1
            return ticket

    def deliver(self, message: _Message, buffer: Any, tag: int) -> None:
        p = self._p
        data = message.payload
        if message.tag != tag:
            raise ValueError(
                f"rank {self._rank} expected tag {tag} from rank {message.src}, which sent tag {message.tag}"
            )
        if p.shape(data) != p.shape(buffer) or p.dtype_name(data) != p.dtype_name(buffer):
            raise ValueError(
                f"rank {message.src} sent {p.dtype_name(data)}{list(p.shape(data))} but rank {self._rank} "
                f"posted a receive for {p.dtype_name(buffer)}{list(p.shape(buffer))}"
            )
        p.copy_(buffer, data)

    @on_rank_thread
    def isend(self, tensor: Any, dst: int, group: Group | None = None, tag: int = 0) -> Handle:
        self._post_send(self._p.clone(tensor), dst, tag, f"tensor:{tag}")  # matched per tag, as gloo does
        return CompletedHandle()

    @on_rank_thread
    def irecv(self, tensor: Any, src: int, group: Group | None = None, tag: int = 0) -> Handle:
        kind = f"tensor:{tag}"
        return _RecvHandle(self, tensor, src, tag, self._post_recv(src, kind), kind)

    @on_rank_thread
    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]:
        return [
            self.isend(op.tensor, op.peer, op.group, op.tag)
            if op.op == "isend"
            else self.irecv(op.tensor, op.peer, op.group, op.tag)
            for op in ops
        ]

    # collectives --------------------------------------------------------------------
    def _meet(self, kind: str, group: Group | None, brought: Any, combine: Callable[[dict[int, Any]], dict]) -> Any:
        self._check_thread()
        ranks = (group or self._world).ranks
        if self._rank not in ranks:
            raise ValueError(f"rank {self._rank} called {kind} on group {list(ranks)} it is not part of")
        state = self.state
        with state.cond:
            count_key = (ranks, self._rank)
            seq = state.meeting_counts.get(count_key, 0)
            state.meeting_counts[count_key] = seq + 1
            meeting = state.meetings.setdefault((ranks, seq), _Meeting(kind))
            if meeting.kind != kind:
                other = next(iter(meeting.brought))
                raise ValueError(
                    f"collective mismatch in group {list(ranks)}: rank {other} called {meeting.kind} "
                    f"but rank {self._rank} called {kind}"
                )
            meeting.brought[self._rank] = brought
            if len(meeting.brought) == len(ranks):
                meeting.results = combine(meeting.brought)
                state.cond.notify_all()
            else:
                state.wait_until(
                    self._rank,
                    lambda: meeting.results is not None,
                    f"in {kind} of group {list(ranks)} (arrived: {sorted(meeting.brought)})",
                    None,
                )
            assert meeting.results is not None
            result = meeting.results.pop(self._rank)
            if not meeting.results:
                del state.meetings[(ranks, seq)]
            return result

    def _same_layout(self, kind: str, brought: dict[int, Any]) -> None:
        """Every rank brought a tensor of one shape and dtype; otherwise name two that differ."""
        p = self._p
        layouts = {r: (p.shape(t), p.dtype_name(t)) for r, t in brought.items()}
        first = min(layouts)
        for r, layout in sorted(layouts.items()):
            if layout != layouts[first]:
                (s0, d0), (s1, d1) = layouts[first], layout
                raise ValueError(
                    f"{kind}: rank {first} brought {d0}{list(s0)} but rank {r} brought {d1}{list(s1)}"
                )

    def _ordered(self, brought: dict[int, Any], group: Group | None) -> list[Any]:
        return [brought[r] for r in (group or self._world).ranks]

    def _reduce(self, tensors: list[Any], op: str, like: Any) -> Any:
        p = self._p
        arrays = [p.to_numpy(t) for t in tensors]
        return p.from_numpy(np.asarray(_NUMPY_REDUCE[op](arrays), dtype=arrays[0].dtype), p.dtype_name(like))

    @on_rank_thread
    def all_reduce(self, tensor: Any, op: str = "sum", group: Group | None = None) -> Any:
        check_reduce_op(op)

        def combine(brought: dict[int, Any]) -> dict[int, Any]:
            self._same_layout("all_reduce", brought)
            total = self._reduce(self._ordered(brought, group), op, tensor)
            return {r: total for r in brought}

        result = self._meet("all_reduce", group, self._p.clone(tensor), combine)
        return self._p.copy_(tensor, result)

    @on_rank_thread
    def all_gather(self, tensor: Any, group: Group | None = None) -> list[Any]:
        def combine(brought: dict[int, Any]) -> dict[int, Any]:
            ordered = self._ordered(brought, group)
            return {r: list(ordered) for r in brought}

        return [self._p.clone(t) for t in self._meet("all_gather", group, self._p.clone(tensor), combine)]

    @on_rank_thread
    def reduce_scatter(self, tensors: Sequence[Any], op: str = "sum", group: Group | None = None) -> Any:
        check_reduce_op(op)
        g = group or self._world
        if len(tensors) != g.size:
            raise ValueError(f"reduce_scatter needs one tensor per group rank ({g.size}), got {len(tensors)}")

        def combine(brought: dict[int, Any]) -> dict[int, Any]:
            ordered = self._ordered(brought, group)
            return {r: self._reduce([b[i] for b in ordered], op, tensors[i]) for i, r in enumerate(g.ranks)}

        return self._meet("reduce_scatter", group, [self._p.clone(t) for t in tensors], combine)

    @on_rank_thread
    def broadcast(self, tensor: Any, src: int, group: Group | None = None) -> Any:
        def combine(brought: dict[int, Any]) -> dict[int, Any]:
            self._same_layout("broadcast", brought)
            return {r: brought[src] for r in brought}

        if src not in (group or self._world).ranks:
            raise ValueError(f"broadcast source rank {src} is not in group {list((group or self._world).ranks)}")
        result = self._meet(f"broadcast(src={src})", group, self._p.clone(tensor), combine)
        return self._p.copy_(tensor, result)

    @on_rank_thread
    def all_to_all(self, tensors: Sequence[Any], group: Group | None = None) -> list[Any]:
        g = group or self._world
        if len(tensors) != g.size:
            raise ValueError(f"all_to_all needs one tensor per group rank ({g.size}), got {len(tensors)}")

        def combine(brought: dict[int, Any]) -> dict[int, Any]:
            ordered = self._ordered(brought, group)
            return {r: [b[i] for b in ordered] for i, r in enumerate(g.ranks)}

        return self._meet("all_to_all", group, [self._p.clone(t) for t in tensors], combine)

    @on_rank_thread
    def barrier(self, group: Group | None = None) -> None:
        self._meet("barrier", group, None, lambda brought: dict.fromkeys(brought))

    # metadata channel -------------------------------------------------------------
    def isend_meta(self, values: Sequence[int], dst: int, tag: int = 0) -> Handle:
        self._post_send([int(v) for v in values], dst, tag, f"meta:{tag}")
        return CompletedHandle()

    def recv_meta(self, src: int, timeout: float | None = None, tag: int = 0) -> list[int]:
        return list(self._take(src, f"meta:{tag}", f"receiving metadata from rank {src}", timeout))

    def _take(self, src: int, kind: str, what: str, timeout: float | None) -> Any:
        ticket = self._post_recv(src, kind)
        state = self.state
        with state.cond:
            box = state.mailbox(src, self._rank, kind)
            state.wait_until(self._rank, lambda: ticket in box.messages, what, timeout)
            return box.messages.pop(ticket).payload

    # objects ------------------------------------------------------------------------
    @on_rank_thread
    def send_object(self, obj: Any, dst: int, group: Group | None = None) -> None:
        self._post_send(pickle.dumps(obj), dst, 0, "object")

    @on_rank_thread
    def recv_object(self, src: int, group: Group | None = None) -> Any:
        return pickle.loads(self._take(src, "object", f"receiving an object from rank {src}", None))

    @on_rank_thread
    def broadcast_object(self, obj: Any, src: int, group: Group | None = None) -> Any:
        if src not in (group or self._world).ranks:
            raise ValueError(f"broadcast source rank {src} is not in group {list((group or self._world).ranks)}")
        data = pickle.dumps(obj) if src == self._rank else None
        result = self._meet(f"broadcast_object(src={src})", group, data, lambda b: {r: b[src] for r in b})
        return pickle.loads(result)

    @on_rank_thread
    def all_gather_object(self, obj: Any, group: Group | None = None) -> list[Any]:
        def combine(brought: dict[int, Any]) -> dict[int, Any]:
            ordered = self._ordered(brought, group)
            return {r: ordered for r in brought}

        return [pickle.loads(b) for b in self._meet("all_gather_object", group, pickle.dumps(obj), combine)]


class LocalCluster:
    """Run ``fn`` once per rank in this process; see the module docstring for the semantics."""

    def __init__(
        self,
        world_size: int,
        platform: str = "torch",
        timeout: float | None = None,
        detect_deadlock: bool = True,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.platform_name = platform
        self._platform_class = platform_class(platform)
        self.timeout = default_comm_timeout() if timeout is None else float(timeout)
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        self.detect_deadlock = detect_deadlock

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; returns the results in rank order."""
        state = _ClusterState(self.world_size, self.timeout, self.detect_deadlock)
        results: list[Any] = [None] * self.world_size
        platforms = []
        for rank in range(self.world_size):
            comm = LocalCommunicator(state, rank)
            platform = self._platform_class(comm=comm)
            comm.platform = platform
            platforms.append(platform)
        state.live = set(range(self.world_size))
        state.randomness = _RankRandomness(platforms[0], self.world_size)  # each rank forks the caller's

        def body(rank: int) -> None:
            platforms[rank].comm.thread = threading.current_thread()  # type: ignore[attr-defined]
            bind_thread_platform(platforms[rank])
            with state.cond:
                try:
                    state.take_turn(rank)
                    results[rank] = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                    if state.failure is None:  # the first failure is the cause; later ones are aborts
                        state.failure = (rank, exc)
                finally:
                    state.live.discard(rank)
                    state.cond.notify_all()
                    bind_thread_platform(None)

        threads = [
            threading.Thread(target=body, args=(rank,), name=f"hyper-parallel-rank-{rank}", daemon=True)
            for rank in range(self.world_size)
        ]
        local_cluster_running(+1)
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            local_cluster_running(-1)
        with state.cond:  # every rank finished: the caller's random state comes back
            state.randomness.restore_caller()
        if state.failure is not None:
            rank, error = state.failure
            raise RankFailedError(rank, error) from error
        return results
