"""Saved activations: swap to host, recompute and memory accounting, for both backends.

Framework-neutral logic (this package, no tensor library imported) over one
:class:`~hyper_parallel.platform.activations.ops.FrameworkOps` adapter per backend.
"""

from hyper_parallel.platform.activations.state import SavedItem, SavedPool, active_pool, is_recomputing
from hyper_parallel.platform.activations.support import SavedTensorSupport

__all__ = ["SavedItem", "SavedPool", "SavedTensorSupport", "active_pool", "is_recomputing"]
