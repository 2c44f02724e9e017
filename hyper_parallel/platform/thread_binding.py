"""Which platform a thread acts for: a LocalCluster rank's, or a helper thread of a rank.

Kept apart from ``platform/__init__.py`` so that the backends (``base.run_helper_threads``) can
bind a thread without importing the package that chooses and imports those backends.
"""

from __future__ import annotations

import threading
from typing import Any

_thread_state = threading.local()


def bind_thread_platform(platform: Any) -> None:
    """Make ``get_platform()`` return ``platform`` in the calling thread (LocalCluster ranks)."""
    _thread_state.platform = platform


def thread_platform() -> Any:
    """The ``Platform`` bound to the calling thread, or ``None``."""
    return getattr(_thread_state, "platform", None)
