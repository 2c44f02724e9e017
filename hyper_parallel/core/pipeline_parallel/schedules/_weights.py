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

The model runs time unit by time unit, each rank as a Python generator resumed once per unit. A
rank looks up the inputs of its next F/I once (when it becomes the next) and again only while one
of them is still missing; a value's time is kept from its first making (a later one could not
make it usable earlier). The work grows with the steps and idle units, not with ranks x units.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator

from hyper_parallel.core.pipeline_parallel.ir.steps import (
    DataKey,
    MetaStep,
    MetaStepType,
    consumes,
    unchecked_step,
)

_T = MetaStepType
_FWD, _BWD, _INPUT, _WEIGHT = _T.FWD, _T.BWD, _T.BWD_INPUT, _T.BWD_WEIGHT


def input_backward(stage: int, micro: int) -> MetaStep:
    """Input-gradient backward (``I``) of ``micro`` on ``stage`` (plain ints: not checked again)."""
    return unchecked_step(micro, _INPUT, stage)


def weight_backward(stage: int, micro: int) -> MetaStep:
    """Weight-gradient backward (``W``) of ``micro`` on ``stage`` (plain ints: not checked again)."""
    return unchecked_step(micro, _WEIGHT, stage)


def place_weights(
    orders: dict[int, list[MetaStep]], num_stages: int, limits: dict[int, int]
) -> dict[int, list[MetaStep | None]]:
    """Add one W after every I of ``orders`` (rank -> F/I list), see the module docstring.

    ``limits[rank]`` is the most (stage, micro-batch) activations the rank may hold. Raises
    RuntimeError if the F/I lists cannot run to the end (a generator bug, not a user error).
    """
    queues = {rank: list(steps) for rank, steps in orders.items()}
    out: dict[int, list[MetaStep | None]] = {rank: [] for rank in orders}
    if not any(queues.values()):
        return out
    ranks = sorted(queues)
    made: dict[DataKey, int] = {}  # value -> the first time unit from which it can be used
    runs = [_rank_run(queues[rank], limits[rank], out[rank], made, num_stages) for rank in ranks]
    active = [run.send for rank, run in zip(ranks, runs) if queues[rank]]
    for send in active:
        send(None)  # to its first yield
    time = 0
    while active:
        ran = False
        finished = []
        for send in active:
            try:
                if send(time):
                    ran = True
            except StopIteration:  # the rank ran its last step before this time unit
                finished.append(send)
        if finished:
            active = [send for send in active if send not in finished]
        if not ran and active:  # nothing runs now, so nothing new exists at time + 1 either
            heads = {rank: _ran_count(queues[rank], out[rank]) for rank in ranks}
            stuck = {rank: str(queues[rank][heads[rank]]) for rank in ranks if heads[rank] < len(queues[rank])}
            raise RuntimeError(f"weight placement cannot go on at time {time}: ranks wait at {stuck}")
        time += 1
    return out


def _ran_count(queue: list[MetaStep], ran: list[MetaStep | None]) -> int:
    """How many steps of ``queue`` are in ``ran`` (the queue in order, with new W's in between)."""
    count = 0
    for step in ran:
        if count < len(queue) and step is queue[count]:
            count += 1
    return count


def _rank_run(
    queue: list[MetaStep], limit: int, out: list[MetaStep | None], made: dict[DataKey, int], num_stages: int
) -> Generator[bool, int, None]:
    """One rank of `place_weights`: sent each time unit in turn, appends what the rank runs then to
    ``out`` and yields whether it ran a step; returns once it ran all its steps.

    A value made at time t is put in ``made`` with t + 1 at once (kept from its first making), so
    no rank uses it before t + 1 whichever order the ranks run in within a time unit. The values
    of an F, I or B are those of `consumes` / `produces`, written out here (millions of steps)."""
    live = 0
    pending: deque[MetaStep] = deque()
    last = num_stages - 1
    get, keep, run, take, wait = made.get, made.setdefault, out.append, pending.popleft, pending.append
    time = yield False
    for step in queue:
        if step is None:  # never ready: the rank runs its W's, then waits until place_weights gives up
            while pending:
                run(take())
                live -= 1
                time = yield True
            while True:
                time = yield False
        stage, micro, kind = step.stage_index, step.micro_index, step.meta_type  # as `consumes` reads them
        makes = None
        if stage is None or micro is None:
            needs: list[DataKey] | tuple[DataKey, ...] = ()
        elif kind is _FWD:
            makes = ("F", stage, micro)
            needs = (("F", stage - 1, micro),) if stage > 0 else ()
        elif kind is _INPUT or kind is _BWD:
            makes = ("G", stage, micro)
            needs = (("F", stage, micro), ("G", stage + 1, micro)) if stage < last else (("F", stage, micro),)
        else:  # W (what it makes is never an input) or a step that needs nothing
            needs = consumes(step, num_stages)
        ready = 0
        for key in needs:
            when = get(key, -1)
            if when < 0:
                ready = -1
                break
            if when > ready:
                ready = when
        while ready < 0 or ready > time or (kind is _FWD and not live < limit):
            if ready < 0:  # an input was not made yet: look again
                ready = _ready(needs, made)
                if 0 <= ready <= time and (kind is not _FWD or live < limit):
                    break
            if pending:
                run(take())  # a W: the rank would wait, or hold too much
                live -= 1
                time = yield True
            else:
                time = yield False
        run(step)
        if kind is _FWD:
            live += 1
        elif kind is _INPUT:
            wait(weight_backward(stage, micro))
        elif kind is _WEIGHT:
            live -= 1
        if makes is not None:
            keep(makes, time + 1)
        time = yield True
    while pending:
        run(take())
        time = yield True


def _ready(keys: list[DataKey] | tuple[DataKey, ...], made: dict[DataKey, int]) -> int:
    """The time from which all ``keys`` can be used, or -1 while one is not made yet."""
    ready = 0
    for key in keys:
        when = made.get(key, -1)
        if when < 0:
            return -1
        ready = max(ready, when)
    return ready
