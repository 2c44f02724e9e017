"""Activation memory: swap saved activations to host memory, or recompute them in backward.

Framework-neutral entry points; each works on a torch ``nn.Module`` or a MindSpore ``Cell`` and
wraps it in place (the module is returned; its parameters, names and hooks are unchanged). See
``docs/memory.md`` for what each option saves and costs.

* :func:`swap_wrapper` -- what the module's forward saves for backward goes to host memory after
  the forward and comes back when the backward reaches the module.
* :func:`checkpoint_wrapper` -- the module's forward saves only its inputs and is re-run in
  backward; with ``save=`` the outputs of the chosen sub-modules are kept (and those sub-modules
  are not re-run), the rest is recomputed (selective recompute).
* :func:`is_recomputing` -- whether a re-run is in progress (for hooks that must fire once).

Schedule-driven swap is ``swap=True`` on a pipeline schedule (``core/pipeline_parallel/features/swap.py``);
memory accounting is ``track_memory`` / ``memory_stats``
(``core/pipeline_parallel/features/memory_stats.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.activations.state import is_recomputing as _is_recomputing


def swap_wrapper(module: Any) -> Any:
    """Move the activations ``module`` saves for backward to host memory after its forward and
    bring them back when the gradient reaches its outputs.

    Parameters, the module's inputs and outputs (and tensors sharing their memory) stay on the
    device. Copies are asynchronous (a side stream) on accelerators, synchronous on the CPU.
    """
    return get_platform().saved_tensors().swap_wrapper(module)


def checkpoint_wrapper(module: Any, save: Iterable[str] | str | Callable[[str, Any], bool] | None = None,
                       preserve_rng: bool = True) -> Any:
    """Recompute ``module``'s forward in its backward instead of keeping what it saves.

    ``save``: sub-modules (dotted names relative to ``module``, glob patterns allowed, or a
    predicate ``(name, sub_module) -> bool``) whose outputs, and what they save for their own
    backward, are kept; they are not re-run, everything else is (selective recompute). A name that
    matches nothing raises ``ValueError``. ``preserve_rng`` re-runs with the random state of the
    forward (same dropout masks). When one wrapped module runs inside another, the outer one
    decides. The re-run happens once per backward, also with the dx/dW split.
    """
    return get_platform().saved_tensors().checkpoint_wrapper(module, save=save, preserve_rng=preserve_rng)


def is_recomputing() -> bool:
    """True while a checkpointed module's forward is re-run for its backward, on this thread.

    Forward hooks of modules inside a checkpointed module fire again during the re-run; a hook
    that must act once per forward (a communication or synchronisation hook) returns early when
    this is True. Backward hooks fire once.
    """
    return _is_recomputing()


__all__ = ["checkpoint_wrapper", "is_recomputing", "swap_wrapper"]
