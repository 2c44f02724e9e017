"""PyTorch backend: CPU, CUDA, and Ascend through ``torch_npu`` when it is importable."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from hyper_parallel.platform.base import Communicator, ForwardRecord, Group, HostEvent, HostStream, Platform
from hyper_parallel.platform.torch import dtensor as torch_dtensor
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
        # DTensor redistribution through torch.distributed.tensor (real jobs only); False: our own collectives
        self.use_torch_dtensor = True
        self._saved: Any = None

    def _default_communicator(self) -> Communicator:
        from hyper_parallel.platform.torch.comm import TorchCommunicator

        return TorchCommunicator(self._device_type)

    # ------------------------------------------------------------------ distributed tensors
    def custom_function(self, forward: Callable[[Any], Any], backward: Callable[[Any], Any], tensor: Any) -> Any:
        return torch_dtensor.custom_function(forward, backward, tensor)

    def sync_point(self, tensor: Any, on_forward: Callable[[], None], on_backward: Callable[[], None]) -> Any:
        from hyper_parallel.platform.torch.sync_point import sync_point

        return sync_point(tensor, on_forward, on_backward)

    def _thread_state(self) -> Any:
        return torch.is_grad_enabled()

    def _enter_thread_state(self, state: Any) -> None:
        torch.set_grad_enabled(bool(state))

    def group_from_native(self, native: Any) -> Group:
        return torch_dtensor.group_from_native(native)

    def native_process_group(self, group: Group) -> Any:
        return torch_dtensor.native_process_group(group)

    def native_device_mesh(self, device_type: str, nested: Any, groups: Sequence[Group], names: Sequence[str]) -> Any:
        return torch_dtensor.native_device_mesh(device_type, nested, groups, names)

    def mesh_from_native(self, native: Any) -> tuple[str, list[Any], tuple[str, ...], list[Group]]:
        return torch_dtensor.mesh_from_native(native)

    def native_dtensor_available(self) -> bool:
        from hyper_parallel.platform.torch.comm import TorchCommunicator

        return self.use_torch_dtensor and isinstance(self.comm, TorchCommunicator)

    def native_redistribute(self, local: Any, mesh: Any, src: Sequence[tuple[Any, ...]],
                            dst: Sequence[tuple[Any, ...]], shape: Sequence[int]) -> Any:
        return torch_dtensor.native_redistribute(local, mesh, src, dst, shape)

    def native_dtensor(self, local: Any, mesh: Any, placements: Sequence[tuple[Any, ...]],
                       shape: Sequence[int]) -> Any:
        return torch_dtensor.native_dtensor(local, mesh, placements, shape)

    def dtensor_from_native(self, native: Any) -> tuple[Any, Any, tuple[tuple[Any, ...], ...], tuple[int, ...]]:
        return torch_dtensor.dtensor_from_native(native)

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

    def zeros(self, shape: Sequence[int], dtype: str = "float32", device: Any = None) -> Any:
        return torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=self.device if device is None else device)

    def ones(self, shape: Sequence[int], dtype: str = "float32", device: Any = None) -> Any:
        return torch.ones(tuple(shape), dtype=torch_dtype(dtype), device=self.device if device is None else device)

    def empty(self, shape: Sequence[int], dtype: str = "float32", device: Any = None) -> Any:
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=self.device if device is None else device)

    def check_device(self, device: Any) -> Any:
        if device is None:
            return None
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"not a torch device: {device!r} ({exc})") from None
        if device.type not in ("cpu", "meta"):
            module = getattr(torch, device.type, None)
            available = getattr(module, "is_available", None)
            if available is None or not available():
                raise ValueError(f"device {device} is not available on this machine")
            if device.index is None:
                device = torch.device(device.type, module.current_device())
        return device

    def to_stage_device(self, tensor: Any, device: Any) -> Any:
        if device is None or not isinstance(tensor, torch.Tensor) or tensor.device == device:
            return tensor
        return tensor.to(device)

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
        saved_pool: bool = True,
    ) -> ForwardRecord:
        if self._saved is not None:  # swap, recompute or memory accounting in use: they read the pool
            record = stage_forward(fn, args, kwargs, params, grad_args)
            self._saved.after_forward(record)
            return record
        return stage_forward(fn, args, kwargs, params, grad_args, saved_pool)

    def stage_forward_no_grad(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        with torch.no_grad():
            return fn(*args, **kwargs)

    def grad_enabled(self) -> bool:
        return bool(torch.is_grad_enabled())

    def stage_backward(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        return stage_backward(record, grads)

    def stage_backward_input(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        return stage_backward_input(record, grads)

    def stage_backward_weight(self, record: ForwardRecord) -> None:
        stage_backward_weight(record)

    # ------------------------------------------------------------------ parameters and gradients
    def is_identity_module(self, module: Any) -> bool:
        return type(module) is torch.nn.Identity  # a subclass may override forward: it runs

    def named_parameters(self, module: Any) -> list[tuple[str, Any]]:
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def get_grad(self, param: Any) -> Any | None:
        return param.grad

    def set_grad(self, param: Any, grad: Any | None) -> None:
        if grad is not None and grad.shape != param.shape and type(param) is torch.nn.Parameter:
            # A parameter sharded by hyper_parallel's own FSDP whose whole value is gathered right now (a failed
            # run puts its sharded gradient back before the shards are): torch checks a gradient against the
            # data's shape, so attach it while the parameter briefly holds data of the gradient's shape.
            whole = param.data
            param.data = torch.empty(grad.shape, dtype=param.dtype, device=param.device)
            try:
                param.grad = grad
            finally:
                param.data = whole
            return
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

    # ------------------------------------------------------------------ saved activations
    def saved_tensors(self) -> Any:
        if self._saved is None:
            from hyper_parallel.platform.activations import SavedTensorSupport
            from hyper_parallel.platform.torch.activations import TorchSavedOps

            self._saved = SavedTensorSupport(TorchSavedOps(self))
        return self._saved

    # ------------------------------------------------------------------ data parallelism, sharding, checkpoints
    def reshape(self, tensor: Any, shape: Sequence[int]) -> Any:
        return tensor.reshape(tuple(shape))

    def split(self, tensor: Any, sizes: Sequence[int], dim: int = 0) -> list[Any]:
        return list(torch.split(tensor, list(sizes), dim=dim))

    def set_param_storage(self, param: Any, value: Any) -> None:
        param.data = value

    def register_forward_pre_hook(self, module: Any, hook: Callable[[], None]) -> Any:
        return module.register_forward_pre_hook(lambda _module, _args: hook())

    def local_tensor(self, tensor: Any) -> Any:
        from torch.distributed.tensor import DTensor

        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def native_shard_count(self, tensor: Any) -> int:
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(tensor, DTensor):
            return 1
        count = 1
        for size, placement in zip(tensor.device_mesh.shape, tensor.placements, strict=True):
            if isinstance(placement, Shard):
                count *= size
        return count

    def norm_pow_sum(self, tensors: Sequence[Any], norm_type: float) -> float:
        from hyper_parallel.platform.base import combine_norm_pows

        values = []
        with torch.no_grad():
            for t in tensors:
                local = self.local_tensor(t).detach()
                if local.numel() == 0:
                    continue
                if norm_type == float("inf"):
                    values.append(float(local.abs().max()))
                else:
                    values.append(float(local.to(torch.float64).abs().pow(norm_type).sum()))
        return combine_norm_pows(values, norm_type)

    def native_fsdp(self) -> Any | None:
        from hyper_parallel.platform.torch.comm import TorchCommunicator

        if not isinstance(self.comm, TorchCommunicator):
            return None  # a LocalCluster has no process groups for torch's FSDP
        from hyper_parallel.platform.torch import fsdp

        reason = fsdp.available()
        if reason is not None:
            raise RuntimeError(f"the pipeline cannot drive torch's FSDP here: {reason}")
        return fsdp.TorchFSDP()

    def checkpointed_tensors(self, module: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        buffers = []
        for prefix, sub in module.named_modules():
            for name, buf in sub.named_buffers(recurse=False):
                if name not in sub._non_persistent_buffers_set:
                    buffers.append((f"{prefix}.{name}" if prefix else name, buf))
        return list(module.named_parameters()), buffers

    def checkpoint_layout(self) -> str:
        from hyper_parallel.platform.torch import checkpoint

        return checkpoint.layout(self)

    def save_checkpoint(self, path: str, params: Mapping[str, Any], optimizers: Sequence[Any], extra: Any,
                        buffers: Mapping[str, Any] | None = None) -> None:
        from hyper_parallel.platform.torch import checkpoint

        checkpoint.save(self, path, params, optimizers, extra, buffers or {})

    def load_checkpoint(self, path: str, params: Mapping[str, Any], optimizers: Sequence[Any],
                        buffers: Mapping[str, Any] | None = None, strict: bool = True) -> Any:
        from hyper_parallel.platform.torch import checkpoint

        return checkpoint.load(self, path, params, optimizers, buffers or {}, strict)

    # ------------------------------------------------------------------ random state
    def get_rng_state(self) -> tuple[Any, Any]:
        """The CPU default generator's state, and the accelerator's generators once it is initialised."""
        accel = self._accel()
        device_states = None
        if accel is not None and getattr(accel, "is_initialized", lambda: False)():
            device_states = accel.get_rng_state_all()
        return torch.get_rng_state(), device_states

    def set_rng_state(self, state: tuple[Any, Any]) -> None:
        cpu_state, device_states = state
        torch.set_rng_state(cpu_state)
        accel = self._accel()
        if device_states is not None and accel is not None:
            accel.set_rng_state_all(device_states)

    def draw_rng_seed(self) -> int:
        return int(torch.randint(0, 2**31, (), dtype=torch.int64))  # the CPU default generator

    def seed_rng(self, seed: int) -> None:
        torch.manual_seed(seed)  # the CPU generator and every accelerator's

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
