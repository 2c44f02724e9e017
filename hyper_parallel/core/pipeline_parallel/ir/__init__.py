"""The pipeline IR: what every other part of ``pipeline_parallel`` talks in.

``steps`` holds `MetaStep` / `MetaStepType` (compute, communication and feature steps, their
text form and which data each step consumes and produces); ``placement`` the stage-to-rank
tables and the argument checks shared by the schedule classes; ``schedule_csv`` the CSV form of
a whole schedule; ``trace_records`` the format of the step records a traced run writes.

May import: the standard library only (and the modules of this package). Never a tensor, never
a framework, never another part of the library.
"""

from hyper_parallel.core.pipeline_parallel.ir.steps import (
    DataKey,
    MetaStep,
    MetaStepType,
    Schedule,
    consumer_stage,
    consumes,
    message_key,
    produces,
)

__all__ = ["DataKey", "MetaStep", "MetaStepType", "Schedule", "consumer_stage", "consumes", "message_key",
           "produces"]
