"""MindSporeCommunicator: ranks, groups and collectives on ``mindspore.communication``.

Launch a multi-process job with ``msrun``; the communicator calls ``mindspore.communication.init()``
when it finds the launcher's environment (``MS_ROLE`` or OpenMPI), else it is a single process of
rank 0 in a world of 1 where every collective is an identity.

CPU build (backend MCCL), measured on MindSpore 2.10: only the world group, and only AllReduce
(sum, float32/float16), AllGather and Broadcast exist. Other reductions and dtypes are done here by
gathering every rank's values and reducing locally (exact, fine for the small tensors that cross ranks
on the CPU); objects travel pickled as int32 words. Point-to-point, reduce-scatter, all-to-all and
sub-groups raise a clear error: run multi-rank CPU pipelines on ``LocalCluster``.

Ascend/GPU builds use ``mindspore.mint.distributed`` (in-place collectives, isend/irecv,
batch_isend_irecv, reduce_scatter, all_to_all). That half is written from the 2.10 API docs and is
NOT verified here (no device). MindSpore has no message tags and no wait timeout: ``tag`` is ignored
(messages between two ranks arrive in issue order) and ``Handle.wait(timeout)`` waits without limit.
Objects are unpickled with :mod:`pickle`: exchange them only inside a trusted job.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import ops as msops

from hyper_parallel.platform.mindspore.dtypes import dtype_name_of

from hyper_parallel.platform.base import (
    HandleGroup,
    CompletedHandle,
    Communicator,
    Group,
    Handle,
    P2POp,
    check_reduce_op,
)

_CPU_HINT = (
    "MindSpore's CPU build has no {what}; multi-rank pipelines on CPU run on "
    "hyper_parallel.platform.local.LocalCluster(world_size, platform=\"mindspore\")"
)
# dtypes the CPU kernels take natively (measured on 2.10); others go through int32 words
_CPU_SUM_DTYPES = (ms.float32, ms.float16)
_CPU_GATHER_DTYPES = (ms.float32, ms.float16, ms.int32)  # int64 is silently narrowed to int32 (measured)
_CPU_BROADCAST_DTYPES = (ms.float32, ms.int32)
_NP_REDUCE = {"sum": np.sum, "avg": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


def launched_distributed() -> bool:
    """Whether a launcher (msrun / OpenMPI) started this process as one rank of a job."""
    return bool(os.environ.get("MS_ROLE") or os.environ.get("OMPI_COMM_WORLD_RANK"))


class MindSporeHandle(Handle):
    """A ``mint.distributed`` CommHandle; several ops of one batch may share it."""

    def __init__(self, native: Any, shared: list[bool] | None = None) -> None:
        self._native = native
        self._done = shared if shared is not None else [native is None]

    def wait(self, timeout: float | None = None) -> None:
        if not self._done[0]:
            self._native.wait()
            self._done[0] = True

    def is_completed(self) -> bool:
        return self._done[0]


def _detached(tensor: Any) -> Any:
    return msops.stop_gradient(tensor)


def _to_numpy(tensor: Any) -> np.ndarray:
    if tensor.dtype == ms.bfloat16:
        tensor = tensor.astype(ms.float32)
    return tensor.asnumpy()


def _from_numpy(array: np.ndarray, dtype: Any) -> Any:
    if dtype == ms.bfloat16:
        return ms.Tensor(np.asarray(array, np.float32)).astype(ms.bfloat16)
    return ms.Tensor(np.asarray(array, np.dtype(dtype_name_of(dtype))))


def _words(data: bytes, length: int) -> np.ndarray:
    """``data`` zero-padded to ``length`` bytes (a multiple of 4), viewed as int32."""
    return np.frombuffer(data.ljust(length, b"\0"), dtype=np.int32).copy()


def _padded(n: int) -> int:
    return max(4, (n + 3) // 4 * 4)


class MindSporeCommunicator(Communicator):
    """One rank of an ``msrun`` job (or a single process) on MindSpore's own collectives."""

    def __init__(self) -> None:
        from mindspore.communication import GlobalComm

        self._cpu = str(ms.get_context("device_target")) == "CPU"
        if not GlobalComm.INITED and launched_distributed():
            from mindspore.communication import init

            init()
        self._distributed = bool(GlobalComm.INITED)
        if self._distributed:
            from mindspore.communication import get_group_size, get_rank

            self._rank, size, native = get_rank(), get_group_size(), str(GlobalComm.WORLD_COMM_GROUP)
        else:
            self._rank, size, native = 0, 1, None
        self._world = Group(tuple(range(size)), native=native)
        self._groups: dict[tuple[int, ...], Group] = {self._world.ranks: self._world}

    # ------------------------------------------------------------------ ranks and groups
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world.size

    @property
    def world_group(self) -> Group:
        return self._world

    def new_group(self, ranks: Sequence[int]) -> Group:
        """Group ranks are ordered by global rank. Non-members get a Group they must not use."""
        key = tuple(sorted(int(r) for r in ranks))
        if len(set(key)) != len(key) or not key or any(r < 0 or r >= self.world_size for r in key):
            raise ValueError(f"invalid group ranks {list(ranks)} for a world of {self.world_size}")
        if key not in self._groups:
            if self._cpu:
                raise RuntimeError(_CPU_HINT.format(what=f"communication sub-groups (asked for {list(key)})"))
            name = "hyper_parallel_" + "_".join(map(str, key))
            if self.rank in key:  # MindSpore creates a group on its members only
                from mindspore.communication import create_group

                create_group(name, list(key))
            self._groups[key] = Group(key, native=name)
        return self._groups[key]

    def group_unsupported_reason(self, ranks: Sequence[int]) -> str | None:
        if self._cpu and tuple(sorted(int(r) for r in ranks)) != self._world.ranks:
            return _CPU_HINT.format(what=f"communication sub-groups (asked for {sorted(ranks)})")
        return None

    def collective_unsupported_reason(self, op: str, group: Group | None = None) -> str | None:
        group = self._world if group is None else group
        if not self._cpu or self._local(group):
            return None
        if group.ranks != self._world.ranks:
            return _CPU_HINT.format(what=f"{op} on a sub-group (only the world group)")
        if op in ("reduce_scatter", "all_to_all", "isend", "irecv", "batch_isend_irecv"):
            return _CPU_HINT.format(what=op)
        return None

    def _group(self, group: Group | None, what: str) -> Group:
        group = self._world if group is None else group
        if self._cpu and group.ranks != self._world.ranks:
            raise RuntimeError(_CPU_HINT.format(what=f"{what} on a sub-group (only the world group)"))
        if self.rank not in group.ranks:
            raise ValueError(f"rank {self.rank} is not in group {list(group.ranks)}")
        return group

    def _local(self, group: Group) -> bool:
        """True when nothing needs to cross processes (single process or a group of one)."""
        return not self._distributed or group.size == 1

    @staticmethod
    def _mint() -> Any:
        import mindspore.mint.distributed as dist

        return dist

    def _cpu_unavailable(self, what: str) -> RuntimeError:
        return RuntimeError(_CPU_HINT.format(what=what))

    # ------------------------------------------------------------------ P2P (Ascend/GPU only)
    def isend(self, tensor: Any, dst: int, group: Group | None = None, tag: int = 0) -> Handle:
        if self._cpu:
            raise self._cpu_unavailable("point-to-point communication (isend)")
        native = self._group(group, "isend").native
        return MindSporeHandle(self._mint().isend(tensor, dst, group=native))

    def irecv(self, tensor: Any, src: int, group: Group | None = None, tag: int = 0) -> Handle:
        if self._cpu:
            raise self._cpu_unavailable("point-to-point communication (irecv)")
        native = self._group(group, "irecv").native
        return MindSporeHandle(self._mint().irecv(tensor, src, group=native))

    # ------------------------------------------------------------------ metadata channel
    # MindSpore offers no second, eager transport beside HCCL: metadata travels as two small int
    # tensors (size, then values) over the same point-to-point engine. Untested on Ascend here.
    def isend_meta(self, values: Sequence[int], dst: int, tag: int = 0) -> Handle:
        if self._cpu:
            raise self._cpu_unavailable("point-to-point communication (metadata)")
        size = ms.Tensor(np.array([len(values)], np.int64))
        first = self.isend(size, dst, tag=tag)
        second = self.isend(ms.Tensor(np.array(values, np.int64)), dst, tag=tag) if len(values) else None
        return HandleGroup([h for h in (first, second) if h is not None])

    def recv_meta(self, src: int, timeout: float | None = None, tag: int = 0) -> list[int]:
        if self._cpu:
            raise self._cpu_unavailable("point-to-point communication (metadata)")
        size = ms.Tensor(np.zeros(1, np.int64))
        self.irecv(size, src, tag=tag).wait(timeout)
        count = int(size.asnumpy()[0])
        if not count:
            return []
        body = ms.Tensor(np.zeros(count, np.int64))
        self.irecv(body, src, tag=tag).wait(timeout)
        return [int(v) for v in body.asnumpy().tolist()]

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]:
        if self._cpu:
            raise self._cpu_unavailable("point-to-point communication (batch_isend_irecv)")
        dist = self._mint()
        by_group: dict[Any, list[int]] = {}
        for i, op in enumerate(ops):
            by_group.setdefault(self._group(op.group, "batch_isend_irecv").native, []).append(i)
        handles: list[Handle] = [CompletedHandle()] * len(ops)
        for native, indices in by_group.items():
            batch = [dist.P2POp(ops[i].op, ops[i].tensor, ops[i].peer, group=native) for i in indices]
            natives = dist.batch_isend_irecv(batch)
            shared = [False]
            for i in indices:
                handles[i] = MindSporeHandle(natives[0] if natives else None, shared)
        return handles

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: Any, op: str = "sum", group: Group | None = None) -> Any:
        op = check_reduce_op(op)
        group = self._group(group, "all_reduce")
        if self._local(group):
            return tensor
        if not self._cpu:
            self._mint().all_reduce(tensor, op="sum" if op == "avg" else op, group=group.native)
            if op == "avg":
                tensor.copy_(self._divide(tensor, group.size))
            return tensor
        if op in ("sum", "avg") and tensor.dtype in _CPU_SUM_DTYPES:
            result = msops.AllReduce(op="sum", group=group.native)(_detached(tensor))
        else:
            values = np.stack([_to_numpy(t) for t in self.all_gather(tensor, group)])
            result = _from_numpy(_NP_REDUCE[op](values, axis=0), tensor.dtype)
        if op == "avg":
            result = self._divide(result, group.size)
        tensor.copy_(result)
        return tensor

    @staticmethod
    def _divide(tensor: Any, size: int) -> Any:
        """``tensor / size`` in the tensor's dtype (integer averages truncate)."""
        return (tensor / size).astype(tensor.dtype)

    def all_gather(self, tensor: Any, group: Group | None = None) -> list[Any]:
        group = self._group(group, "all_gather")
        if self._local(group):
            return [_detached(tensor).copy()]
        if not self._cpu:
            out = [ms.mint.empty_like(tensor) for _ in range(group.size)]
            self._mint().all_gather(out, tensor, group=group.native)
            return out
        if tensor.dtype in _CPU_GATHER_DTYPES:
            flat = _detached(tensor).reshape((1, -1))
            gathered = msops.AllGather(group=group.native)(flat)
            return [t.reshape(tensor.shape) for t in msops.split(gathered, 1, axis=0)]
        data = self._gather_bytes(_to_numpy(tensor).tobytes(), group)
        np_type = np.float32 if tensor.dtype == ms.bfloat16 else np.dtype(dtype_name_of(tensor.dtype))
        return [_from_numpy(np.frombuffer(b, np_type).reshape(tensor.shape), tensor.dtype) for b in data]

    def reduce_scatter(self, tensors: Sequence[Any], op: str = "sum", group: Group | None = None) -> Any:
        op = check_reduce_op(op)
        group = self._group(group, "reduce_scatter")
        if len(tensors) != group.size:
            raise ValueError(f"reduce_scatter needs {group.size} tensors (one per group rank), got {len(tensors)}")
        if self._local(group):
            return _detached(tensors[0]).copy()
        if self._cpu:
            raise self._cpu_unavailable("reduce_scatter")
        out = ms.mint.empty_like(tensors[0])
        self._mint().reduce_scatter(out, list(tensors), op="sum" if op == "avg" else op, group=group.native)
        return self._divide(out, group.size) if op == "avg" else out

    def broadcast(self, tensor: Any, src: int, group: Group | None = None) -> Any:
        group = self._group(group, "broadcast")
        group.group_rank(src)
        if self._local(group):
            return tensor
        if not self._cpu:
            self._mint().broadcast(tensor, src, group=group.native)
            return tensor
        if tensor.dtype in _CPU_BROADCAST_DTYPES:
            result = msops.Broadcast(src, group=group.native)((_detached(tensor),))[0]
        elif tensor.dtype == ms.bfloat16:
            result = self.broadcast(tensor.astype(ms.float32), src, group).astype(ms.bfloat16)
        else:
            array = _to_numpy(tensor)
            words = self._broadcast_words(_words(array.tobytes(), _padded(array.nbytes)), src, group)
            data = words.tobytes()[: array.nbytes]
            result = _from_numpy(np.frombuffer(data, array.dtype).reshape(array.shape), tensor.dtype)
        tensor.copy_(result)
        return tensor

    def all_to_all(self, tensors: Sequence[Any], group: Group | None = None) -> list[Any]:
        """Each received tensor has the shape of the tensor this rank sends to that peer."""
        group = self._group(group, "all_to_all")
        if len(tensors) != group.size:
            raise ValueError(f"all_to_all needs {group.size} tensors (one per group rank), got {len(tensors)}")
        if self._local(group):
            return [_detached(tensors[0]).copy()]
        if self._cpu:
            raise self._cpu_unavailable("all_to_all")
        out = [ms.mint.empty_like(t) for t in tensors]
        self._mint().all_to_all(out, list(tensors), group=group.native)
        return out

    def barrier(self, group: Group | None = None) -> None:
        group = self._group(group, "barrier")
        if self._local(group):
            return
        token = ms.Tensor(np.ones((1,), np.float32))
        self.all_reduce(token, "sum", group).asnumpy()

    # ------------------------------------------------------------------ objects
    def _broadcast_words(self, words: np.ndarray, src: int, group: Group) -> np.ndarray:
        tensor = ms.Tensor(words)
        return self.broadcast(tensor, src, group).asnumpy()

    def _gather_bytes(self, data: bytes, group: Group) -> list[bytes]:
        """Every group rank's ``data`` (any lengths), gathered as int32 words."""
        lengths = self.all_gather(ms.Tensor(np.array([len(data)], np.int32)), group)
        sizes = [int(t.asnumpy()[0]) for t in lengths]
        width = _padded(max(sizes))
        words = self.all_gather(ms.Tensor(_words(data, width)), group)
        return [w.asnumpy().tobytes()[:n] for w, n in zip(words, sizes)]

    def send_object(self, obj: Any, dst: int, group: Group | None = None) -> None:
        if self._cpu:
            raise self._cpu_unavailable("point-to-point communication (send_object)")
        data = pickle.dumps(obj)
        self.isend(ms.Tensor(np.array([len(data)], np.int64)), dst, group).wait()
        self.isend(ms.Tensor(np.frombuffer(data, np.uint8).copy()), dst, group).wait()

    def recv_object(self, src: int, group: Group | None = None) -> Any:
        if self._cpu:
            raise self._cpu_unavailable("point-to-point communication (recv_object)")
        length = ms.Tensor(np.zeros((1,), np.int64))
        self.irecv(length, src, group).wait()
        payload = ms.Tensor(np.zeros((int(length.asnumpy()[0]),), np.uint8))
        self.irecv(payload, src, group).wait()
        return pickle.loads(payload.asnumpy().tobytes())

    def broadcast_object(self, obj: Any, src: int, group: Group | None = None) -> Any:
        group = self._group(group, "broadcast_object")
        group.group_rank(src)
        if self._local(group):
            return obj
        data = pickle.dumps(obj) if self.rank == src else b""
        length = self._broadcast_words(np.array([len(data)], np.int32), src, group)
        size = int(length[0])
        words = self._broadcast_words(_words(data, _padded(size)), src, group)
        return pickle.loads(words.tobytes()[:size])

    def all_gather_object(self, obj: Any, group: Group | None = None) -> list[Any]:
        group = self._group(group, "all_gather_object")
        if self._local(group):
            return [obj]
        return [pickle.loads(b) for b in self._gather_bytes(pickle.dumps(obj), group)]
