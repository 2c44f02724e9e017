"""Lowering and its proof: from compute-only lists to the lists a rank executes.

``p2p`` inserts the point-to-point steps (sends, receives, metadata, prefetch) and groups them
for the chosen transport (``plain``, or ``batch``: one duplex group per peer), repairing what
grouping would deadlock; ``validate`` refuses a lowered schedule that would hang or mismatch
(``ScheduleError`` with a per-rank grid); ``job_model`` simulates all ranks' lists together,
which both of them use as their proof; ``rank_plan`` plans one rank's list in time linear in the
job instead (``flow`` reads and runs the compute job once, ``levels`` is the batch lowering by
levels, ``rank_checks`` checks the rank's list); ``plan_cache`` keeps a plan per shape within a
process; ``gc_pause`` pauses the cyclic collector while a plan is built.

May import: ``ir``. Never the runtime, the features, the tools, a tensor or a framework.
"""

from hyper_parallel.core.pipeline_parallel.lowering.p2p import METADATA, TRANSPORTS, counterpart, lower, peer_rank
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError, validate_lowered

__all__ = ["METADATA", "TRANSPORTS", "counterpart", "ScheduleError", "lower", "peer_rank", "validate_lowered"]
