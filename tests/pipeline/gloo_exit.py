"""The end of a gloo worker: leave without interpreter finalization once the results are written.

gloo work objects freed while the interpreter shuts down can abort the process ("terminate called
without an active exception") after a run that succeeded; the job would then fail for nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


def run_and_leave(main: Callable[..., Any], *args: Any) -> None:
    """Run ``main(*args)``; if it returns, close the process group cleanly and exit 0 at once (an
    exception still propagates and fails the job as usual)."""
    main(*args)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_rank_result(out_dir: str, rank: int, payload: Any) -> None:
    """Pickle this rank's results to ``out_dir/rank<r>.pkl`` (written whole or not at all), where
    the test reads them with ``conftest.load_rank_results``."""
    import pickle

    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(path + ".tmp", path)
