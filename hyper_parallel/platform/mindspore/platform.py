"""MindSporePlatform: the MindSpore half of :class:`~hyper_parallel.platform.base.Platform`.

Stage steps run in PyNative whatever the user's mode, with the stage's Cell compiled by
``ms.jit`` under ``GRAPH_MODE`` (or always, with ``HYPER_PARALLEL_MS_COMPILE=jit``); see
``compiled.py`` and ``docs/mindspore.md``.

Where gradients live: in the eager engine's per-parameter slot ``param._grad`` (MindSpore 2.10
has no public ``Parameter.grad``). Both autograd paths accumulate there; ``get_grad`` reads it and
``set_grad(p, None)`` clears it. An optimizer consumes them as a tuple::

    params = [p for _, p in platform.named_parameters(cell)]
    nn.SGD(params, learning_rate=0.1)(tuple(platform.get_grad(p) for p in params))
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import ops

from hyper_parallel.platform.base import Communicator, ForwardRecord, HostEvent, HostStream, Platform
from hyper_parallel.platform.mindspore.compiled import StageRunner
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
    """MindSpore in PyNative or GRAPH_MODE; ``autograd_mode`` tells which stage-autograd path runs,
    ``compile_mode`` when stages run as compiled graphs."""

    name = "mindspore"

    def __init__(self, comm: Communicator | None = None, autograd: str | None = None,
                 compile: str | None = None) -> None:  # noqa: A002
        """``autograd``: ``"auto"`` | ``"engine"`` | ``"recompute"`` (default ``HYPER_PARALLEL_MS_AUTOGRAD``);
        ``compile``: ``"auto"`` | ``"jit"`` | ``"eager"`` (default ``HYPER_PARALLEL_MS_COMPILE``), see
        ``hyper_parallel.platform.mindspore.compiled`` and ``docs/mindspore.md``."""
        super().__init__(comm)
        ensure_device()
        self._autograd = StageRunner(autograd, compile)
        self._saved: Any = None

    @property
    def autograd_mode(self) -> str:
        """``"engine"`` (eager engine, private API) or ``"recompute"`` (public fallback)."""
        return self._autograd.mode

    @property
    def compile_mode(self) -> str:
        """``"auto"`` (compile stages in GRAPH_MODE), ``"jit"`` (always) or ``"eager"`` (never)."""
        return self._autograd.compile_mode

    def compiled_stages(self, module: Any = None) -> str | None:
        from hyper_parallel.platform.mindspore.compiled import COMPILE_ENV, user_mode

        mode = user_mode()
        if self._autograd.compiles(mode):
            return (f"the MindSpore platform compiles every stage with ms.jit ({COMPILE_ENV}={self.compile_mode}, "
                    f"context {'GRAPH_MODE' if mode == ms.GRAPH_MODE else 'PYNATIVE_MODE'})")
        if module is not None and "" in self.user_compiled_modules(module):
            return f"{type(module).__name__} has a construct compiled with @ms.jit"
        return None

    def user_compiled_modules(self, module: Any) -> list[str]:
        if not isinstance(module, ms.nn.Cell):
            return []
        return [name for name, cell in module.cells_and_names() if _jit_construct(cell)]

    def _default_communicator(self) -> Communicator:
        from hyper_parallel.platform.mindspore.comm import MindSporeCommunicator

        return MindSporeCommunicator()

    # ------------------------------------------------------------------ distributed tensors
    def custom_function(self, forward: Callable[[Any], Any], backward: Callable[[Any], Any], tensor: Any) -> Any:
        from hyper_parallel.platform.mindspore.dtensor import custom_function

        return custom_function(forward, backward, tensor)

    def sync_point(self, tensor: Any, on_forward: Callable[[], None], on_backward: Callable[[], None]) -> Any:
        from hyper_parallel.platform.mindspore.sync_point import sync_point

        return sync_point(tensor, on_forward, on_backward)

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

    def zeros(self, shape: Sequence[int], dtype: str = "float32", device: Any = None) -> Any:
        return ops.zeros(tuple(shape), ms_dtype(dtype))

    def ones(self, shape: Sequence[int], dtype: str = "float32", device: Any = None) -> Any:
        return ops.ones(tuple(shape), ms_dtype(dtype))

    def empty(self, shape: Sequence[int], dtype: str = "float32", device: Any = None) -> Any:
        return ms.mint.empty(tuple(shape), dtype=ms_dtype(dtype))

    def check_device(self, device: Any) -> Any:
        """MindSpore places tensors on the device of its context: ``device`` may only name that one."""
        if device is None:
            return None
        target = _device_target()
        names = {target.lower(), _DEVICE_TYPES.get(target, target.lower())}
        if str(device).split(":")[0].lower() not in names:
            raise ValueError(
                f"MindSpore places tensors on the context's device ({target}); cannot use device {device!r}"
            )
        return None

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
        saved_pool: bool = True,  # packing is already opt-in here (``capture``)
    ) -> ForwardRecord:
        saved = self._saved
        if saved is None or not saved.capture or self._autograd.mode != "engine":
            return self._autograd.forward(fn, args, kwargs, params, grad_args)
        from hyper_parallel.platform.activations import SavedPool, active_pool

        pool = SavedPool()  # swap or memory tracking is on: pack what the forward saves
        with ms.saved_tensors_hooks(pool.pack, pool.unpack), active_pool(pool):
            record = self._autograd.forward(fn, args, kwargs, params, grad_args)
        record.native.extra["saved_pool"] = pool
        saved.after_forward(record)
        return record

    def stage_forward_no_grad(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        from mindspore.graph.api import _pynative_executor as executor

        old = executor.grad_flag()
        executor.set_grad_flag(False)
        try:
            return fn(*args, **kwargs)
        finally:
            executor.set_grad_flag(old)

    def stage_backward(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        return self._autograd.backward(record, grads)

    def stage_backward_input(self, record: ForwardRecord, grads: Sequence[Any]) -> tuple[Any, ...]:
        return self._autograd.backward_input(record, grads)

    def stage_backward_weight(self, record: ForwardRecord) -> None:
        self._autograd.backward_weight(record)

    # ------------------------------------------------------------------ parameters and gradients
    def is_identity_module(self, module: Any) -> bool:
        return type(module) is ms.nn.Identity  # a subclass may override construct: it runs

    def named_parameters(self, module: Any) -> list[tuple[str, Any]]:
        """Trainable parameters of a Cell, named by their ``Parameter.name``."""
        return [(p.name, p) for p in module.trainable_params()]

    def unique_parameter_names(self, stage_params: Sequence[tuple[int, Sequence[Any]]]) -> None:
        owner: dict[int, tuple[int, Any]] = {}
        for stage_index, params in stage_params:
            for param in params:
                owner.setdefault(id(param), (stage_index, param))
        counts: dict[str, int] = {}
        for _, param in owner.values():
            counts[param.name] = counts.get(param.name, 0) + 1
        for stage_index, param in owner.values():
            if counts[param.name] > 1:
                param.name = f"stage{stage_index}.{param.name}"

    def get_grad(self, param: Any) -> Any | None:
        """The accumulated gradient (``param._grad``, see the module docstring) or ``None``."""
        return getattr(param, "_grad", None)

    def set_grad(self, param: Any, grad: Any | None) -> None:
        if grad is not None and not isinstance(grad, ms.Tensor):
            raise TypeError(f"a gradient must be a MindSpore Tensor or None, got {type(grad).__name__}")
        if grad is not None and tuple(grad.shape) != tuple(param.shape):
            # A parameter sharded by fully_shard whose whole value is gathered right now (a failed run puts its
            # sharded gradient back before the shards are): the engine checks a gradient against the data's
            # shape, so attach it while the parameter briefly holds data of the gradient's shape.
            whole = ops.stop_gradient(param)
            param.set_data(ms.mint.empty(tuple(grad.shape), dtype=param.dtype), slice_shape=True)
            try:
                param._grad = grad
            finally:
                param.set_data(whole, slice_shape=True)
            return
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
        # In place with ``copy_``: ``ops.assign`` checks against the shape the parameter had when an operator
        # first used it, which is stale once fully_shard swapped its data for a shard (measured on 2.10).
        param.copy_(value)

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

    # ------------------------------------------------------------------ saved activations
    def saved_tensors(self) -> Any:
        if self._saved is None:
            from hyper_parallel.platform.activations import SavedTensorSupport
            from hyper_parallel.platform.mindspore.activations import MindSporeSavedOps

            self._saved = SavedTensorSupport(MindSporeSavedOps(self))
        return self._saved

    # ------------------------------------------------------------------ data parallelism, sharding, checkpoints
    def reshape(self, tensor: Any, shape: Sequence[int]) -> Any:
        return tensor.reshape(tuple(shape))

    def split(self, tensor: Any, sizes: Sequence[int], dim: int = 0) -> list[Any]:
        return list(ops.split(tensor, list(sizes), axis=dim))

    def set_param_storage(self, param: Any, value: Any) -> None:
        """``Parameter.set_data`` with ``slice_shape=True`` (the shape may change: sharding)."""
        param.set_data(value, slice_shape=True)

    def register_forward_pre_hook(self, module: Any, hook: Callable[[], None]) -> Any:
        return module.register_forward_pre_hook(lambda _cell, _args: hook())

    def checkpointed_tensors(self, module: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        """Every parameter (by ``Parameter.name``; BatchNorm's moving statistics are frozen parameters
        here) and the persistent buffers a Cell registered (not those with ``persistent=False``, as on torch)."""
        buffers = []
        if hasattr(module, "named_buffers"):
            for prefix, cell in module.cells_and_names():
                skip = getattr(cell, "_non_persistent_buffers_set", set())
                for name, buf in cell.named_buffers(recurse=False):
                    if name not in skip:
                        buffers.append((f"{prefix}.{name}" if prefix else name, buf))
        return [(p.name, p) for p in module.get_parameters()], buffers

    def save_checkpoint(self, path: str, params: Mapping[str, Any], optimizers: Sequence[Any], extra: Any,
                        buffers: Mapping[str, Any] | None = None) -> None:
        from hyper_parallel.platform.mindspore import checkpoint

        checkpoint.save(self, path, params, optimizers, extra, buffers or {})

    def load_checkpoint(self, path: str, params: Mapping[str, Any], optimizers: Sequence[Any],
                        buffers: Mapping[str, Any] | None = None, strict: bool = True) -> Any:
        from hyper_parallel.platform.mindspore import checkpoint

        return checkpoint.load(self, path, params, optimizers, buffers or {}, strict)

    # ------------------------------------------------------------------ random state
    def get_rng_state(self) -> tuple[Any, dict[Any, int], Any]:
        """MindSpore's two process-wide random states.

        * the seed of ``ms.set_seed`` and the per-kernel seed counters derived from it
          (``mindspore.common.seed``), which the ``ops`` random functions that run on the CPU
          build (``ops.randn``, ``ops.rand``, ``ops.uniform``, ``ops.dropout``, ``ops.randint``,
          ``ops.multinomial``...) draw from;
        * the default generator of ``ms.manual_seed`` (``ms.get_rng_state``), which the ``mint``
          random functions use (they have no CPU kernel in 2.10).

        numpy's global state, which ``ms.set_seed`` also seeds, is not part of it (LocalCluster
        swaps that itself). A random primitive created once and kept (``nn.Dropout`` keeps its
        own) draws from its own state, like any per-object generator. Reading or writing the
        default generator's state waits for the kernels already queued (measured on the CPU build).
        """
        seeds = _seed_module()
        return seeds._GLOBAL_SEED, dict(seeds._KERNEL_SEED), ms.get_rng_state()

    def set_rng_state(self, state: tuple[Any, dict[Any, int], Any]) -> None:
        global_seed, kernel_seeds, generator_state = state
        seeds = _seed_module()
        seeds._GLOBAL_SEED = global_seed
        seeds._KERNEL_SEED.clear()  # MindSpore updates this dict in place: keep the object
        seeds._KERNEL_SEED.update(kernel_seeds)
        ms.set_rng_state(generator_state)

    def draw_rng_seed(self) -> int:
        return int(ops.randint(0, 2**31 - 1, (1,)).asnumpy()[0])  # advances the ``ops`` kernel seeds

    def seed_rng(self, seed: int) -> None:
        """The ``ops`` random functions' global seed and fresh kernel seeds, and the ``mint``
        generator, all from ``seed``; numpy's global state is left alone (unlike ``ms.set_seed``)."""
        seeds = _seed_module()
        seeds._GLOBAL_SEED = seed
        seeds._KERNEL_SEED.clear()
        ms.manual_seed(seed)

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


def _seed_module() -> Any:
    # ``mindspore.common.seed`` is shadowed by the function ``mindspore.common.seed``
    return importlib.import_module("mindspore.common.seed")


@contextlib.contextmanager
def _null_stream(stream: Any) -> Iterator[Any]:
    yield stream


def _jit_construct(cell: Any) -> bool:
    """Whether ``cell``'s construct is an ``@ms.jit`` function: the instance's, or the class's one
    that an activation wrapper (which sets the instance's construct) still calls."""
    return any(getattr(fn, "__wrapped_by_jit__", False)
               for fn in (cell.construct, getattr(type(cell), "construct", None)))
