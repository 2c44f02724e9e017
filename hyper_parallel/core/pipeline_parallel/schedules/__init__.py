"""Pure schedule generators: (ranks, chunks, micro-batches) -> per-rank compute lists."""

from .dualpipe_v import generate_dualpipe_v
from .gpipe import generate_gpipe
from .interleaved_1f1b import generate_interleaved_1f1b
from .interleaved_zero_bubble import generate_interleaved_zero_bubble
from .looped_bfs import generate_looped_bfs
from .one_f_one_b import generate_1f1b
from .zbv import generate_zbv_zero_bubble

__all__ = [
    "generate_gpipe",
    "generate_1f1b",
    "generate_interleaved_1f1b",
    "generate_looped_bfs",
    "generate_interleaved_zero_bubble",
    "generate_zbv_zero_bubble",
    "generate_dualpipe_v",
]
