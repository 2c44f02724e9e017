"""MindSpore half of the saved-tensor machinery (``hyper_parallel.platform.activations``).

What PyNative offers, and what is used: ``ms.saved_tensors_hooks`` (pack/unpack of every tensor
the eager engine saves; the innermost hooks win; works with the private ``run_backward`` engine,
the dx/dW split included), ``Tensor.register_hook`` (fires before the producing node's backward),
``Cell.construct`` replaceable per instance. A stage forward is packed into a
:class:`~hyper_parallel.platform.activations.state.SavedPool` only while swap or memory tracking
is on (``SavedTensorSupport.capture``): ``saved_tensors_hooks`` turns off MindSpore's asynchronous
front-end pipeline while active. On the ``recompute`` autograd path the stage forward records no
graph, so there is nothing to swap or to recompute (both features are then no-ops).

A swap unit is one view (MindSpore has no way here to rebuild a view on a copied storage): views
of one storage are copied separately. Copies are synchronous on the CPU; on a device they run on a
side ``mindspore.runtime.Stream`` (written against the documented API, not verified on Ascend).
The re-run of a checkpointed module inside a backward sets the grad flags of the PyNative executor
(private ``_pynative_executor``), as MindSpore's own ``recompute`` does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import mindspore as ms
from mindspore import ops

from hyper_parallel.platform.activations.ops import CopyEngine, FrameworkOps
from hyper_parallel.platform.activations.state import SavedPool

_FLOATS = (ms.float16, ms.float32, ms.float64, ms.bfloat16)


def _executor() -> Any:
    from mindspore.graph.api import _pynative_executor

    return _pynative_executor


class _HostCopies(CopyEngine):
    def launch_offload(self, units: list[Any]) -> Any:
        return [ops.stop_gradient(u).to("CPU", copy=True) for u in units]

    def finish_offload(self, pending: Any) -> list[Any]:
        return pending

    def launch_load(self, hosts: list[Any]) -> Any:
        return [h.to("CPU", copy=True) for h in hosts]

    def finish_load(self, pending: Any) -> list[Any]:
        return pending


class _StreamCopies(CopyEngine):
    asynchronous = True

    def __init__(self, target: str) -> None:
        self.target = target
        self.stream = ms.runtime.Stream()

    def _run(self, values: list[Any], where: str) -> Any:
        self.stream.wait_stream(ms.runtime.current_stream())
        with ms.runtime.StreamCtx(self.stream):
            out = [ops.stop_gradient(v).to(where, non_blocking=True, copy=True) for v in values]
        return out, self.stream.record_event()

    def _finish(self, pending: Any) -> list[Any]:
        values, event = pending
        ms.runtime.current_stream().wait_event(event)
        return values

    def launch_offload(self, units: list[Any]) -> Any:
        return self._run(units, "CPU")

    def finish_offload(self, pending: Any) -> list[Any]:
        return self._finish(pending)

    def launch_load(self, hosts: list[Any]) -> Any:
        return self._run(hosts, self.target)

    def finish_load(self, pending: Any) -> list[Any]:
        return self._finish(pending)


class MindSporeSavedOps(FrameworkOps):
    name = "mindspore"

    def __init__(self, platform: Any) -> None:
        self.platform = platform

    def hooks(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> AbstractContextManager[Any]:
        return ms.saved_tensors_hooks(pack, unpack)

    def new_pool(self) -> Any:
        return SavedPool()

    def pool_of(self, record: Any) -> Any:
        extra = getattr(record.native, "extra", None)
        return extra.get("saved_pool") if isinstance(extra, dict) else None

    def record_inputs(self, record: Any) -> list[Any]:
        return [t for t in getattr(record.native, "args", ()) if isinstance(t, ms.Tensor)]

    def grad_recording(self) -> bool:
        executor = _executor()
        return bool(executor.grad_flag()) and bool(executor.enable_grad())

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        executor = _executor()
        flag, enabled = executor.grad_flag(), executor.enable_grad()
        executor.set_grad_flag(True)
        executor.set_enable_grad(True)
        try:
            yield
        finally:
            executor.set_grad_flag(flag)
            executor.set_enable_grad(enabled)

    def is_tensor(self, value: Any) -> bool:
        return isinstance(value, ms.Tensor)

    def storage_key(self, tensor: Any) -> int:
        return int(tensor.untyped_storage().data_ptr())

    def storage_nbytes(self, tensor: Any) -> int:
        return int(tensor.untyped_storage().nbytes())

    def computed(self, tensor: Any) -> bool:
        node = tensor._grad_node
        return node is not None and not node.is_leaf()

    def detach(self, tensor: Any) -> Any:
        return ops.stop_gradient(tensor)

    def requires_grad(self, tensor: Any) -> bool:
        return bool(tensor._requires_grad)

    def fresh(self, tensor: Any, requires_grad: bool) -> Any:
        out = ops.stop_gradient(tensor)
        if requires_grad:
            out.requires_grad_()
        return out

    def is_float(self, tensor: Any) -> bool:
        return tensor.dtype in _FLOATS

    def unit_of(self, tensor: Any) -> tuple[Any, Any, Any]:
        key = (self.storage_key(tensor), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
               str(tensor.dtype))
        return key, tensor, None

    def rebuild(self, unit: Any, meta: Any) -> Any:
        return unit

    def unit_nbytes(self, unit: Any) -> int:
        return int(unit.nbytes)

    def copy_engine(self) -> CopyEngine:
        if self.platform.device_type == "cpu":
            return _HostCopies()
        return _StreamCopies(str(ms.get_context("device_target")))

    def get_rng_state(self) -> Any:
        return self.platform.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        self.platform.set_rng_state(state)

    def forward_of(self, module: Any) -> Callable[..., Any]:
        return module.construct

    def set_forward(self, module: Any, fn: Callable[..., Any]) -> None:
        module.construct = fn

    def is_module(self, value: Any) -> bool:
        return isinstance(value, ms.nn.Cell)

    def persistent_tensors(self, module: Any) -> list[Any]:
        return list(module.get_parameters())

    def named_modules(self, module: Any) -> list[tuple[str, Any]]:
        return list(module.cells_and_names())

    def on_grad(self, tensor: Any, callback: Callable[[], None]) -> bool:
        if not tensor._requires_grad:
            return False

        def hook(grad: Any) -> None:
            callback()

        tensor.register_hook(hook)
        return True
