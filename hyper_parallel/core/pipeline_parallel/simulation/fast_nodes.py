"""The chain run of ``fast_chain.py`` node by node: each chain advanced until it waits for a node
of another chain, which wakes it once known (see ``fast_chain.py`` for the nodes, their inputs and
why their times are those of the exact model)."""

from __future__ import annotations


def run_nodes(programs: list[list[int]], deps: list[list[int]], adds: list[list[float]], durations: list[float],
              side: int, count: int, time: list[float | None], starts: list[float], cursor: list[int],
              clock_of: list[float]) -> bool:
    """Run every chain to its end from ``cursor`` (its next node) and ``clock_of`` (its clock); False
    where one waits for what never comes.

    Node ``k`` ends at ``max(clock, time[deps[j][k]] + adds[j][k] ...) + durations[k]`` (six slots
    ``j``; -1: none), written into ``time`` (None: not known yet); ``starts[k]``: that maximum, kept
    for the compute steps ``k < count``. Nodes ``k >= side`` leave their chain's clock as it was."""
    waiting: list[list[int] | None] = [None] * len(time)  # node -> the chains waiting for it
    ready_chains = list(range(len(programs) - 1, -1, -1))
    dep_a, dep_b, dep_c, dep_d, dep_e, dep_f = deps
    add_a, add_b, add_c, add_d, add_e, add_f = adds
    while ready_chains:
        chain = ready_chains.pop()
        program = programs[chain]
        index, clock = cursor[chain], clock_of[chain]
        wait = -1
        for index in range(index, len(program)):  # a for loop: cheaper per node than counting by hand
            # the six input slots are written out one inside the other, not looped over: this loop
            # runs once per node (millions at p = 64, m = 1024) and a loop over slots costs ~2x here
            k = program[index]
            ready = clock
            cell = dep_a[k]
            if cell >= 0:
                at = time[cell]
                if at is None:
                    wait = cell
                    break
                at += add_a[k]
                if at > ready:
                    ready = at
                cell = dep_b[k]
                if cell >= 0:
                    at = time[cell]
                    if at is None:
                        wait = cell
                        break
                    at += add_b[k]
                    if at > ready:
                        ready = at
                    cell = dep_c[k]
                    if cell >= 0:
                        at = time[cell]
                        if at is None:
                            wait = cell
                            break
                        at += add_c[k]
                        if at > ready:
                            ready = at
                        cell = dep_d[k]
                        if cell >= 0:
                            at = time[cell]
                            if at is None:
                                wait = cell
                                break
                            at += add_d[k]
                            if at > ready:
                                ready = at
                            cell = dep_e[k]
                            if cell >= 0:
                                at = time[cell]
                                if at is None:
                                    wait = cell
                                    break
                                at += add_e[k]
                                if at > ready:
                                    ready = at
                                cell = dep_f[k]
                                if cell >= 0:
                                    at = time[cell]
                                    if at is None:
                                        wait = cell
                                        break
                                    at += add_f[k]
                                    if at > ready:
                                        ready = at
            end = ready + durations[k]
            time[k] = end
            woken = waiting[k]
            if woken is not None:
                ready_chains.extend(woken)
            if k < side:
                if k < count:
                    starts[k] = ready
                clock = end
        else:
            index = len(program)  # done (also when the loop had nothing left to run)
        cursor[chain], clock_of[chain] = index, clock
        if wait >= 0:
            waiters = waiting[wait]
            if waiters is None:
                waiting[wait] = [chain]
            else:
                waiters.append(chain)
    return all(cursor[chain] == len(program) for chain, program in enumerate(programs))
