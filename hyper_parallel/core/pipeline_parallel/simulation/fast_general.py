"""The general fast run behind ``fast_chain.py``: every rank advanced over its compiled program.

The rules and their floats are those of ``timed_model.py`` (see ``fast_timed.py``); a rank that
waits is woken by the cell it waits on. ``fast_chain.run_chain`` runs most jobs; this run takes
the ones it declines, and rebuilds the trace records of a chain run from its times.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, consumes
from hyper_parallel.core.pipeline_parallel.lowering.job_model import producer_text
from hyper_parallel.core.pipeline_parallel.simulation.fast_job import CompiledJob
from hyper_parallel.core.pipeline_parallel.simulation.lazy_records import RecordSource
from hyper_parallel.core.pipeline_parallel.simulation.timed_model import TimedOutcome


class FastRun:
    """One general fast run of a compiled job (``run`` gives the `TimedOutcome`, or None if stuck)."""

    def __init__(self, job: CompiledJob, num_stages: int, stream: bool) -> None:
        self.job = job.lists()
        self.num_stages = num_stages
        self.stream = stream
        self.time: list[float | None] = [None] * (job.num_ops + len(job.steps))
        groups = len(job.group_steps)
        self.issued: list[float | None] = [None] * groups
        self.active: list[float | None] = [None] * groups
        self.completed: list[float | None] = [None] * groups
        self.queue: dict[int, list[int]] = {rank: [] for rank in job.ranks}  # issued non-metadata groups
        self.head = dict.fromkeys(job.ranks, 0)
        self.cursor = dict.fromkeys(job.ranks, 0)
        self.clock = dict.fromkeys(job.ranks, 0.0)
        self.marks: dict[int, list[float]] = {rank: [] for rank in job.ranks}  # the clock after each instruction
        self.compute: dict[int, list[tuple[float, float, MetaStep]]] = {rank: [] for rank in job.ranks}
        self.waiting: dict[int, list[int]] = {}  # cell -> ranks waiting for it
        self.ready: list[int] = []  # ranks to advance

    # ------------------------------------------------------------------ driver
    def run(self) -> TimedOutcome | None:
        self.ready = list(reversed(self.job.ranks))
        while self.ready:
            self._advance(self.ready.pop())
        finish: dict[int, float] = {}
        for rank in self.job.ranks:
            if self.cursor[rank] < len(self.job.program[rank]):
                return None
            ends = [self.time[op] for g in self.queue[rank] for op in self.job.group_ops(g)]
            if None in ends:
                return None
            finish[rank] = max([self.clock[rank], *ends]) + 0.0  # type: ignore[list-item]
        self.kept = {rank: list(steps) for rank, steps in self.compute.items()}  # the caller may change its lists
        return TimedOutcome(self.compute, RecordSource(self._records), finish, {})  # type: ignore[arg-type]

    def _advance(self, rank: int) -> None:
        """Run the rank's program until it waits for a cell or ends (the compute step inline:
        its ready time is the latest of the clock and its inputs, as in the exact model)."""
        job = self.job
        program = job.program[rank]
        (dep_a, dep_b, dep_c), (add_a, add_b, add_c) = job.deps, job.adds
        durations, steps, base = job.durations, job.steps, job.num_ops
        time, waiting, ready_ranks = self.time, self.waiting, self.ready
        marks, timeline = self.marks[rank], self.compute[rank]
        index, clock = self.cursor[rank], self.clock[rank]
        count = len(program)
        wait = -1
        while index < count:
            k = program[index]
            if k >= 0:
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
                end = ready + durations[k]
                cell = base + k
                time[cell] = end
                if waiting:
                    woken = waiting.pop(cell, None)
                    if woken:
                        ready_ranks.extend(woken)
                timeline.append((ready, end, steps[k]))
                marks.append(end)
                clock = end
            else:
                after = self._communicate(rank, -1 - k, clock)
                if after is None:
                    break
                marks.append(after)
                clock = after
            index += 1
        self.cursor[rank], self.clock[rank] = index, clock
        if wait >= 0:
            waiting.setdefault(wait, []).append(rank)

    # ------------------------------------------------------------------ communication
    def _communicate(self, rank: int, group: int, clock: float) -> float | None:
        """Issue a communication step (once) and wait for its blocking receives; the clock
        after it, or None while a receive it waits for is not done."""
        job = self.job
        blocking = job.group_blocking[group]
        if self.issued[group] is None:
            self._issue(rank, group, job.group_ops(group), job.group_meta[group], clock)
        time = self.time
        for op in blocking:
            if time[op] is None:
                self.waiting.setdefault(op, []).append(rank)
                return None
        if blocking:
            ready = max(time[op] for op in blocking)  # type: ignore[type-var]
            if ready > clock:
                return ready
        return clock

    def _set(self, cell: int, value: float) -> None:
        self.time[cell] = value
        woken = self.waiting.pop(cell, None)
        if woken:
            self.ready.extend(woken)

    def _issue(self, rank: int, group: int, ops: range, is_meta: bool, now: float) -> None:
        self.issued[group] = now
        if is_meta or not self.stream:  # metadata always, and every message in the eager model
            self.active[group] = now
            job, time, issued = self.job, self.time, self.issued
            for op in ops:
                other = job.op_other[op]
                other_issued = issued[job.op_group[other]]
                if job.op_send[op]:
                    self._set(op, now)
                    if other_issued is not None and time[other] is None:
                        self._set(other, max(other_issued, now + job.op_time[op]))
                elif other_issued is not None:
                    self._set(op, max(now, other_issued + job.op_time[op]))
            if not is_meta:
                self.queue[rank].append(group)
            return
        self.queue[rank].append(group)
        self._activate_stream(rank)

    def _activate_stream(self, rank: int) -> None:
        job, time, active = self.job, self.time, self.active
        pending = [rank]
        while pending:
            r = pending.pop()
            queue = self.queue[r]
            head = self.head[r]
            while head < len(queue) and self.completed[queue[head]] is not None:
                head += 1
            self.head[r] = head
            if head >= len(queue) or active[queue[head]] is not None:
                continue
            group = queue[head]
            previous = self.completed[queue[head - 1]] if head > 0 else None
            issued = self.issued[group]
            mine = active[group] = max(issued, previous if previous is not None else issued)  # type: ignore[type-var]
            for op in job.group_ops(group):
                other = job.op_other[op]
                other_group = job.op_group[other]
                theirs = active[other_group]
                if time[op] is None and theirs is not None:
                    done = max(mine, theirs) + job.op_time[op]
                    self._set(op, done)
                    self._set(other, done)
                    if self._finish_group(other_group):
                        pending.append(job.group_rank[other_group])
            if self._finish_group(group):
                pending.append(r)

    def _finish_group(self, group: int) -> bool:
        if self.completed[group] is not None:
            return False
        ends = [self.time[op] for op in self.job.group_ops(group)]
        if None in ends:
            return False
        self.completed[group] = max(ends, default=self.active[group])  # type: ignore[type-var]
        return True

    # ------------------------------------------------------------------ records
    def _records(self) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        for rank in self.job.ranks:
            mine = self._thread_records(rank) + self._message_records(rank)
            mine.sort(key=lambda r: (r["start"], r["end"]))
            records += mine
        return records

    def _thread_records(self, rank: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        job = self.job
        timeline = iter(self.kept[rank])
        before = 0.0
        for k, after in zip(job.program[rank], self.marks[rank]):
            if k >= 0:
                start, end, step = next(timeline)
                if start > before:
                    out.append(_record(rank, self._waited_for(k, start), "p2p-wait", before, start))
                out.append(_record(rank, step, "compute", start, end))
            else:
                step = job.group_steps[-1 - k]
                out.append(_record(rank, step, "p2p-issue", before, before))
                if after > before:
                    out.append(_record(rank, step, "p2p-wait", before, after))
            before = after
        return out

    def _waited_for(self, k: int, start: float) -> str | MetaStep:
        """What compute step k, which started late, waited for: its first input that came last."""
        job = self.job
        step = job.steps[k]
        keys = [key for part in step.parts for key in consumes(part, self.num_stages)]
        for slot, key in enumerate(keys):
            cell = job.deps[slot][k]
            if self.time[cell] + job.adds[slot][k] == start:  # type: ignore[operator]
                return job.op_steps[cell] if job.received[slot][k] else producer_text(key)
        raise AssertionError(f"no input of {step} came at {start}")

    def _message_records(self, rank: int) -> list[dict[str, Any]]:
        job, time = self.job, self.time
        out = []
        for send in job.sends[rank]:
            recv = job.op_other[send]
            if time[recv] is None:
                continue
            send_group, recv_group = job.op_group[send], job.op_group[recv]
            start = max(self.active[send_group], self.active[recv_group]) if self.stream else self.issued[send_group]
            out.append(_record(rank, job.op_steps[send], "p2p", start, time[recv]))  # type: ignore[arg-type]
        return out


def _record(rank: int, step: MetaStep | str, kind: str, start: float, end: float) -> dict[str, Any]:
    return {"rank": rank, "step": str(step), "kind": kind, "start": start, "end": end}
