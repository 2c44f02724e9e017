"""``torch.distributed`` as a :class:`Communicator` (gloo on CPU, NCCL on CUDA, HCCL on Ascend)."""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.platform.base import Communicator, Group, Handle, HandleGroup, P2POp, default_comm_timeout

_REDUCE = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


def backend_for_device(device_type: str) -> str:
    return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device_type]


class _SharedWork:
    """One request standing for several operations (a coalesced batch): waited once, however many
    handles share it (a second wait on a finished gloo request does not return)."""

    def __init__(self, work: Any) -> None:
        self._work = work
        self._waited = False
        self._lock = threading.Lock()

    def wait(self, *timeout: Any) -> bool:
        with self._lock:
            if not self._waited:
                self._work.wait(*timeout)
                self._waited = True
        return True

    def is_completed(self) -> bool:
        return self._waited or bool(self._work.is_completed())


class TorchHandle(Handle):
    """Wraps a ``torch.distributed.Work``; a failed wait names the operation and the peer.

    ``keep`` holds tensors the operation reads until it completes (e.g. a contiguous copy).
    With ``stream_wait`` (NCCL / HCCL), ``wait()`` without a timeout makes the current stream
    wait for the operation and returns at once, as torch does: the host keeps queueing work and
    the process group's own timeout (``HYPER_PARALLEL_COMM_TIMEOUT`` when hyper-parallel created
    it) bounds the operation. A wait with an explicit timeout blocks the host.
    """

    def __init__(self, work: Any, what: str | Callable[[], str], keep: Any = None, stream_wait: bool = False) -> None:
        self._work = work
        self._what_text = what  # a callable is formatted only if the operation fails (P2P: hundreds per step)
        self._keep = keep
        self._stream_wait = stream_wait
        self._done = False

    @property
    def _what(self) -> str:
        what = self._what_text
        return what() if callable(what) else what

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        if self._stream_wait and timeout is None:
            try:
                self._work.wait()
            except RuntimeError as exc:
                raise RuntimeError(f"{self._what} failed (did the peer rank die?): {exc}") from exc
            self._done = True
            return
        seconds = default_comm_timeout() if timeout is None else timeout
        try:
            self._work.wait(datetime.timedelta(seconds=seconds))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TimeoutError(f"{self._what} did not complete within {seconds:g}s: {exc}") from exc
            raise RuntimeError(f"{self._what} failed (did the peer rank die?): {exc}") from exc
        self._done = True
        self._keep = None

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())

    def settle_received(self) -> None:
        # gloo (host engine, one request per operation): the data left this process before the peer
        # could answer, so the wait, which would only report that, is skipped. A device engine waits
        # (the stream must be ordered after the send); one request for a batch covers its receives too.
        if self._stream_wait or self.coalesced:
            self.wait()
            return
        self._done = True
        self._keep = None


class _Averaged(Handle):
    """A summing all-reduce that divides by the group size once it completed."""

    def __init__(self, handle: TorchHandle, tensor: Any, size: int) -> None:
        self._handle, self._tensor, self._size = handle, tensor, size

    def wait(self, timeout: float | None = None) -> None:
        if self._tensor is not None:
            self._handle.wait(timeout)
            self._tensor.div_(self._size)
            self._tensor = None

    def is_completed(self) -> bool:
        return self._tensor is None


def _local(tensor: Any) -> Any:
    """The local piece of a torch DTensor (e.g. a fully sharded parameter), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_launcher_environment() -> None:
    """Raise a clear error when no launcher set the variables ``init_process_group`` reads."""
    missing = [name for name in LAUNCHER_VARIABLES if not os.environ.get(name)]
    if not missing:
        return
    raise RuntimeError(
        f"torch.distributed is not initialised and {', '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not set: this process was not started by a launcher. "
        "Start the script on N ranks with `torchrun --nproc-per-node=N script.py` (MindSpore: "
        "`msrun --worker_num=N --local_worker_num=N script.py`), call "
        "torch.distributed.init_process_group yourself first, or run the ranks inside this process "
        "with hyper_parallel.platform.local.LocalCluster(N).run(fn)"
    )


class TorchCommunicator(Communicator):
    """Initialises the default process group from the launcher's environment if needed."""

    def __init__(self, device_type: str = "cpu") -> None:
        if not dist.is_available():
            raise RuntimeError("this torch build has no torch.distributed")
        self._device_type = device_type
        if not dist.is_initialized():
            check_launcher_environment()
            dist.init_process_group(
                backend=backend_for_device(device_type),
                timeout=datetime.timedelta(seconds=default_comm_timeout()),
            )
        # native is the real ProcessGroup, so a Group drops into any torch.distributed call
        self._world = Group(tuple(range(dist.get_world_size())), native=dist.group.WORLD)
        self._gloo_like = dist.get_backend() == "gloo"
        self._meta_groups: dict[tuple[int, ...], Any] = {}  # ranks -> gloo group of the metadata channel
        # (id(process group), global peer) -> (process group, peer's rank in it), or None: not direct
        self._targets: dict[tuple[int, int], tuple[Any, int] | None] = {}

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def world_group(self) -> Group:
        return self._world

    def new_group(self, ranks: Sequence[int]) -> Group:
        ranks = tuple(sorted(int(r) for r in ranks))  # torch orders a group by global rank
        if ranks == self._world.ranks:
            return self._world
        return Group(ranks, native=dist.new_group(list(ranks)))

    def _pg(self, group: Group | None) -> Any:
        return None if group is None else group.native

    def _group(self, group: Group | None) -> Group:
        return self._world if group is None else group

    # P2P ----------------------------------------------------------------------------
    def _target(self, group: Group | None, peer: int, tensor: Any) -> tuple[Any, int] | None:
        """The process group and the peer's rank in it, for calling the process group directly:
        ``torch.distributed.isend`` / ``irecv`` resolve both and check the tensor on every call
        (about twenty Python calls per message, hundreds of messages per pipeline step). None
        (go through ``torch.distributed``) for a tensor subclass or a complex tensor."""
        if type(tensor) is not torch.Tensor or tensor.is_complex():
            return None
        pg = self._world.native if group is None else group.native
        key = (id(pg), peer)
        if key not in self._targets:
            direct = None
            if isinstance(pg, dist.ProcessGroup):  # not a group this rank is outside of
                direct = (pg, peer if pg is self._world.native else dist.get_group_rank(pg, peer))  # holds pg: its id stays its own
            self._targets[key] = direct
        return self._targets[key]

    def isend(self, tensor: Any, dst: int, group: Group | None = None, tag: int = 0) -> Handle:
        tensor = _local(tensor).contiguous()  # the engines send contiguous memory only
        target = self._target(group, dst, tensor)
        if target is not None:  # what torch.distributed.isend ends with, its checks done once
            work = target[0].send([tensor], target[1], tag)
        else:
            work = dist.isend(tensor, dst=dst, group=self._pg(group), tag=tag)
        me = self.rank  # now: when the operation fails, the process group may be gone
        return TorchHandle(work, lambda: f"send from rank {me} to rank {dst}", keep=tensor,
                           stream_wait=not self._gloo_like)

    def irecv(self, tensor: Any, src: int, group: Group | None = None, tag: int = 0) -> Handle:
        tensor = _local(tensor)  # a torch DTensor receives into its local piece
        if not tensor.is_contiguous():
            raise ValueError(f"rank {self.rank}: a receive buffer must be contiguous")
        target = self._target(group, src, tensor)
        if target is not None:
            work = target[0].recv([tensor], target[1], tag)
        else:
            work = dist.irecv(tensor, src=src, group=self._pg(group), tag=tag)
        me = self.rank  # now: when the operation fails, the process group may be gone
        return TorchHandle(work, lambda: f"receive on rank {me} from rank {src}",
                           stream_wait=not self._gloo_like)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]:
        if not ops:
            return []
        for op in ops:
            if op.op == "irecv" and not op.tensor.is_contiguous():
                raise ValueError(f"rank {self.rank}: a receive buffer must be contiguous")
        tensors = [op.tensor.contiguous() for op in ops]
        native = [
            dist.P2POp(dist.isend if op.op == "isend" else dist.irecv, t, op.peer, self._pg(op.group), op.tag)
            for op, t in zip(ops, tensors, strict=True)
        ]
        works = list(dist.batch_isend_irecv(native))
        coalesced = len(works) == 1 and len(ops) > 1  # NCCL-style: one request for the whole batch
        if coalesced:
            works = [_SharedWork(works[0])] * len(ops)
        elif len(works) != len(ops):
            raise RuntimeError(f"rank {self.rank}: batch_isend_irecv gave {len(works)} requests for {len(ops)} "
                               "operations")
        handles = []
        for w, op, t in zip(works, ops, tensors, strict=True):
            handle = TorchHandle(w, f"batched {op.op} between rank {self.rank} and rank {op.peer}", keep=t,
                                 stream_wait=not self._gloo_like)
            handle.coalesced = coalesced
            handles.append(handle)
        return handles

    # collectives --------------------------------------------------------------------
    def all_reduce(self, tensor: Any, op: str = "sum", group: Group | None = None) -> Any:
        if op == "avg":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._pg(group))
            tensor.div_(self._group(group).size)
        else:
            dist.all_reduce(tensor, op=_REDUCE[op], group=self._pg(group))
        return tensor

    def all_reduce_async(self, tensor: Any, op: str = "sum", group: Group | None = None) -> Handle:
        reduce_op = dist.ReduceOp.SUM if op == "avg" else _REDUCE[op]
        work = dist.all_reduce(tensor, op=reduce_op, group=self._pg(group), async_op=True)
        handle = TorchHandle(work, f"all-reduce on rank {self.rank} over ranks {list(self._group(group).ranks)}")
        return _Averaged(handle, tensor, self._group(group).size) if op == "avg" else handle

    def all_gather(self, tensor: Any, group: Group | None = None) -> list[Any]:
        out = [torch.empty_like(tensor) for _ in range(self._group(group).size)]
        dist.all_gather(out, tensor.contiguous(), group=self._pg(group))
        return out

    def reduce_scatter(self, tensors: Sequence[Any], op: str = "sum", group: Group | None = None) -> Any:
        g = self._group(group)
        if len(tensors) != g.size:
            raise ValueError(f"reduce_scatter needs one tensor per group rank ({g.size}), got {len(tensors)}")
        if self._gloo_like:  # gloo has no reduce_scatter: reduce everything, keep our piece
            flat = torch.stack([t.contiguous() for t in tensors])
            self.all_reduce(flat, op, group)
            return flat[g.group_rank(self.rank)].clone()
        out = torch.empty_like(tensors[0])
        reduce_op = dist.ReduceOp.AVG if op == "avg" else _REDUCE[op]
        dist.reduce_scatter(out, [t.contiguous() for t in tensors], op=reduce_op, group=self._pg(group))
        return out

    def broadcast(self, tensor: Any, src: int, group: Group | None = None) -> Any:
        dist.broadcast(tensor, src=src, group=self._pg(group))
        return tensor

    def all_to_all(self, tensors: Sequence[Any], group: Group | None = None) -> list[Any]:
        g = self._group(group)
        if len(tensors) != g.size:
            raise ValueError(f"all_to_all needs one tensor per group rank ({g.size}), got {len(tensors)}")
        if not self._gloo_like:
            out = [torch.empty_like(t) for t in tensors]
            dist.all_to_all(out, [t.contiguous() for t in tensors], group=self._pg(group))
            return out
        # gloo has no all_to_all for lists: pairwise exchange, shapes agreed through objects.
        shapes = self.all_gather_object([(tuple(t.shape), t.dtype) for t in tensors], group)
        me = g.group_rank(self.rank)
        out: list[Any] = [None] * g.size
        ops = []
        for i, peer in enumerate(g.ranks):
            if peer == self.rank:
                out[i] = tensors[i].clone()
                continue
            shape, dtype = shapes[i][me]
            out[i] = torch.empty(shape, dtype=dtype)
            ops.append(P2POp("isend", tensors[i].contiguous(), peer, group))
            ops.append(P2POp("irecv", out[i], peer, group))
        for h in self.batch_isend_irecv(ops):
            h.wait()
        return out

    def barrier(self, group: Group | None = None) -> None:
        dist.barrier(group=self._pg(group))

    # objects ------------------------------------------------------------------------
    # metadata channel -------------------------------------------------------------
    def open_meta_channel(self, ranks: Sequence[int]) -> None:
        """A gloo group over ``ranks`` (only they take part in creating it): small CPU messages whose
        sends never wait for their receive, apart from the data stream (NCCL, HCCL or gloo)."""
        ranks = tuple(sorted(int(r) for r in ranks))
        if ranks not in self._meta_groups and len(ranks) > 1:
            self._meta_groups[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)

    def _meta_group(self, peer: int) -> Any:
        for ranks, group in self._meta_groups.items():
            if peer in ranks and self.rank in ranks:
                return group
        raise RuntimeError(
            f"rank {self.rank}: no metadata channel to rank {peer}; open_meta_channel must be called first"
        )

    def isend_meta(self, values: Sequence[int], dst: int, tag: int = 0) -> Handle:
        group = self._meta_group(dst)
        size = torch.tensor([len(values)], dtype=torch.int64)
        payload = (size, torch.tensor(list(values), dtype=torch.int64))
        work = dist.isend(size, dst=dst, group=group, tag=tag)
        body = dist.isend(payload[1], dst=dst, group=group, tag=tag) if len(values) else None
        what = f"metadata send from rank {self.rank} to rank {dst}"
        return HandleGroup([TorchHandle(w, what, keep=payload) for w in (work, body) if w is not None])

    def recv_meta(self, src: int, timeout: float | None = None, tag: int = 0) -> list[int]:
        group = self._meta_group(src)
        size = torch.zeros(1, dtype=torch.int64)
        what = f"metadata receive on rank {self.rank} from rank {src}"
        TorchHandle(dist.irecv(size, src=src, group=group, tag=tag), what).wait(timeout)
        body = torch.zeros(int(size.item()), dtype=torch.int64)
        if body.numel():
            TorchHandle(dist.irecv(body, src=src, group=group, tag=tag), what).wait(timeout)
        return [int(v) for v in body.tolist()]

    def send_object(self, obj: Any, dst: int, group: Group | None = None) -> None:
        dist.send_object_list([obj], dst=dst, group=self._pg(group))

    def recv_object(self, src: int, group: Group | None = None) -> Any:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, group=self._pg(group))
        return box[0]

    def broadcast_object(self, obj: Any, src: int, group: Group | None = None) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._pg(group))
        return box[0]

    def all_gather_object(self, obj: Any, group: Group | None = None) -> list[Any]:
        out: list[Any] = [None] * self._group(group).size
        dist.all_gather_object(out, obj, group=self._pg(group))
        return out
