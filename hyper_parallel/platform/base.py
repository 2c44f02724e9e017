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
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

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


def check_reduce_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; valid ops: {', '.join(REDUCE_OPS)}")
    return op


class Handle(ABC):
    """A pending communication. ``wait()`` blocks until it is done (or times out)."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None: ...

    @abstractmethod
    def is_completed(self) -> bool: ...


class CompletedHandle(Handle):
    """A handle for an operation that finished when it was issued."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


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

    # Collectives return their result; all_reduce and broadcast also update ``tensor`` in place.
    @abstractmethod
    def all_reduce(self, tensor: Any, op: str = "sum", group: Group | None = None) -> Any: ...

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

    ``outputs`` are the tensor outputs of ``fn`` flattened into a tuple (a single tensor
    becomes a 1-tuple); ``result`` is what ``fn`` returned. ``grad_args`` marks which
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

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, op: str = "sum", group: Group | None = None) -> Any:
        return self.comm.all_reduce(tensor, check_reduce_op(op), group)

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

    # ------------------------------------------------------------------ tensors
    @abstractmethod
    def is_tensor(self, obj: Any) -> bool: ...

    @abstractmethod
    def tensor(self, data: Any, dtype: str | None = None) -> Any:
        """A new tensor from Python/numpy data; ``dtype`` is a name such as ``"float32"``."""

    @abstractmethod
    def zeros(self, shape: Sequence[int], dtype: str = "float32") -> Any: ...

    @abstractmethod
    def ones(self, shape: Sequence[int], dtype: str = "float32") -> Any: ...

    @abstractmethod
    def empty(self, shape: Sequence[int], dtype: str = "float32") -> Any: ...

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
    ) -> ForwardRecord:
        """Run ``fn(*args, **kwargs)`` keeping what backward needs.

        Arguments flagged in ``grad_args`` are tensors treated as differentiable leaves
        (detached from any earlier graph first). ``params`` are the weights whose
        gradients the backward accumulates.
        """

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
    @abstractmethod
    def named_parameters(self, module: Any) -> list[tuple[str, Any]]:
        """Trainable parameters of a module (torch ``nn.Module`` / MindSpore ``Cell``)."""

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

    def __repr__(self) -> str:
        comm = type(self._comm).__name__ if self._comm is not None else "uninitialised"
        return f"{type(self).__name__}(communicator={comm})"
