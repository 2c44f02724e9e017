"""The chain run of ``fast_chain.py`` for a large job: all chains advanced together with numpy.

A *lane* is a chain of nodes that ends each node at ``max(clock, inputs) + duration`` and then sets
its clock to that end: a rank's compute steps and waiting communication steps, and in the stream
model a second lane per rank of its groups' ``A(g)`` (whose clock, the previous ``A``, is never
above its input ``A(previous) + T(previous)``, so it changes no maximum). Each *round* takes the
next node of every lane at once: a node whose inputs are all known gets ``max(clock, time(cell) +
add, ...) + duration``, the same additions and the same maximum (a maximum of the same floats is
the same float, in any order) as the loop of ``fast_chain.run_chain``; the others wait for a later
round. A time not yet known is ``inf``: a node with such an input gets ``inf`` as well, so that its
lane stays where it is. A round costs a few numpy calls whatever the number of lanes, and the rounds
are about as many as the longest lane has nodes where the ranks work side by side: with dozens of
ranks that is several times cheaper than visiting node after node. Where they wait on each other
in turn, few lanes move a round: `run_lanes` then stops (given a ``min_rate``) and hands over its
state, from which the caller goes on node by node (``fast_nodes.py``).

`run_lanes` returns None where no lane can go on before every lane is done (the job does not finish,
or a time overflowed to ``inf``): the caller then runs the general fast run.
"""

from __future__ import annotations

import numpy as np

_WINDOW = 128  # rounds between two looks at how many nodes the lanes move


def run_lanes(cells: np.ndarray, adds: np.ndarray, duration: np.ndarray, lanes: np.ndarray, lane_start: np.ndarray,
              min_rate: float = 0.0, state: tuple | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None] | None:
    """Run every lane to its end; ``(time, start, clock, None)`` or None (see the module docstring);
    where the lanes move fewer than ``min_rate`` nodes a round (over a window of rounds), stop:
    ``(time, start, clock, cursor)`` with each lane's next node (a time not known yet is ``inf``),
    the ``state`` to go on from.

    Row ``k < nodes`` of ``cells`` holds the cells of node ``k``'s inputs (a node; ``nodes``, the
    cell of 0.0, where it has fewer), ``adds`` what each adds, ``duration[k]`` its duration; then a
    row for the 0.0 cell and one for ``never``, a node that never runs (ends every lane), each of
    its own cell. ``lanes``: the nodes of every lane, lane after lane, lane ``j`` from
    ``lane_start[j]`` to ``lane_start[j + 1]``. ``time`` has one entry per node and then the 0.0
    cell, ``start`` when each node started (the maximum above), ``clock`` each lane's clock at its
    end."""
    nodes = cells.shape[0] - 2
    zero, never = nodes, nodes + 1
    count = lane_start.size - 1
    length = np.diff(lane_start)
    program = np.full(lanes.size + count, never, dtype=np.int64)  # each lane, then `never`
    program[np.arange(lanes.size) + np.repeat(np.arange(count), length)] = lanes
    position = lane_start[:-1] + np.arange(count)
    inf = np.inf
    time = np.full(nodes + 2, inf)
    time[zero] = 0.0
    start = np.zeros(nodes + 2, dtype=np.float64)
    clock = np.zeros(count, dtype=np.float64)
    if state is not None:
        time[:nodes + 1], start[:nodes], clock[:], cursor = state
        position += cursor
    take, maximum, copyto = np.take, np.maximum, np.copyto
    rounds, window, moved_before = 0, _WINDOW, int(position.sum())
    while True:
        node = take(program, position)
        ready = take(time, take(cells, node, axis=0))
        ready += take(adds, node, axis=0)
        ready = ready.max(axis=1)
        maximum(ready, clock, out=ready)
        moved = ready < inf
        if not moved.any():
            break
        end = ready + take(duration, node)  # inf where a lane waits: its node stays unknown
        time[node] = end
        start[node] = ready
        copyto(clock, end, where=moved)
        position += moved
        rounds += 1
        if rounds == window:  # how many nodes the lanes moved in the last rounds (not the first ones: lanes start late)
            moved_now = int(position.sum())
            if window > _WINDOW and moved_now - moved_before < min_rate * _WINDOW:
                return time[:nodes + 1], start[:nodes], clock, position - (lane_start[:-1] + np.arange(count))
            window += _WINDOW
            moved_before = moved_now
    if np.any(take(program, position) != never):
        return None  # a lane waits for what never comes (or a time overflowed): the general run says where
    return time[:nodes + 1], start[:nodes], clock, None
