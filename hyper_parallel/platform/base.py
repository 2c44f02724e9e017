"""The framework-neutral interface every backend implements.

The rest of the library talks to torch or MindSpore only through :class:`Platform`.
A platform is made of two halves:

* a :class:`Communicator` (ranks, groups, P2P, collectives, object exchange), which is
  either the framework's own distributed engine or the in-process ``LocalCluster``;
* the framework half implemented by each subclass (tensor helpers, stage autograd,
  gradients, devices/streams/events, host offload).

Ranks are always *global* ranks, also when a group is given.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.platform.thread_binding import bind_thread_platform

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")


def default_comm_timeout() -> float:
    """Seconds a communication wait may block before it fails (``HYPER_PARALLEL_COMM_TIMEOUT``)."""
    value = os.environ.get("HYPER_PARALLEL_COMM_TIMEOUT", "300")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"HYPER_PARALLEL_COMM_TIMEOUT must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"HYPER_PARALLEL_COMM_TIMEOUT must be positive, got {value!r}")
    return seconds


def combine_norm_pows(values: Sequence[float], norm_type: float) -> float:
    """Combine per-tensor results of :meth:`Platform.norm_pow_sum`: a sum, or for ``inf`` the largest
    (``nan`` wins, which Python's ``max`` would drop)."""
    if norm_type != float("inf"):
        return float(sum(values))
    out = 0.0
    for v in values:
        if v != v:  # nan
            return v
        out = max(out, v)
    return out


def check_reduce_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; valid ops: {', '.join(REDUCE_OPS)}")
    return op


class WaitAborted(RuntimeError):
    """A wait ended because the job is stopping (another rank failed, or no rank can progress):
    the error that says why is the one to report, not the wait's."""


class Handle(ABC):
    """A pending communication. ``wait()`` blocks until it is done (or times out).

    ``coalesced`` is True when the engine gave one request for a whole batch of operations
    (NCCL-style coalescing): waiting for it waits for every operation of the batch, receives
    included."""

    coalesced = False

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None: ...

    @abstractmethod
    def is_completed(self) -> bool: ...

    def settle_received(self) -> None:
        """Finish a send whose peer has provably received it (it answered with data computed from
        it). An engine that reports a send complete only once it is waited (gloo: a wait costs tens
        of microseconds, on the pipeline's critical path) may skip the wait; by default: ``wait()``."""
        self.wait()


class CompletedHandle(Handle):
    """A handle for an operation that finished when it was issued."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class HandleGroup(Handle):
    """Several handles waited together (e.g. the size and the body of a metadata message)."""

    def __init__(self, handles: Sequence[Handle]) -> None:
        self._handles = list(handles)

    def wait(self, timeout: float | None = None) -> None:
        for handle in self._handles:
            handle.wait(timeout)

    def is_completed(self) -> bool:
        return all(handle.is_completed() for handle in self._handles)

    def settle_received(self) -> None:
        for handle in self._handles:
            handle.settle_received()


@dataclass(frozen=True)
class Group:
    """A set of global ranks that communicate together; ``native`` is the framework's object."""

    ranks: tuple[int, ...]
    native: Any = field(default=None, compare=False, hash=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, global_rank: int) -> int:
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not in group {list(self.ranks)}") from None


@dataclass
class P2POp:
    """One send or receive of a batched exchange. ``op`` is ``"isend"`` or ``"irecv"``."""

    op: str
    tensor: Any
    peer: int
    group: Group | None = None
    tag: int = 0

    def __post_init__(self) -> None:
        if self.op not in ("isend", "irecv"):
            raise ValueError(f"P2POp.op must be 'isend' or 'irecv', got {self.op!r}")


class Communicator(ABC):
    """Ranks, groups, P2P, collectives and object exchange of one rank."""

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    @abstractmethod
    def world_group(self) -> Group: ...

    @abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Group:
        """Create a group; like torch, every rank of the world calls it with the same ranks."""

    # P2P: ``irecv`` fills the given tensor in place.
    @abstractmethod
    def isend(self, tensor: Any, dst: int, group: Group | None = None, tag: int = 0) -> Handle: ...

    @abstractmethod
    def irecv(self, tensor: Any, src: int, group: Group | None = None, tag: int = 0) -> Handle: ...

    @abstractmethod
    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]: ...

    # The metadata channel: small lists of ints (tensor shapes between pipeline stages) on a
    # FIFO channel of their own per pair of ranks. A send never waits for its receive (eager),
    # so metadata cannot block the data stream; ``recv_meta`` blocks until the values arrived.
    def open_meta_channel(self, ranks: Sequence[int]) -> None:
        """Prepare the metadata channel between ``ranks`` (every rank of ``ranks`` calls it)."""
        return None

    @abstractmethod
    def isend_meta(self, values: Sequence[int], dst: int, tag: int = 0) -> Handle: ...

    @abstractmethod
    def recv_meta(self, src: int, timeout: float | None = None, tag: int = 0) -> list[int]: ...

    # Collectives return their result; all_reduce and broadcast also update ``tensor`` in place.
    @abstractmethod
    def all_reduce(self, tensor: Any, op: str = "sum", group: Group | None = None) -> Any: ...

    def all_reduce_async(self, tensor: Any, op: str = "sum", group: Group | None = None) -> Handle:
        """Start an in-place all-reduce; the handle's ``wait()`` finishes it. Default: done at once."""
        self.all_reduce(tensor, op, group)
        return CompletedHandle()

    @abstractmethod
    def all_gather(self, tensor: Any, group: Group | None = None) -> list[Any]: ...

    @abstractmethod
    def reduce_scatter(self, tensors: Sequence[Any], op: str = "sum", group: Group | None = None) -> Any:
        """Reduce ``tensors[i]`` over the group; group rank ``i`` gets the i-th result."""

    @abstractmethod
    def broadcast(self, tensor: Any, src: int, group: Group | None = None) -> Any: ...

    @abstractmethod
    def all_to_all(self, tensors: Sequence[Any], group: Group | None = None) -> list[Any]:
        """Send ``tensors[i]`` to group rank ``i``; returns what each group rank sent here."""

    @abstractmethod
    def barrier(self, group: Group | None = None) -> None: ...

    # Python objects (metadata)
    @abstractmethod
    def send_object(self, obj: Any, dst: int, group: Group | None = None) -> None: ...

    @abstractmethod
    def recv_object(self, src: int, group: Group | None = None) -> Any: ...

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int, group: Group | None = None) -> Any: ...

    @abstractmethod
    def all_gather_object(self, obj: Any, group: Group | None = None) -> list[Any]: ...

    # helper threads
    def run_threads(self, targets: Sequence[Callable[[], None]]) -> None:
        """Run every target on a thread of its own and return when all have ended.

        The targets act for this rank: they may communicate as the calling thread would.
        They must not raise (catch and record inside). Engines usable from any thread
        (torch.distributed, MindSpore's) just start and join the threads.
        """
        threads = [
            threading.Thread(target=target, name=f"hyper-parallel-helper-{k}", daemon=True)
            for k, target in enumerate(targets)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    # capabilities: what this engine cannot do (``None`` = it can)
    def group_unsupported_reason(self, ranks: Sequence[int]) -> str | None:
        """Why :meth:`new_group` cannot create a group of ``ranks`` here, or ``None``."""
        return None

    def collective_unsupported_reason(self, op: str, group: Group | None = None) -> str | None:
        """Why collective ``op`` (a method name, e.g. ``"reduce_scatter"``) cannot run on ``group``, or ``None``."""
        return None


class HostStream:
    """Stream stand-in on the host, where kernels run in issue order.

    ``drain`` (optional) waits for queued kernels: MindSpore may dispatch asynchronously even
    on the CPU; torch's CPU kernels are done when they return.
    """

    def __init__(self, drain: Callable[[], Any] | None = None) -> None:
        self._drain = drain

    def synchronize(self) -> None:
        if self._drain is not None:
            self._drain()

    def wait_stream(self, stream: Any) -> None:
        return None

    def query(self) -> bool:
        return True


class HostEvent(HostStream):
    """Event stand-in on the host: ``record``/``wait`` are no-ops, ``synchronize`` drains."""

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


@dataclass
class ForwardRecord:
    """What one stage forward keeps for its backward.

    ``outputs`` are the outputs of ``fn`` as a tuple: a tuple or list result gives its items,
    anything else (a single tensor, ``None``...) becomes a 1-tuple. Non-tensors are kept, not
    skipped, so the caller can report the stage that returned them; ``result`` is what ``fn``
    returned. ``grad_args`` marks which
    positional arguments are differentiable inputs; the backward returns one gradient per
    positional argument (``None`` where not differentiable or not reached).
    ``native`` is backend-private state.
    """

    result: Any
    outputs: tuple[Any, ...]
    grad_args: tuple[bool, ...]
    params: tuple[Any, ...]
    native: Any = None


class Platform(ABC):
    """One framework plus one communicator. Subclasses implement the framework half."""

    name: str = "abstract"

    def __init__(self, comm: Communicator | None = None) -> None:
        self._comm = comm

    # ------------------------------------------------------------------ ranks and groups
    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            self._comm = self._default_communicator()
        return self._comm

    @abstractmethod
    def _default_communicator(self) -> Communicator:
        """The framework's own engine (initialised from the launcher's environment)."""

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def world_group(self) -> Group:
        return self.comm.world_group

    def new_group(self, ranks: Sequence[int]) -> Group:
        return self.comm.new_group(ranks)

    # ------------------------------------------------------------------ P2P
    def isend(self, tensor: Any, dst: int, group: Group | None = None, tag: int = 0) -> Handle:
        return self.comm.isend(tensor, dst, group, tag)

    def irecv(self, tensor: Any, src: int, group: Group | None = None, tag: int = 0) -> Handle:
        return self.comm.irecv(tensor, src, group, tag)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]:
        return self.comm.batch_isend_irecv(ops)

    def open_meta_channel(self, ranks: Sequence[int]) -> None:
        self.comm.open_meta_channel(ranks)

    def isend_meta(self, values: Sequence[int], dst: int, tag: int = 0) -> Handle:
        return self.comm.isend_meta(values, dst, tag)

    def recv_meta(self, src: int, timeout: float | None = None, tag: int = 0) -> list[int]:
        return self.comm.recv_meta(src, timeout, tag)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, op: str = "sum", group: Group | None = None) -> Any:
        return self.comm.all_reduce(tensor, check_reduce_op(op), group)

    def all_reduce_async(self, tensor: Any, op: str = "sum", group: Group | None = None) -> Handle:
        """Start an in-place all-reduce of ``tensor``; ``wait()`` on the handle finishes it (where the
        engine allows, it runs while the caller computes: torch.distributed; elsewhere it is done at once)."""
        return self.comm.all_reduce_async(tensor, check_reduce_op(op), group)

    def all_gather(self, tensor: Any, group: Group | None = None) -> list[Any]:
        return self.comm.all_gather(tensor, group)

    def reduce_scatter(self, tensors: Sequence[Any], op: str = "sum", group: Group | None = None) -> Any:
        return self.comm.reduce_scatter(tensors, check_reduce_op(op), group)

    def broadcast(self, tensor: Any, src: int, group: Group | None = None) -> Any:
        return self.comm.broadcast(tensor, src, group)

    def all_to_all(self, tensors: Sequence[Any], group: Group | None = None) -> list[Any]:
        return self.comm.all_to_all(tensors, group)

    def barrier(self, group: Group | None = None) -> None:
        self.comm.barrier(group)

    # ------------------------------------------------------------------ objects
    def send_object(self, obj: Any, dst: int, group: Group | None = None) -> None:
        self.comm.send_object(obj, dst, group)

    def recv_object(self, src: int, group: Group | None = None) -> Any:
        return self.comm.recv_object(src, group)

    def broadcast_object(self, obj: Any, src: int, group: Group | None = None) -> Any:
        return self.comm.broadcast_object(obj, src, group)

    def all_gather_object(self, obj: Any, group: Group | None = None) -> list[Any]:
        return self.comm.all_gather_object(obj, group)

    def group_unsupported_reason(self, ranks: Sequence[int]) -> str | None:
        return self.comm.group_unsupported_reason(ranks)

    def collective_unsupported_reason(self, op: str, group: Group | None = None) -> str | None:
        return self.comm.collective_unsupported_reason(op, group)

    # ------------------------------------------------------------------ distributed tensors
    # Placements cross this boundary as tuples: ("shard", dim), ("replicate",), ("partial", op).
    def custom_function(self, forward: Callable[[Any], Any], backward: Callable[[Any], Any], tensor: Any) -> Any:
        """``forward(tensor)``, differentiable with ``backward(grad_out) -> grad_in`` where the backend can.

        The default records nothing: the gradient stops here.
        """
        return forward(tensor)

    def sync_point(self, tensor: Any, on_forward: Callable[[], None], on_backward: Callable[[], None]) -> Any:
        """Identity on ``tensor`` that calls ``on_forward()`` now and ``on_backward()`` when the
        backward reaches it (before anything upstream of it runs; the gradient is unchanged).

        The returned tensor must be used in place of ``tensor``. No backward callback happens
        for a tensor no gradient flows through.
        """
        raise NotImplementedError(f"the {self.name} platform has no differentiable sync points")

    def compiled_stages(self, module: Any = None) -> str | None:
        """Why stage steps would run as compiled graphs now (for error messages), or None when they
        run op by op. Python code inside a compiled stage (hooks, sync points, Python-level
        communication, activation wrappers) does not run at each step. With ``module`` (a stage's
        module), also why that module is compiled by itself (e.g. a construct the user compiled)."""
        return None

    def user_compiled_modules(self, module: Any) -> list[str]:
        """Dotted names (``""`` for ``module`` itself) of the modules in ``module`` whose forward the
        user compiled into a graph (MindSpore: a ``construct`` decorated with ``@ms.jit``), also when
        an activation wrapper replaced that forward since; ``[]`` on platforms without such graphs."""
        return []

    def run_helper_threads(self, targets: Sequence[Callable[[], None]]) -> None:
        """Run every target on a thread of its own that acts for this rank; return when all ended.

        In each thread ``get_platform()`` returns this platform, the framework's per-thread
        state of the caller that matters for autograd is copied (torch's grad mode), and
        communication works as on the calling thread (see :meth:`Communicator.run_threads`).
        Targets must not raise.
        """
        state = self._thread_state()

        def wrap(target: Callable[[], None]) -> Callable[[], None]:
            def body() -> None:
                bind_thread_platform(self)
                try:
                    self._enter_thread_state(state)
                    target()
                finally:
                    bind_thread_platform(None)

            return body

        self.comm.run_threads([wrap(target) for target in targets])

    def _thread_state(self) -> Any:
        """Per-thread framework state of the calling thread that a helper thread should share."""
        return None

    def _enter_thread_state(self, state: Any) -> None:
        """Install what :meth:`_thread_state` returned, in a helper thread."""
        return None

    def group_from_native(self, native: Any) -> Group:
        """Wrap the framework's own group object (a torch ProcessGroup)."""
        raise TypeError(f"the {self.name} platform cannot wrap a native group ({type(native).__name__})")

    def native_process_group(self, group: Group) -> Any:
        """The framework's process group behind ``group`` (torch only)."""
        raise TypeError(f"the {self.name} platform has no torch.distributed process groups")

    def native_device_mesh(self, device_type: str, nested: Any, groups: Sequence[Group], names: Sequence[str]) -> Any:
        """The framework's device mesh over existing groups, one per dimension (torch only)."""
        raise TypeError(f"the {self.name} platform has no native device mesh")

    def mesh_from_native(self, native: Any) -> tuple[str, list[Any], tuple[str, ...], list[Group]]:
        """``(device_type, nested ranks, dim names, this rank's group per dim)`` of a native mesh."""
        raise TypeError(f"the {self.name} platform has no native device mesh")

    def native_dtensor_available(self) -> bool:
        """Whether :meth:`native_redistribute` may be used (a real torch.distributed job)."""
        return False

    def native_redistribute(self, local: Any, mesh: Any, src: Sequence[tuple[Any, ...]],
                            dst: Sequence[tuple[Any, ...]], shape: Sequence[int]) -> Any:
        """Redistribute with the framework's own distributed tensor (no autograd recorded)."""
        raise TypeError(f"the {self.name} platform has no native distributed tensor")

    def native_dtensor(self, local: Any, mesh: Any, placements: Sequence[tuple[Any, ...]],
                       shape: Sequence[int]) -> Any:
        """The framework's own distributed tensor around ``local`` (torch's DTensor)."""
        raise TypeError(f"the {self.name} platform has no native distributed tensor")

    def dtensor_from_native(self, native: Any) -> tuple[Any, Any, tuple[tuple[Any, ...], ...], tuple[int, ...]]:
        """``(local tensor, native mesh, placements, global shape)`` of a native distributed tensor."""
        raise TypeError(f"the {self.name} platform has no native distributed tensor")

    # ------------------------------------------------------------------ tensors
    @abstractmethod
    def is_tensor(self, obj: Any) -> bool: ...

    @abstractmethod
    def tensor(self, data: Any, dtype: str | None = None) -> Any:
        """A new tensor from Python/numpy data; ``dtype`` is a name such as ``"float32"``."""

    @abstractmethod
    def zeros(self, shape: Sequence[int], dtype: str = "float32", device: Any = None) -> Any: ...

    @abstractmethod
    def ones(self, shape: Sequence[int], dtype: str = "float32", device: Any = None) -> Any: ...

    @abstractmethod
    def empty(self, shape: Sequence[int], dtype: str = "float32", device: Any = None) -> Any: ...

    def check_device(self, device: Any) -> Any:
        """The platform's form of a user-given device (``None``: the platform's own); raises a
        ``ValueError`` naming a device this platform cannot place tensors on."""
        return device

    def to_stage_device(self, tensor: Any, device: Any) -> Any:
        """``tensor`` on ``device`` (unchanged where it is there already, or ``device`` is ``None``)."""
        return tensor

    def zeros_like(self, tensor: Any) -> Any:
        return self.zeros(self.shape(tensor), self.dtype_name(tensor))

    def ones_like(self, tensor: Any) -> Any:
        return self.ones(self.shape(tensor), self.dtype_name(tensor))

    def empty_like(self, tensor: Any) -> Any:
        return self.empty(self.shape(tensor), self.dtype_name(tensor))

    @abstractmethod
    def shape(self, tensor: Any) -> tuple[int, ...]: ...

    @abstractmethod
    def dtype_name(self, tensor: Any) -> str:
        """Framework-neutral dtype name: ``"float32"``, ``"bfloat16"``, ``"int64"``, ``"bool"``..."""

    @abstractmethod
    def is_floating(self, tensor: Any) -> bool: ...

    def requires_grad(self, tensor: Any) -> bool:
        """Whether a gradient can flow back through ``tensor`` (backends that cannot tell: floating)."""
        return self.is_floating(tensor)

    def numel(self, tensor: Any) -> int:
        n = 1
        for d in self.shape(tensor):
            n *= d
        return n

    @abstractmethod
    def cat(self, tensors: Sequence[Any], dim: int = 0) -> Any: ...

    @abstractmethod
    def chunk(self, tensor: Any, chunks: int, dim: int = 0) -> list[Any]:
        """Split into exactly ``chunks`` equal pieces along ``dim`` (the size must divide)."""

    @abstractmethod
    def to_numpy(self, tensor: Any) -> Any:
        """A numpy array with the values (bfloat16 is widened to float32)."""

    @abstractmethod
    def from_numpy(self, array: Any, dtype: str | None = None) -> Any: ...

    @abstractmethod
    def detach(self, tensor: Any) -> Any: ...

    @abstractmethod
    def clone(self, tensor: Any) -> Any:
        """A detached copy with its own storage."""

    @abstractmethod
    def copy_(self, dst: Any, src: Any) -> Any:
        """Copy ``src``'s values into ``dst`` in place; returns ``dst``."""

    @abstractmethod
    def storage_nbytes(self, tensor: Any) -> int:
        """Bytes of memory the tensor's storage holds (0 after :meth:`release_storage`)."""

    @abstractmethod
    def release_storage(self, tensor: Any) -> None:
        """Drop the tensor's data while keeping its autograd link (after it was sent)."""

    def releasable(self, record: ForwardRecord, tensor: Any) -> bool:
        """Whether ``release_storage`` may drop this output of ``record``'s forward.

        It must not be a parameter, buffer, input or user tensor, and the backward must not
        read it. Backends that cannot tell answer ``False`` (the data is then kept).
        """
        return False

    # ------------------------------------------------------------------ stage autograd
    @abstractmethod
    def stage_forward(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        params: Sequence[Any],
        grad_args: Sequence[bool],
        saved_pool: bool = True,
    ) -> ForwardRecord:
        """Run ``fn(*args, **kwargs)`` keeping what backward needs.

        Arguments flagged in ``grad_args`` are tensors treated as differentiable leaves
        (detached from any earlier graph first). ``params`` are the weights whose
        gradients the backward accumulates. ``saved_pool=False`` says that the record gets one
        full backward and no dx/dW split, so a backend may skip packing what the graph saves
        (it still does when swap, recompute or memory accounting are in use).
        """

    @abstractmethod
    def stage_forward_no_grad(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Run ``fn(*args, **kwargs)`` recording no graph; returns what ``fn`` returned."""

    def grad_enabled(self) -> bool:
        """Whether the caller records gradients (``False`` inside ``torch.no_grad()``)."""
        return True

    @abstractmethod
    def stage_backward(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        """Full backward: accumulate parameter gradients and return input gradients.

        ``grads`` aligns with ``record.outputs``; ``None`` means no gradient flows from that
        output (for a scalar loss pass ``ones_like(loss)``). Returns one entry per
        positional argument of the forward (``None`` where not differentiable).
        """

    @abstractmethod
    def stage_backward_input(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        """Input gradients only; keeps what :meth:`stage_backward_weight` needs."""

    @abstractmethod
    def stage_backward_weight(self, record: ForwardRecord) -> None:
        """Accumulate the parameter gradients of a record whose input backward ran."""

    # ------------------------------------------------------------------ parameters and gradients
    def is_identity_module(self, module: Any) -> bool:
        """Whether ``module`` is the framework's identity module itself (torch ``nn.Identity``,
        MindSpore ``nn.Identity``; not a subclass, which may override the forward), which passes
        its inputs through, however many there are."""
        return False

    @abstractmethod
    def named_parameters(self, module: Any) -> list[tuple[str, Any]]:
        """Trainable parameters of a module (torch ``nn.Module`` / MindSpore ``Cell``)."""

    def unique_parameter_names(self, stage_params: Sequence[tuple[int, Sequence[Any]]]) -> None:
        """Make the framework-level names of the parameters of one rank's stages unique where the
        framework needs it (MindSpore optimizers refuse two parameters of one name); a name that
        clashes gets its stage as a prefix: ``stage3.0.weight``."""
        return None

    @abstractmethod
    def get_grad(self, param: Any) -> Any | None: ...

    @abstractmethod
    def set_grad(self, param: Any, grad: Any | None) -> None: ...

    def zero_grads(self, params: Sequence[Any]) -> None:
        for p in params:
            self.set_grad(p, None)

    @abstractmethod
    def scale_grads(self, params: Sequence[Any], factor: float) -> None:
        """Multiply every existing gradient by ``factor`` in place."""

    @abstractmethod
    def param_data(self, param: Any) -> Any:
        """The parameter's value as a plain tensor (no autograd)."""

    @abstractmethod
    def assign_param(self, param: Any, value: Any) -> None:
        """Overwrite the parameter's value in place."""

    # ------------------------------------------------------------------ device, streams, events
    @property
    @abstractmethod
    def device_type(self) -> str:
        """``"cpu"``, ``"cuda"`` or ``"npu"``."""

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def new_stream(self) -> Any: ...

    @abstractmethod
    def stream_context(self, stream: Any) -> AbstractContextManager[Any]: ...

    @abstractmethod
    def new_event(self) -> Any:
        """An event with ``record()``, ``wait()`` (current stream waits) and ``synchronize()``."""

    # ------------------------------------------------------------------ host offload
    @abstractmethod
    def to_host(self, tensor: Any, non_blocking: bool = False) -> Any:
        """A host copy of a device tensor (pinned where the device supports it)."""

    @abstractmethod
    def to_device(self, tensor: Any, non_blocking: bool = False) -> Any:
        """Copy a host tensor back to this platform's device."""

    # ------------------------------------------------------------------ saved activations
    def saved_tensors(self) -> Any:
        """This platform's :class:`~hyper_parallel.platform.activations.SavedTensorSupport`: swap and
        recompute wrappers, schedule-driven swap and saved-activation accounting."""
        raise NotImplementedError(f"the {self.name} platform has no saved-tensor support")

    # ------------------------------------------------------------------ data parallelism, sharding, checkpoints
    def reshape(self, tensor: Any, shape: Sequence[int]) -> Any:
        """``tensor`` with ``shape`` (a view where the framework can)."""
        raise NotImplementedError(f"the {self.name} platform has no reshape")

    def split(self, tensor: Any, sizes: Sequence[int], dim: int = 0) -> list[Any]:
        """Pieces of ``tensor`` along ``dim`` with the given sizes (which add up to its size there)."""
        raise NotImplementedError(f"the {self.name} platform has no split")

    def set_param_storage(self, param: Any, value: Any) -> None:
        """Make ``value`` (of any shape) the data of ``param``, dropping the old data; the parameter object
        stays the same, so modules and optimizers keep referring to it (how parameters are sharded)."""
        raise NotImplementedError(f"the {self.name} platform cannot replace a parameter's data")

    def register_forward_pre_hook(self, module: Any, hook: Callable[[], None]) -> Any:
        """Call ``hook()`` before every forward of ``module``; returns a handle with ``remove()``."""
        raise NotImplementedError(f"the {self.name} platform has no forward pre-hooks")

    def local_tensor(self, tensor: Any) -> Any:
        """This rank's piece of a framework-native distributed tensor (torch's DTensor), else ``tensor``."""
        return tensor

    def native_shard_count(self, tensor: Any) -> int:
        """How many distinct pieces a framework-native distributed tensor is cut into (1 for a plain tensor)."""
        return 1

    def norm_pow_sum(self, tensors: Sequence[Any], norm_type: float) -> float:
        """Over every element of ``tensors`` (local pieces): the sum of ``|x| ** norm_type``, or the largest
        ``|x|`` for ``norm_type=inf``, in float64 (``inf``/``nan`` propagate)."""
        import numpy as np

        arrays = [np.abs(np.asarray(self.to_numpy(self.local_tensor(t)), dtype=np.float64)) for t in tensors]
        return combine_norm_pows([float(a.max()) if norm_type == float("inf") else float(np.sum(a ** norm_type))
                                  for a in arrays if a.size], norm_type)

    def native_fsdp(self) -> Any | None:
        """The framework's own FSDP where this job can use it (torch's FSDP2 in a torch.distributed job),
        else ``None``; its methods are listed in ``hyper_parallel/core/fully_shard/native.py``."""
        return None

    def checkpointed_tensors(self, module: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        """What a checkpoint holds of ``module``: every parameter (trainable or frozen) and every
        persistent buffer, each as ``(name, tensor)``."""
        raise NotImplementedError(f"the {self.name} platform cannot list a module's state")

    def checkpoint_layout(self) -> str:
        """The kind of checkpoint this job writes (recorded in the commit marker; a load checks it)."""
        return f"{self.name} per-rank files"

    def save_checkpoint(self, path: str, params: Mapping[str, Any], optimizers: Sequence[Any], extra: Any,
                        buffers: Mapping[str, Any] | None = None) -> None:
        """Write ``params`` and ``buffers`` (key -> tensor), the state of ``optimizers``, this rank's random
        state and ``extra`` into the existing folder ``path`` (a collective over the world; atomicity is
        ``hyper_parallel/core/checkpoint/atomic.py``'s)."""
        raise NotImplementedError(f"the {self.name} platform cannot save checkpoints")

    def load_checkpoint(self, path: str, params: Mapping[str, Any], optimizers: Sequence[Any],
                        buffers: Mapping[str, Any] | None = None, strict: bool = True) -> Any:
        """Read what :meth:`save_checkpoint` wrote into the given tensors and optimizers and restore the
        random state; returns ``extra``. Every rank validates first and the ranks agree before anything
        changes (:func:`hyper_parallel.platform.checkpoint_common.agree`)."""
        raise NotImplementedError(f"the {self.name} platform cannot load checkpoints")

    # ------------------------------------------------------------------ random state
    def get_rng_state(self) -> Any:
        """A snapshot of the framework's process-wide default random state.

        LocalCluster swaps these snapshots when the compute turn passes from one rank to
        another, so each rank draws as a separate process would. ``None``: nothing to save.
        """
        return None

    def set_rng_state(self, state: Any) -> None:
        """Install a snapshot taken by :meth:`get_rng_state` (of the same framework)."""
        return None

    def draw_rng_seed(self) -> int | None:
        """A seed in ``[0, 2**31)`` drawn from the process-wide random state (advancing it), for
        :meth:`seed_rng` on this or another rank: how a random forward is replayed elsewhere (MPipe's
        recompute). ``None``: this platform has no random state to replay."""
        return None

    def seed_rng(self, seed: int) -> None:
        """Make the process-wide random state a fresh one made from ``seed`` (every rank and process
        gets the same draws from the same seed); :meth:`set_rng_state` puts the previous one back."""
        return None

    def __repr__(self) -> str:
        comm = type(self._comm).__name__ if self._comm is not None else "uninitialised"
        return f"{type(self).__name__}(communicator={comm})"
