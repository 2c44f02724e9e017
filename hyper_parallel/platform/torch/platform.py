"""PyTorch backend: CPU, CUDA, and Ascend through ``torch_npu`` when it is importable."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from hyper_parallel.platform.base import Communicator, ForwardRecord, HostEvent, HostStream, Platform
from hyper_parallel.platform.torch.autograd import (
    releasable,
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
    stage_forward,
)

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; known: {', '.join(_DTYPES)}") from None


def _detect_device_type() -> str:
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers the "npu" device)

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


class TorchPlatform(Platform):
    """``Platform`` over PyTorch; gradients live in ``param.grad`` as usual."""

    name = "torch"

    def __init__(self, comm: Communicator | None = None, device_type: str | None = None) -> None:
        super().__init__(comm)
        self._device_type = device_type or _detect_device_type()

    def _default_communicator(self) -> Communicator:
        from hyper_parallel.platform.torch.comm import TorchCommunicator

        return TorchCommunicator(self._device_type)

    # ------------------------------------------------------------------ tensors
    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor)

    @property
    def device(self) -> torch.device:
        if self._device_type == "cpu":
            return torch.device("cpu")
        module = getattr(torch, self._device_type)
        return torch.device(self._device_type, module.current_device())

    def tensor(self, data: Any, dtype: str | None = None) -> Any:
        return torch.tensor(data, dtype=None if dtype is None else torch_dtype(dtype), device=self.device)

    def zeros(self, shape: Sequence[int], dtype: str = "float32") -> Any:
        return torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=self.device)

    def ones(self, shape: Sequence[int], dtype: str = "float32") -> Any:
        return torch.ones(tuple(shape), dtype=torch_dtype(dtype), device=self.device)

    def empty(self, shape: Sequence[int], dtype: str = "float32") -> Any:
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=self.device)

    def zeros_like(self, tensor: Any) -> Any:
        return torch.zeros_like(tensor)

    def ones_like(self, tensor: Any) -> Any:
        return torch.ones_like(tensor)

    def empty_like(self, tensor: Any) -> Any:
        return torch.empty_like(tensor)

    def shape(self, tensor: Any) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def dtype_name(self, tensor: Any) -> str:
        return _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype).replace("torch.", ""))

    def is_floating(self, tensor: Any) -> bool:
        return bool(tensor.is_floating_point() or tensor.is_complex())

    def requires_grad(self, tensor: Any) -> bool:
        return bool(tensor.requires_grad)

    def cat(self, tensors: Sequence[Any], dim: int = 0) -> Any:
        return torch.cat(list(tensors), dim=dim)

    def chunk(self, tensor: Any, chunks: int, dim: int = 0) -> list[Any]:
        size = tensor.shape[dim]
        if size % chunks:
            raise ValueError(f"cannot split size {size} of dim {dim} into {chunks} equal chunks")
        return list(torch.split(tensor, size // chunks, dim=dim))

    def to_numpy(self, tensor: Any) -> Any:
        t = tensor.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.cpu().numpy()

    def from_numpy(self, array: Any, dtype: str | None = None) -> Any:
        t = torch.from_numpy(np.ascontiguousarray(array))
        if dtype is not None:
            t = t.to(torch_dtype(dtype))
        return t.to(self.device)

    def detach(self, tensor: Any) -> Any:
        return tensor.detach()

    def clone(self, tensor: Any) -> Any:
        return tensor.detach().clone()

    def copy_(self, dst: Any, src: Any) -> Any:
        with torch.no_grad():
            dst.copy_(src)
        return dst

    def storage_nbytes(self, tensor: Any) -> int:
        return int(tensor.untyped_storage().nbytes())

    def releasable(self, record: ForwardRecord, tensor: Any) -> bool:
        return releasable(record, tensor)

    def release_storage(self, tensor: Any) -> None:
        # Swap the data for an empty tensor; the autograd node (grad_fn) is untouched. Only
        # called on outputs that ``releasable`` accepted (not saved by their own graph).
        tensor.data = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)

    # ------------------------------------------------------------------ stage autograd
    def stage_forward(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        params: Sequence[Any],
        grad_args: Sequence[bool],
    ) -> ForwardRecord:
        return stage_forward(fn, args, kwargs, params, grad_args)

    def stage_backward(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        return stage_backward(record, grads)

    def stage_backward_input(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        return stage_backward_input(record, grads)

    def stage_backward_weight(self, record: ForwardRecord) -> None:
        stage_backward_weight(record)

    # ------------------------------------------------------------------ parameters and gradients
    def named_parameters(self, module: Any) -> list[tuple[str, Any]]:
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def get_grad(self, param: Any) -> Any | None:
        return param.grad

    def set_grad(self, param: Any, grad: Any | None) -> None:
        param.grad = grad

    def scale_grads(self, params: Sequence[Any], factor: float) -> None:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def param_data(self, param: Any) -> Any:
        return param.detach()

    def assign_param(self, param: Any, value: Any) -> None:
        with torch.no_grad():
            param.copy_(value)

    # ------------------------------------------------------------------ device, streams, events
    @property
    def device_type(self) -> str:
        return self._device_type

    def _accel(self) -> Any | None:
        return None if self._device_type == "cpu" else getattr(torch, self._device_type)

    def synchronize(self) -> None:
        accel = self._accel()
        if accel is not None:
            accel.synchronize()

    def new_stream(self) -> Any:
        accel = self._accel()
        return HostStream() if accel is None else accel.Stream()

    def stream_context(self, stream: Any) -> AbstractContextManager[Any]:
        accel = self._accel()
        if accel is None or isinstance(stream, HostStream):
            return contextlib.nullcontext(stream)
        return accel.stream(stream)

    def new_event(self) -> Any:
        accel = self._accel()
        return HostEvent() if accel is None else accel.Event()

    # ------------------------------------------------------------------ host offload
    def to_host(self, tensor: Any, non_blocking: bool = False) -> Any:
        if tensor.device.type == "cpu":
            return tensor.detach().clone()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor.detach(), non_blocking=non_blocking)
        return host

    def to_device(self, tensor: Any, non_blocking: bool = False) -> Any:
        if self._device_type == "cpu":
            return tensor.detach().clone()
        return tensor.to(self.device, non_blocking=non_blocking)
