"""What the saved-tensor machinery needs from a framework: one adapter per backend.

The logic of swap groups, recompute regions and memory accounting is written once against
:class:`FrameworkOps` (``platform/torch/activations.py`` and ``platform/mindspore/activations.py``
implement it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


class CopyEngine(ABC):
    """Copies swap units (see :meth:`FrameworkOps.unit_of`) to the host and back.

    ``launch_*`` start the copies (on a side stream where the device has streams) and return a
    pending object; ``finish_*`` make the result usable by the compute that follows (the compute
    stream waits for the side stream; on the CPU the copies were done at launch).
    """

    asynchronous = False

    @abstractmethod
    def launch_offload(self, units: list[Any]) -> Any: ...

    @abstractmethod
    def finish_offload(self, pending: Any) -> list[Any]:
        """The host copies; the device units may be dropped once this returns."""

    @abstractmethod
    def launch_load(self, hosts: list[Any]) -> Any: ...

    @abstractmethod
    def finish_load(self, pending: Any) -> list[Any]:
        """The device units, ready for the compute stream."""


class FrameworkOps(ABC):
    """Framework operations on saved tensors, modules and hooks."""

    name = "abstract"

    # ---------------------------------------------------------------- hooks and pools
    @abstractmethod
    def hooks(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> AbstractContextManager[Any]:
        """The framework's saved-tensor hooks context (innermost hooks win)."""

    @abstractmethod
    def new_pool(self) -> Any:
        """A pool for a wrapped module that runs outside any stage forward."""

    @abstractmethod
    def pool_of(self, record: Any) -> Any:
        """The pool that packed what the stage forward of ``record`` saved, or None."""

    @abstractmethod
    def record_inputs(self, record: Any) -> list[Any]:
        """The input tensors the forward of ``record`` was called with (held by the record)."""

    @abstractmethod
    def grad_recording(self) -> bool:
        """Whether a forward run now records a graph (so saves tensors)."""

    @abstractmethod
    def recording(self) -> AbstractContextManager[Any]:
        """Record a graph while the block runs (a recompute inside a backward)."""

    # ---------------------------------------------------------------- tensors
    @abstractmethod
    def is_tensor(self, value: Any) -> bool: ...

    @abstractmethod
    def storage_key(self, tensor: Any) -> int:
        """Identifies the memory block behind ``tensor`` (views of one block share it)."""

    @abstractmethod
    def storage_nbytes(self, tensor: Any) -> int: ...

    @abstractmethod
    def computed(self, tensor: Any) -> bool:
        """Whether ``tensor`` was produced by a recorded operation (not a parameter, buffer, input
        or constant): only such tensors are swap candidates."""

    @abstractmethod
    def detach(self, tensor: Any) -> Any: ...

    @abstractmethod
    def requires_grad(self, tensor: Any) -> bool: ...

    @abstractmethod
    def fresh(self, tensor: Any, requires_grad: bool) -> Any:
        """A new graph leaf sharing ``tensor``'s data, taking gradients when ``requires_grad``."""

    @abstractmethod
    def is_float(self, tensor: Any) -> bool: ...

    # ---------------------------------------------------------------- swap units
    @abstractmethod
    def unit_of(self, tensor: Any) -> tuple[Any, Any, Any]:
        """``(key, unit, meta)``: items with one key are copied once as ``unit``; ``meta`` rebuilds
        the item's tensor from the copied-back unit."""

    @abstractmethod
    def rebuild(self, unit: Any, meta: Any) -> Any: ...

    @abstractmethod
    def unit_nbytes(self, unit: Any) -> int: ...

    @abstractmethod
    def copy_engine(self) -> CopyEngine: ...

    # ---------------------------------------------------------------- random state
    @abstractmethod
    def get_rng_state(self) -> Any: ...

    @abstractmethod
    def set_rng_state(self, state: Any) -> None: ...

    # ---------------------------------------------------------------- modules
    @abstractmethod
    def forward_of(self, module: Any) -> Callable[..., Any]:
        """The module's forward (torch ``forward``, MindSpore ``construct``) as a bound callable."""

    @abstractmethod
    def set_forward(self, module: Any, fn: Callable[..., Any]) -> None:
        """Replace the module's forward on this instance (its ``__call__`` and hooks stay)."""

    @abstractmethod
    def is_module(self, value: Any) -> bool: ...

    @abstractmethod
    def persistent_tensors(self, module: Any) -> list[Any]:
        """Parameters (trainable or not) and buffers of ``module``: never activations."""

    @abstractmethod
    def named_modules(self, module: Any) -> list[tuple[str, Any]]:
        """Every sub-module with its dotted name (the module itself as ``""``)."""

    @abstractmethod
    def on_grad(self, tensor: Any, callback: Callable[[], None]) -> bool:
        """Call ``callback()`` when the gradient of ``tensor`` is computed (before the operation
        that produced ``tensor`` runs its backward); False where ``tensor`` takes no gradient."""
