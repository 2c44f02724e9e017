"""torch half of the saved-tensor machinery (``hyper_parallel.platform.activations``).

Saved-tensor hooks are ``torch.autograd.graph.saved_tensors_hooks``; a stage forward packs into
the ``_SavedPool`` of ``autograd.py``. A swap unit is a whole storage (views of one storage are
copied once and rebuilt with their own offset, size and stride). On an accelerator the copies run
on a side stream into pinned host memory; the compute stream waits for them only when the data is
needed (an event); on the CPU they are synchronous copies.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from hyper_parallel.platform.activations.ops import CopyEngine, FrameworkOps
from hyper_parallel.platform.torch.autograd import _SavedPool


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``tensor`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class _HostCopies(CopyEngine):
    """Synchronous copies (CPU: "host" and device memory are the same RAM, the copy still happens)."""

    def launch_offload(self, units: list[Any]) -> Any:
        return [u.clone() for u in units]

    def finish_offload(self, pending: Any) -> list[Any]:
        return pending

    def launch_load(self, hosts: list[Any]) -> Any:
        return [h.clone() for h in hosts]

    def finish_load(self, pending: Any) -> list[Any]:
        return pending


class _StreamCopies(CopyEngine):
    """Copies on a side stream of the accelerator (``torch.cuda`` or ``torch.npu``)."""

    asynchronous = True

    def __init__(self, device_type: str) -> None:
        self.accel = getattr(torch, device_type)
        self.stream = self.accel.Stream()
        self.device = torch.device(device_type, self.accel.current_device())

    def _done(self) -> Any:
        event = self.accel.Event()
        event.record(self.stream)
        return event

    def launch_offload(self, units: list[Any]) -> Any:
        self.stream.wait_stream(self.accel.current_stream())
        hosts = []
        with self.accel.stream(self.stream):
            for unit in units:
                host = torch.empty(unit.shape, dtype=unit.dtype, pin_memory=True)
                host.copy_(unit, non_blocking=True)
                hosts.append(host)
        return hosts, self._done()

    def finish_offload(self, pending: Any) -> list[Any]:
        hosts, event = pending
        self.accel.current_stream().wait_event(event)  # the device units may be freed after this
        return hosts

    def launch_load(self, hosts: list[Any]) -> Any:
        self.stream.wait_stream(self.accel.current_stream())
        with self.accel.stream(self.stream):
            units = [h.to(self.device, non_blocking=True) for h in hosts]
        return units, self._done()

    def finish_load(self, pending: Any) -> list[Any]:
        units, event = pending
        current = self.accel.current_stream()
        current.wait_event(event)
        for unit in units:  # allocated on the side stream, used on the compute stream
            unit.record_stream(current)
        return units


class TorchSavedOps(FrameworkOps):
    name = "torch"

    def __init__(self, platform: Any) -> None:
        self.platform = platform

    def hooks(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> AbstractContextManager[Any]:
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def new_pool(self) -> Any:
        return _SavedPool()

    def pool_of(self, record: Any) -> Any:
        return getattr(record.native, "pool", None)

    def record_inputs(self, record: Any) -> list[Any]:
        return [t for t in getattr(record.native, "leaves", ()) if isinstance(t, torch.Tensor)]

    def grad_recording(self) -> bool:
        return bool(torch.is_grad_enabled())

    def recording(self) -> AbstractContextManager[Any]:
        return torch.enable_grad()

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def storage_key(self, tensor: Any) -> int:
        return int(tensor.untyped_storage().data_ptr())

    def storage_nbytes(self, tensor: Any) -> int:
        return int(tensor.untyped_storage().nbytes())

    def computed(self, tensor: Any) -> bool:
        base = tensor._base if tensor._base is not None else tensor  # a view of a parameter is not
        return base.grad_fn is not None and tensor.layout == torch.strided

    def detach(self, tensor: Any) -> Any:
        return tensor.detach()

    def requires_grad(self, tensor: Any) -> bool:
        return bool(tensor.requires_grad)

    def fresh(self, tensor: Any, requires_grad: bool) -> Any:
        out = tensor.detach()
        return out.requires_grad_(True) if requires_grad else out

    def is_float(self, tensor: Any) -> bool:
        return bool(tensor.is_floating_point())

    def unit_of(self, tensor: Any) -> tuple[Any, Any, Any]:
        meta = (tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        return self.storage_key(tensor), _bytes_of(tensor), meta

    def rebuild(self, unit: Any, meta: Any) -> Any:
        dtype, offset, size, stride = meta
        return torch.empty(0, dtype=dtype, device=unit.device).set_(unit.untyped_storage(), offset, size, stride)

    def unit_nbytes(self, unit: Any) -> int:
        return int(unit.numel())

    def copy_engine(self) -> CopyEngine:
        device_type = self.platform.device_type
        return _HostCopies() if device_type == "cpu" else _StreamCopies(device_type)

    def get_rng_state(self) -> Any:
        return self.platform.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        self.platform.set_rng_state(state)

    def forward_of(self, module: Any) -> Callable[..., Any]:
        return module.forward

    def set_forward(self, module: Any, fn: Callable[..., Any]) -> None:
        module.forward = fn

    def is_module(self, value: Any) -> bool:
        return isinstance(value, torch.nn.Module)

    def persistent_tensors(self, module: Any) -> list[Any]:
        return [*module.parameters(), *module.buffers()]

    def named_modules(self, module: Any) -> list[tuple[str, Any]]:
        return list(module.named_modules())

    def on_grad(self, tensor: Any, callback: Callable[[], None]) -> bool:
        if not tensor.requires_grad:
            return False

        def hook(grad: torch.Tensor) -> None:
            callback()

        tensor.register_hook(hook)
        return True
