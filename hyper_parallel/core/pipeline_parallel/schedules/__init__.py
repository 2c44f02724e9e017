"""Pure schedule generators: (ranks, chunks, micro-batches) -> per-rank compute lists."""

from .gpipe import generate_gpipe
from .interleaved_1f1b import generate_interleaved_1f1b
from .looped_bfs import generate_looped_bfs
from .one_f_one_b import generate_1f1b

__all__ = ["generate_gpipe", "generate_1f1b", "generate_interleaved_1f1b", "generate_looped_bfs"]
