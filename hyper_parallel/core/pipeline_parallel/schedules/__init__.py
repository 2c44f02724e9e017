"""Pure schedule generators: (ranks, chunks, micro-batches) -> per-rank compute lists.

One function per schedule (GPipe, 1F1B, interleaved 1F1B, looped BFS, interleaved zero bubble,
ZB-V, DualPipeV), each returning, per pipeline rank, a compute-only list of `MetaStep`s (``None``
for an idle slot); ``overlap_pairs`` fuses steady-state (backward, forward) pairs for
``overlap_b_f``. Lowering inserts all communication.

May import: ``ir``, and ``lowering.job_model`` (the pair fusion checks it adds no wait). Never a
tensor, a framework, the runtime, the features or the tools.
"""

from hyper_parallel.core.pipeline_parallel.schedules.dualpipe_v import generate_dualpipe_v
from hyper_parallel.core.pipeline_parallel.schedules.gpipe import generate_gpipe
from hyper_parallel.core.pipeline_parallel.schedules.interleaved_1f1b import generate_interleaved_1f1b
from hyper_parallel.core.pipeline_parallel.schedules.interleaved_zero_bubble import generate_interleaved_zero_bubble
from hyper_parallel.core.pipeline_parallel.schedules.looped_bfs import generate_looped_bfs
from hyper_parallel.core.pipeline_parallel.schedules.one_f_one_b import generate_1f1b
from hyper_parallel.core.pipeline_parallel.schedules.zbv import generate_zbv_zero_bubble

__all__ = [
    "generate_gpipe",
    "generate_1f1b",
    "generate_interleaved_1f1b",
    "generate_looped_bfs",
    "generate_interleaved_zero_bubble",
    "generate_zbv_zero_bubble",
    "generate_dualpipe_v",
]
