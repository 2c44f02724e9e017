"""MindSporePlatform: the MindSpore (PyNative) half of :class:`~hyper_parallel.platform.base.Platform`.

Where gradients live: in the eager engine's per-parameter slot ``param._grad`` (MindSpore 2.10
has no public ``Parameter.grad``). Both autograd paths accumulate there; ``get_grad`` reads it and
``set_grad(p, None)`` clears it. An optimizer consumes them as a tuple::

    params = [p for _, p in platform.named_parameters(cell)]
    nn.SGD(params, learning_rate=0.1)(tuple(platform.get_grad(p) for p in params))
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import ops

from hyper_parallel.platform.base import Communicator, ForwardRecord, HostEvent, HostStream, Platform
from hyper_parallel.platform.mindspore.autograd import StageAutograd, create_autograd
from hyper_parallel.platform.mindspore.dtypes import _FLOATING, _NAMES, dtype_name_of, ms_dtype

_DEVICE_TYPES = {"CPU": "cpu", "Ascend": "npu", "GPU": "cuda"}


def _device_target() -> str:
    return str(ms.get_context("device_target"))


def ensure_device() -> None:
    """Select the CPU only when no device was chosen and this MindSpore build defaults to the CPU."""
    try:
        from mindspore._c_expression import DeviceManagerConf

        if DeviceManagerConf.get_instance().is_device_enable():
            return
    except (ImportError, AttributeError):
        return
    if _device_target() == "CPU":
        with contextlib.suppress(RuntimeError):  # the runtime already started: leave it alone
            ms.set_device("CPU")


class MindSporePlatform(Platform):
    """MindSpore in PyNative mode; ``autograd_mode`` tells which stage-autograd path runs."""

    name = "mindspore"

    def __init__(self, comm: Communicator | None = None, autograd: str | None = None) -> None:
        """``autograd``: ``"auto"`` | ``"engine"`` | ``"recompute"`` (default ``HYPER_PARALLEL_MS_AUTOGRAD``)."""
        super().__init__(comm)
        ensure_device()
        self._autograd_request = autograd
        self._autograd_backend: StageAutograd | None = None
        self._lock = threading.Lock()

    @property
    def _autograd(self) -> StageAutograd:
        # created on first use: no tensor exists before communication.init() on Ascend
        if self._autograd_backend is None:
            with self._lock:
                if self._autograd_backend is None:
                    self._autograd_backend = create_autograd(self._autograd_request)
        return self._autograd_backend

    @property
    def autograd_mode(self) -> str:
        """``"engine"`` (eager engine, private API) or ``"recompute"`` (public fallback)."""
        return self._autograd.mode

    def _default_communicator(self) -> Communicator:
        from hyper_parallel.platform.mindspore.comm import MindSporeCommunicator

        return MindSporeCommunicator()

    # ------------------------------------------------------------------ tensors
    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, ms.Tensor)

    def tensor(self, data: Any, dtype: str | None = None) -> Any:
        if isinstance(data, ms.Tensor):
            return data.astype(ms_dtype(dtype)) if dtype else self.clone(data)
        array = np.array(data)
        if dtype is None and array.dtype == np.float64 and not isinstance(data, np.ndarray):
            dtype = "float32"  # Python floats default to float32, as in torch
        return self.from_numpy(array, dtype)

    def zeros(self, shape: Sequence[int], dtype: str = "float32") -> Any:
        return ops.zeros(tuple(shape), ms_dtype(dtype))

    def ones(self, shape: Sequence[int], dtype: str = "float32") -> Any:
        return ops.ones(tuple(shape), ms_dtype(dtype))

    def empty(self, shape: Sequence[int], dtype: str = "float32") -> Any:
        return ms.mint.empty(tuple(shape), dtype=ms_dtype(dtype))

    def shape(self, tensor: Any) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def dtype_name(self, tensor: Any) -> str:
        return dtype_name_of(tensor.dtype)

    def is_floating(self, tensor: Any) -> bool:
        return _NAMES.get(tensor.dtype) in _FLOATING

    def cat(self, tensors: Sequence[Any], dim: int = 0) -> Any:
        return ops.cat(tuple(tensors), axis=dim)

    def chunk(self, tensor: Any, chunks: int, dim: int = 0) -> list[Any]:
        size = tensor.shape[dim]
        if chunks <= 0 or size % chunks:
            raise ValueError(f"cannot split size {size} of dim {dim} into {chunks} equal chunks")
        return list(ops.split(tensor, size // chunks, axis=dim))

    def to_numpy(self, tensor: Any) -> Any:
        if tensor.dtype == ms.bfloat16:
            tensor = tensor.astype(ms.float32)
        return tensor.asnumpy()

    def from_numpy(self, array: Any, dtype: str | None = None) -> Any:
        """Shares memory with ``array`` where the dtype allows (``ms.from_numpy``)."""
        array = np.ascontiguousarray(array)
        if dtype == "bfloat16":
            return ms.Tensor(array.astype(np.float32)).astype(ms.bfloat16)
        if dtype is not None:
            ms_dtype(dtype)  # validates the name
            array = array.astype(np.dtype(dtype), copy=False)
        return ms.from_numpy(array)

    def detach(self, tensor: Any) -> Any:
        return ops.stop_gradient(tensor)

    def clone(self, tensor: Any) -> Any:
        return ops.stop_gradient(tensor).copy()

    def copy_(self, dst: Any, src: Any) -> Any:
        dst.copy_(src)
        return dst

    def storage_nbytes(self, tensor: Any) -> int:
        """Bytes of the tensor's storage (a view reports its whole base storage)."""
        try:
            return int(tensor.untyped_storage().nbytes())
        except (AttributeError, RuntimeError, TypeError):
            return int(tensor.nbytes)

    def release_storage(self, tensor: Any) -> None:
        """A no-op on MindSpore 2.10: nothing keeps a tensor's autograd node safely without its data.

        ``tensor.untyped_storage().resize_(0)`` does free the memory, but the storage is shared with
        the tensors the autograd nodes saved (e.g. the output of ``tanh``), and the later backward
        then reads freed memory (measured: a segmentation fault). So the data is kept and
        :meth:`storage_nbytes` keeps reporting it.
        """
        return None

    # ------------------------------------------------------------------ stage autograd
    def stage_forward(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        params: Sequence[Any],
        grad_args: Sequence[bool],
    ) -> ForwardRecord:
        return self._autograd.forward(fn, args, kwargs, params, grad_args)

    def stage_backward(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        return self._autograd.backward(record, grads)

    def stage_backward_input(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        return self._autograd.backward_input(record, grads)

    def stage_backward_weight(self, record: ForwardRecord) -> None:
        self._autograd.backward_weight(record)

    # ------------------------------------------------------------------ parameters and gradients
    def named_parameters(self, module: Any) -> list[tuple[str, Any]]:
        """Trainable parameters of a Cell, named by their ``Parameter.name``."""
        return [(p.name, p) for p in module.trainable_params()]

    def get_grad(self, param: Any) -> Any | None:
        """The accumulated gradient (``param._grad``, see the module docstring) or ``None``."""
        return getattr(param, "_grad", None)

    def set_grad(self, param: Any, grad: Any | None) -> None:
        if grad is not None and not isinstance(grad, ms.Tensor):
            raise TypeError(f"a gradient must be a MindSpore Tensor or None, got {type(grad).__name__}")
        param._grad = grad

    def scale_grads(self, params: Sequence[Any], factor: float) -> None:
        """Replaces each gradient by a scaled one: a gradient tensor may be shared (with the
        output gradient it came from, or with another parameter's), so it is never written in place."""
        for p in params:
            grad = getattr(p, "_grad", None)
            if grad is not None:
                p._grad = (grad * factor).astype(grad.dtype)

    def param_data(self, param: Any) -> Any:
        return ops.stop_gradient(param)

    def assign_param(self, param: Any, value: Any) -> None:
        if not isinstance(value, ms.Tensor):
            value = ms.Tensor(np.asarray(value))
        if value.dtype != param.dtype:
            value = value.astype(param.dtype)
        ops.assign(param, value)

    # ------------------------------------------------------------------ device, streams, events
    @property
    def device_type(self) -> str:
        target = _device_target()
        return _DEVICE_TYPES.get(target, target.lower())

    def synchronize(self) -> None:
        ms.runtime.synchronize()

    def new_stream(self) -> Any:
        """A ``mindspore.runtime.Stream`` on a device; a :class:`HostStream` stand-in on the CPU."""
        if self.device_type == "cpu":
            return HostStream(ms.runtime.synchronize)
        return ms.runtime.Stream()

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        if stream is None or isinstance(stream, HostStream):
            return _null_stream(stream)
        return ms.runtime.StreamCtx(stream)

    def new_event(self) -> Any:
        """A ``mindspore.runtime.Event`` on a device; a :class:`HostEvent` stand-in on the CPU."""
        if self.device_type == "cpu":
            return HostEvent(ms.runtime.synchronize)
        return ms.runtime.Event()

    # ------------------------------------------------------------------ host offload
    def to_host(self, tensor: Any, non_blocking: bool = False) -> Any:
        """A host copy (a copy on the CPU too); pinned where the build supports it (unverified on Ascend)."""
        host = ops.stop_gradient(tensor).to("CPU", non_blocking=non_blocking, copy=True)
        if self.device_type != "cpu":
            with contextlib.suppress(AttributeError, RuntimeError, TypeError):
                host = host.pin_memory()
        return host

    def to_device(self, tensor: Any, non_blocking: bool = False) -> Any:
        return ops.stop_gradient(tensor).to(_device_target(), non_blocking=non_blocking, copy=True)


@contextlib.contextmanager
def _null_stream(stream: Any) -> Iterator[Any]:
    yield stream
