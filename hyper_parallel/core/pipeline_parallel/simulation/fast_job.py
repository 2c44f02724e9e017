"""The step lists of all ranks compiled to flat arrays for the fast timed run (``fast_timed.py``).

Each time the timed model (``timed_model.py``) reads is given a *cell*: the completion of one
message operation (a send or receive part of a communication step; cells ``0 .. ops - 1``) or
the end of a compute step (compute step ``k`` has cell ``ops + k``). Compute step ``k`` needs the
values in its dep slots ``deps[j][k]`` (-1: none; at most three, in the order `ir.steps.consumes`
lists them): a value is there at ``time(cell) + adds[j][k]`` (``add`` the message time of a
value made on another rank, else 0), and ``received[j][k]`` tells whether the cell is a receive
(else the value's producer). A rank's program lists its compute steps by number ``k >= 0`` and
its communication steps as ``-1 - c``, ``c`` indexing `CompiledJob.comms`.

Everything the exact model would look up by key while it runs (producers, the receive of a
value on its rank, the counterpart of each send and receive, message and step times) is found
here once: keys are coded as ints ``(micro * stages + stage) * 3 + kind`` and matched with numpy.

`compile_job` returns None where the fast run would not be the exact model's: a value made or
sent twice, a message without its counterpart, a value nobody makes, a receive on another rank
than the one that consumes the value, metadata paired with a batched message, a step without
stage or micro-batch, indices or stages outside the placement, or any error the costs raise.
The exact model then runs instead (and raises or reports what it finds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hyper_parallel.core.pipeline_parallel.ir.steps import MetaStep, MetaStepType, Schedule, consumes, message_key

_T = MetaStepType
_KIND_CODE = {"F": 0, "G": 1, "M": 2}
_SIMPLE = {_T.FWD: 0, _T.BWD: 1, _T.BWD_INPUT: 2, _T.BWD_WEIGHT: 3}
_SLOTS = 3
_BATCH = _T.BATCH_SEND_RECV
_MESSAGES = {}  # step type -> (kind, stage shift, is a send), as in ir.steps.message_key
for _type in (_T.FWD_SEND, _T.FWD_RECV, _T.META_SEND, _T.META_RECV, _T.BWD_SEND, _T.BWD_RECV):
    _probe = message_key(MetaStep(0, _type, 1))
    if _probe is not None:
        _MESSAGES[_type] = (_probe[0], _probe[1] - 1, _type.is_send)


class Unsupported(Exception):
    """The job holds something the fast run does not model the way the exact model does."""


@dataclass
class Comm:
    """One communication step: its operations' cells, the receives it waits for, its group."""

    step: MetaStep
    ops: tuple[int, ...]
    is_meta: bool
    blocking: tuple[int, ...]
    group: int


@dataclass
class CompiledJob:
    """Flat programs per rank plus what the fast run needs about cells and messages."""

    ranks: list[int]
    program: dict[int, list[int]]
    comms: list[Comm] = field(default_factory=list)
    steps: list[MetaStep] = field(default_factory=list)  # compute step k
    durations: list[float] = field(default_factory=list)
    deps: list[list[int]] = field(default_factory=list)  # slot j -> cell per compute step (-1: none)
    adds: list[list[float]] = field(default_factory=list)
    received: list[list[bool]] = field(default_factory=list)
    # per message operation, indexed by its cell
    op_steps: list[MetaStep] = field(default_factory=list)
    op_send: list[bool] = field(default_factory=list)
    op_other: list[int] = field(default_factory=list)  # the counterpart's cell
    op_time: list[float] = field(default_factory=list)  # message time
    op_group: list[int] = field(default_factory=list)
    # per group (one per communication step)
    group_ops: list[tuple[int, ...]] = field(default_factory=list)
    group_rank: list[int] = field(default_factory=list)
    sends: dict[int, list[int]] = field(default_factory=dict)  # rank -> its send cells in program order

    @property
    def num_ops(self) -> int:
        return len(self.op_steps)


def compile_job(
    schedule: Schedule,
    stage_to_rank: dict[int, int],
    step_time: Callable[[MetaStep], float],
    link_time: Callable[[str, int], float],
    *,
    lowered: bool,
    wait_at_post: bool,
) -> CompiledJob | None:
    """The job as flat arrays (see the module docstring); None where the exact model must run.

    ``step_time(step)`` is a compute step's duration (for F, B, I and W it may depend only on
    the step's type and stage); ``link_time(kind, stage)`` the message time of every value
    ``(kind, stage, micro)``."""
    try:
        return _Compiler(schedule, stage_to_rank, step_time, link_time, lowered, wait_at_post).run()
    except Unsupported:
        return None


class _Compiler:
    def __init__(self, schedule: Schedule, stage_to_rank: dict[int, int], step_time: Callable[[MetaStep], float],
                 link_time: Callable[[str, int], float], lowered: bool, wait_at_post: bool) -> None:
        self.schedule = schedule
        self.num_stages = len(stage_to_rank)
        self.owner = [stage_to_rank.get(s) for s in range(self.num_stages)]
        self.step_time = step_time
        self.link_time = link_time
        self.lowered = lowered
        self.wait_at_post = wait_at_post
        # compute steps: simple type code (4: OVERLAP), stage, micro, rank
        self.codes: list[int] = []
        self.stages: list[int | None] = []
        self.micros: list[int | None] = []
        self.ranks_of: list[int] = []
        # OVERLAP steps, worked out part by part: (step number, slot, key) consumed, (step number, key) made
        self.extra_wanted: list[tuple[int, int, int]] = []
        self.extra_made: list[tuple[int, int]] = []
        self.extra_durations: dict[int, float] = {}
        self.send_of: dict[int, int] = {}  # message key -> send cell
        self.recv_of: dict[int, int] = {}  # message key -> receive cell
        self.op_rank: list[int] = []
        self.group_meta: list[bool] = []
        self.links: dict[tuple[str, int], float] = {}  # message time by (kind, stage)

    def run(self) -> CompiledJob:
        if None in self.owner:
            raise Unsupported  # stages are not numbered 0..n-1
        try:
            return self._run()
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
            raise Unsupported from exc  # a cost or an index the exact model reports in its own way

    def _link(self, kind: str, stage: int) -> float:
        found = self.links.get((kind, stage))
        if found is None:
            found = self.links[(kind, stage)] = float(self.link_time(kind, stage))
        return found

    def _key(self, kind: int, stage: int, micro: int) -> int:
        return (micro * self.num_stages + stage) * 3 + kind

    # ------------------------------------------------------------------ the pass over the lists
    def _run(self) -> CompiledJob:
        job = CompiledJob(sorted(self.schedule), {})
        for rank in job.ranks:
            program: list[int] = []
            job.program[rank] = program
            job.sends[rank] = []
            for step in self.schedule[rank]:
                if step is None:
                    continue
                kind = step.meta_type
                code = _SIMPLE.get(kind)
                if code is not None:
                    program.append(len(job.steps))
                    job.steps.append(step)
                    self.codes.append(code)
                    self.stages.append(step.stage_index)
                    self.micros.append(step.micro_index)
                    self.ranks_of.append(rank)
                elif kind.is_overlap:
                    program.append(len(job.steps))
                    self._overlap(step, len(job.steps))
                    job.steps.append(step)
                    self.codes.append(4)
                    self.stages.append(0)
                    self.micros.append(0)
                    self.ranks_of.append(rank)
                elif kind.is_comm:
                    if not self.lowered:
                        raise Unsupported
                    program.append(-1 - len(job.comms))
                    job.comms.append(self._comm(job, rank, step))
                # other steps (FSDP, swap, MPipe preprocess) take no time and leave no record
        self._match(job)
        self._compute_arrays(job)
        return job

    def _overlap(self, step: MetaStep, number: int) -> None:
        """What an OVERLAP step consumes and makes, part by part, in `consumes` order."""
        slot = 0
        for part in step.parts:
            stage, micro, kind = part.stage_index, part.micro_index, part.meta_type
            if stage is None or micro is None or not 0 <= stage < self.num_stages or micro < 0:
                raise Unsupported
            for key_kind, key_stage, _ in consumes(part, self.num_stages):
                self.extra_wanted.append((number, slot, self._key(_KIND_CODE[key_kind], key_stage, micro)))
                slot += 1
            if kind is _T.FWD:
                self.extra_made.append((number, self._key(0, stage, micro)))
            elif kind is _T.BWD or kind is _T.BWD_INPUT:
                self.extra_made.append((number, self._key(1, stage, micro)))
        if slot > _SLOTS:
            raise Unsupported
        self.extra_durations[number] = float(self.step_time(step))

    def _comm(self, job: CompiledJob, rank: int, step: MetaStep) -> Comm:
        group = len(job.group_ops)
        ops: list[int] = []
        blocking: list[int] = []
        is_meta = step.meta_type.is_meta
        parts = step.sub_steps or () if step.meta_type is _BATCH else (step,)
        stages_total = self.num_stages
        for part in parts:
            entry = _MESSAGES.get(part.meta_type)  # as ir.steps.message_key, without a call per part
            stage, micro = part.stage_index, part.micro_index
            if entry is None or stage is None or micro is None:
                raise Unsupported  # no message: the exact model raises
            kind, shift, is_send = entry
            stage += shift
            if not (0 <= stage < stages_total) or micro < 0:
                raise Unsupported
            code = (micro * stages_total + stage) * 3 + _KIND_CODE[kind]
            op = len(job.op_steps)
            table = self.send_of if is_send else self.recv_of
            if code in table:
                raise Unsupported  # sent or received twice
            table[code] = op
            job.op_steps.append(part)
            job.op_send.append(is_send)
            job.op_other.append(-1)
            job.op_time.append(self._link(kind, stage))
            job.op_group.append(group)
            self.op_rank.append(rank)
            ops.append(op)
            if is_send:
                job.sends[rank].append(op)
            elif is_meta or self.wait_at_post:
                blocking.append(op)
        job.group_ops.append(tuple(ops))
        job.group_rank.append(rank)
        self.group_meta.append(is_meta)
        return Comm(step, tuple(ops), is_meta, tuple(blocking), group)

    def _match(self, job: CompiledJob) -> None:
        """Pair every send with its receive (on the rank of the consuming stage)."""
        if len(self.send_of) != len(self.recv_of):
            raise Unsupported
        for code, send in self.send_of.items():
            recv = self.recv_of.get(code)
            if recv is None:
                raise Unsupported
            kind, stage = code % 3, code // 3 % self.num_stages
            consumer = stage - 1 if kind == 1 else stage + 1
            if not 0 <= consumer < self.num_stages or self.owner[consumer] != self.op_rank[recv]:
                raise Unsupported
            if self.group_meta[job.op_group[send]] != self.group_meta[job.op_group[recv]]:
                raise Unsupported
            job.op_other[send] = recv
            job.op_other[recv] = send

    # ------------------------------------------------------------------ compute steps, with numpy
    def _compute_arrays(self, job: CompiledJob) -> None:
        count = len(job.steps)
        stages_total = self.num_stages
        code = np.asarray(self.codes, dtype=np.int64)
        stage = np.asarray(self.stages, dtype=np.int64)  # TypeError (None) -> the exact model
        micro = np.asarray(self.micros, dtype=np.int64)
        rank = np.asarray(self.ranks_of, dtype=np.int64)
        simple = code < 4
        if np.any(simple & ((stage < 0) | (stage >= stages_total) | (micro < 0))):
            raise Unsupported
        number = np.arange(count, dtype=np.int64)
        base = job.num_ops
        job.durations = self._durations(job, code, stage)

        fwd, back, weight = simple & (code == 0), simple & ((code == 1) | (code == 2)), simple & (code == 3)
        made_at = np.concatenate([number[fwd], number[back], np.asarray([n for n, _ in self.extra_made], np.int64)])
        made_key = np.concatenate([self._keys(0, stage[fwd], micro[fwd]), self._keys(1, stage[back], micro[back]),
                                   np.asarray([k for _, k in self.extra_made], np.int64)])
        first = fwd & (stage > 0)
        tail = back & (stage < stages_total - 1)
        rows = [  # (step numbers, slot, keys)
            (number[first], 0, self._keys(0, stage[first] - 1, micro[first])),
            (number[back], 0, self._keys(0, stage[back], micro[back])),
            (number[weight], 0, self._keys(1, stage[weight], micro[weight])),
            (number[tail], 1, self._keys(1, stage[tail] + 1, micro[tail])),
        ]
        for slot in range(_SLOTS):
            extra = [(n, k) for n, s, k in self.extra_wanted if s == slot]
            rows.append((np.asarray([n for n, _ in extra], np.int64), slot, np.asarray([k for _, k in extra], np.int64)))

        order = np.argsort(made_key, kind="stable")
        made_sorted = made_key[order]
        if made_sorted.size > 1 and np.any(made_sorted[1:] == made_sorted[:-1]):
            raise Unsupported  # made twice: the exact model's answer depends on which comes first
        owner = np.asarray(self.owner, dtype=np.int64)
        links = np.asarray([[self._link(k, s) for k in "FGM"] for s in range(stages_total)], np.float64)
        recv_keys = np.asarray(list(self.recv_of), dtype=np.int64)
        recv_cells = np.asarray(list(self.recv_of.values()), dtype=np.int64)
        recv_order = np.argsort(recv_keys, kind="stable")
        recv_sorted, recv_cells = recv_keys[recv_order], recv_cells[recv_order]
        op_rank = np.asarray(self.op_rank, dtype=np.int64)

        deps = np.full((_SLOTS, count), -1, dtype=np.int64)
        adds = np.zeros((_SLOTS, count), dtype=np.float64)
        received = np.zeros((_SLOTS, count), dtype=bool)
        for at, slot, keys in rows:
            if at.size == 0:
                continue
            kind, key_stage = keys % 3, keys // 3 % stages_total
            remote = owner[key_stage] != rank[at] if self.lowered else np.zeros(at.size, dtype=bool)
            if np.any(remote):
                cells = _lookup(recv_sorted, recv_cells, keys[remote])
                if np.any(op_rank[cells] != rank[at[remote]]):
                    raise Unsupported  # received on another rank: the exact model reports the wait
                deps[slot, at[remote]] = cells
                received[slot, at[remote]] = True
            local = ~remote
            producer = _lookup(made_sorted, made_at[order], keys[local])
            deps[slot, at[local]] = producer + base
            elsewhere = rank[producer] != rank[at[local]]
            adds[slot, at[local]] = np.where(elsewhere, links[key_stage[local], kind[local]], 0.0)
        job.deps = deps.tolist()
        job.adds = adds.tolist()
        job.received = received.tolist()

    def _keys(self, kind: int, stage: np.ndarray, micro: np.ndarray) -> np.ndarray:
        return (micro * self.num_stages + stage) * 3 + kind

    def _durations(self, job: CompiledJob, code: np.ndarray, stage: np.ndarray) -> list[float]:
        """``step_time`` once per (type, stage) of the F/B/I/W steps, per step for OVERLAP."""
        pair = code * self.num_stages + np.where(code < 4, stage, 0)
        kinds, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
        table = np.asarray([float(self.step_time(job.steps[k])) if kinds[j] < 4 * self.num_stages else 0.0
                            for j, k in enumerate(first.tolist())], dtype=np.float64)
        durations = table[inverse].tolist()
        for number, value in self.extra_durations.items():
            durations[number] = value
        return durations


def _lookup(sorted_keys: np.ndarray, values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``values`` of ``keys`` in a sorted key array; Unsupported when one is missing."""
    at = np.searchsorted(sorted_keys, keys)
    if np.any(at >= sorted_keys.size) or np.any(sorted_keys[np.minimum(at, sorted_keys.size - 1)] != keys):
        raise Unsupported  # a value nobody makes or receives here: the exact model reports the wait
    return values[at]
