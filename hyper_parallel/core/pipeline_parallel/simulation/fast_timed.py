"""The timed model of ``timed_model.py`` over compiled step lists (``fast_job.py``): same times, faster.

`run_timed_fast` gives the `TimedOutcome` that `timed_model.run_timed` gives for the same job
without runtime costs, float for float, record for record: every time is computed by the same
additions and maxima of the same operands (a value's time plus its message time, the later of
a rank's clock and its inputs, a receive at ``max(posted, sent + message time)``, a stream
group active at ``max(issued, previous group completed)`` and so on, as described in
``timed_model.py``). What changes is the bookkeeping:

- the keys, producers, counterparts, step and message times are looked up once
  (``fast_job.compile_job``) instead of at every step;
- a rank that waits is woken by the cell it waits on, instead of trying every rank in turn
  until none moves (the times do not depend on the order in which ranks are advanced);
- the cyclic garbage collector pauses while the arrays are built and run (they hold no cycles);
- the trace records are made on first use (`lazy_records`): each rank's own records are kept
  in its program order and its messages in the order it sent them, so sorting them by
  ``(rank, start, end)`` gives the exact model's list.

It runs ``fast_chain.run_chain`` and, where that declines, the general run of
``fast_general.py``. It returns None when the job would not finish (or `compile_job` declines
it): the caller then runs the exact model, which reports the stuck ranks with the same text as
ever.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, Schedule
from hyper_parallel.core.pipeline_parallel.lowering.job_model import MODELS
from hyper_parallel.core.pipeline_parallel.simulation.fast_chain import run_chain
from hyper_parallel.core.pipeline_parallel.simulation.fast_general import FastRun
from hyper_parallel.core.pipeline_parallel.simulation.fast_job import compile_job
from hyper_parallel.core.pipeline_parallel.simulation.timed_model import TimedOutcome


def run_timed_fast(
    schedule: Schedule,
    stage_to_rank: dict[int, int],
    step_time: Callable[[MetaStep], float],
    link_time: Callable[[str, int], float],
    *,
    lowered: bool | None = True,
    model: str = "eager",
    wait_at_post: bool = False,
    timelines: bool = True,
) -> TimedOutcome | None:
    """`timed_model.run_timed` without runtime costs, or None where the exact model must run.

    ``link_time(kind, stage)``: the message time of the values ``(kind, stage, micro)`` of every
    micro-batch (as `CostModel.message_time` is). ``lowered=None``: lowered when a step is a
    send/recv or BATCH."""
    if model not in MODELS:
        raise ValueError(f"unknown communication model {model!r}; valid: {', '.join(MODELS)}")
    collecting = gc.isenabled()
    gc.disable()  # millions of new lists and tuples, no cycles: the collector would walk them all again and again
    try:
        job = compile_job(schedule, stage_to_rank, step_time, link_time, lowered=lowered, wait_at_post=wait_at_post)
        if job is None:
            return None
        outcome = run_chain(job, len(stage_to_rank), wait_at_post, model == "stream", timelines)
        if outcome is None:
            outcome = FastRun(job, len(stage_to_rank), model == "stream").run()
        if outcome is not None:
            outcome.compiled = job  # for the summary (fast_summary.py)
        return outcome
    finally:
        if collecting:
            gc.enable()
