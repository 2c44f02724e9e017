"""Fully sharded data parallelism (FSDP) and plain data parallelism, inside a pipeline or not.

``fully_shard(module, mesh)`` shards a module's parameters over the ``dp`` ranks (torch's own FSDP2
in a torch.distributed job; this library's implementation over the platform collectives on MindSpore
and on a LocalCluster). ``data_parallel(schedule, mesh)`` makes a pipeline schedule one replica of a
data-parallel group: fully sharded stages are gathered, freed and reduced by schedule steps, every
other gradient is all-reduced once per run. See ``docs/parallelism.md``.
"""

from hyper_parallel.core.fully_shard.api import (
    fully_shard,
    is_fully_sharded,
    reduce_gradients,
    reshard,
    unshard,
)
from hyper_parallel.core.fully_shard.data_parallel import data_parallel, data_parallel_state

__all__ = [
    "data_parallel",
    "data_parallel_state",
    "fully_shard",
    "is_fully_sharded",
    "reduce_gradients",
    "reshard",
    "unshard",
]
