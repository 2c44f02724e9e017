"""Weight steps for the zero-bubble schedules: where each ``W`` goes once F and I are ordered.

A zero-bubble generator fixes the order of the forwards (F) and input backwards (I) of every
rank. `place_weights` then adds the weight backwards (W) the way the zero-bubble papers
describe, by running all ranks together in a unit-cost list model (every F, I and W takes one
time unit; a value made at time t can be used from t + 1):

- each rank runs its F/I list in order; a step runs once its inputs exist;
- a W runs when the rank would otherwise wait (a bubble), or when the next step is a forward
  that would lift the rank's in-flight activations above its limit;
- the W's left when the F/I list is done run at the end.

W's run oldest first. An activation of (stage, micro-batch) is in flight from its F until its
W, so the limit bounds the peak of every rank. The lists come from one feasible run of all
ranks, so executing them in order cannot deadlock whatever the real costs are.
"""

from __future__ import annotations

from collections import deque

from hyper_parallel.core.pipeline_parallel.ir.steps import (
    DataKey,
    MetaStep,
    MetaStepType,
    consumes,
    produces,
    unchecked_step,
)

_T = MetaStepType


def input_backward(stage: int, micro: int) -> MetaStep:
    """Input-gradient backward (``I``) of ``micro`` on ``stage`` (plain ints: not checked again)."""
    return unchecked_step(micro, _T.BWD_INPUT, stage)


def weight_backward(stage: int, micro: int) -> MetaStep:
    """Weight-gradient backward (``W``) of ``micro`` on ``stage`` (plain ints: not checked again)."""
    return unchecked_step(micro, _T.BWD_WEIGHT, stage)


def place_weights(
    orders: dict[int, list[MetaStep]], num_stages: int, limits: dict[int, int]
) -> dict[int, list[MetaStep | None]]:
    """Add one W after every I of ``orders`` (rank -> F/I list), see the module docstring.

    ``limits[rank]`` is the most (stage, micro-batch) activations the rank may hold. Raises
    RuntimeError if the F/I lists cannot run to the end (a generator bug, not a user error).
    """
    queues = {rank: deque(steps) for rank, steps in orders.items()}
    pending: dict[int, deque[MetaStep]] = {rank: deque() for rank in orders}
    live = dict.fromkeys(orders, 0)
    made: dict[DataKey, int] = {}
    out: dict[int, list[MetaStep | None]] = {rank: [] for rank in orders}
    time = 0
    while any(queues.values()) or any(pending.values()):
        finished: list[DataKey] = []
        ran = False
        for rank in sorted(orders):
            step = _next_step(queues[rank], pending[rank], live[rank], limits[rank], made, time, num_stages)
            if step is None:
                continue
            ran = True
            out[rank].append(step)
            if step.meta_type is _T.FWD:
                live[rank] += 1
            elif step.meta_type is _T.BWD_INPUT:
                pending[rank].append(weight_backward(step.stage_index, step.micro_index))
            elif step.meta_type is _T.BWD_WEIGHT:
                live[rank] -= 1
            finished += produces(step)
        if not ran:  # nothing runs now, so nothing new exists at time + 1 either
            stuck = {rank: str(queues[rank][0]) for rank in sorted(queues) if queues[rank]}
            raise RuntimeError(f"weight placement cannot go on at time {time}: ranks wait at {stuck}")
        made.update((key, time + 1) for key in finished)
        time += 1
    return out


def _next_step(
    queue: deque[MetaStep],
    pending: deque[MetaStep],
    live: int,
    limit: int,
    made: dict[DataKey, int],
    time: int,
    num_stages: int,
) -> MetaStep | None:
    """The step a rank runs at ``time``: its next F/I if possible, else its oldest W if any."""
    head = queue[0] if queue else None
    ready = head is not None and all(made.get(key, time + 1) <= time for key in consumes(head, num_stages))
    if ready and (head.meta_type is not _T.FWD or live < limit):
        return queue.popleft()
    if pending:
        return pending.popleft()
    return None

