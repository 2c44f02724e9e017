"""Planned schedules reused within one process.

Building a schedule generates the compute lists of every rank, lowers and validates them; the
result depends only on the compute lists, the placement and the options. Every rank of an
in-process job (LocalCluster's threads), a schedule built again for the same shape (a second
model chunk set, ``eval`` and training, a test) reuses the lowered lists of an earlier build
instead of planning again: an entry is used only when the compute lists are equal to the ones it
was made from, and it hands out fresh list objects (the steps themselves are immutable).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, Schedule

Lowered = dict[int, list[MetaStep]]

_KEPT = 4  # entries: a few shapes, each a few lists per rank (the largest a few hundred MB)
_LOCK = threading.Lock()
_GENERATED: OrderedDict[Hashable, Schedule] = OrderedDict()
_PLANS: OrderedDict[Hashable, tuple[Schedule, Lowered, set[Hashable]]] = OrderedDict()


def _copy(schedule: Schedule) -> Schedule:
    return {rank: list(steps) for rank, steps in schedule.items()}


def _keep(table: OrderedDict, key: Hashable, value: object) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > _KEPT:
        table.popitem(last=False)


def generated(key: Hashable, make: Callable[[], Schedule]) -> Schedule:
    """``make()``'s compute lists, made once per ``key`` (a schedule class and its p, v, m);
    equal lists of the same step objects, so that comparing them with a cached plan is cheap."""
    with _LOCK:
        found = _GENERATED.get(key)
    if found is None:
        found = make()
        with _LOCK:
            _keep(_GENERATED, key, _copy(found))
    return _copy(found)


def lowered(key: Hashable, compute: Schedule) -> tuple[Lowered, set[Hashable]] | None:
    """(copy of the lowered lists, the checks they passed) planned before under ``key`` from
    compute lists equal to ``compute``, or None."""
    with _LOCK:
        entry = _PLANS.get(key)
    if entry is None or entry[0] != compute:  # the same step objects: compared by identity, in C
        return None
    return _copy(entry[1]), entry[2]


def remember(key: Hashable, compute: Schedule, result: Lowered, checks: set[Hashable]) -> None:
    """Keep ``result`` (lowered from ``compute``) and the checks it passed (``checks`` is shared:
    add to it later as more pass)."""
    with _LOCK:
        _keep(_PLANS, key, (_copy(compute), _copy(result), checks))


def clear() -> None:
    """Forget every kept plan (tests; a process that needs the memory back)."""
    with _LOCK:
        _GENERATED.clear()
        _PLANS.clear()
