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
from itertools import chain, compress
from operator import attrgetter

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


_TYPE = attrgetter("meta_type")
_STAGE = attrgetter("stage_index")
_MICRO = attrgetter("micro_index")
_SUBS = attrgetter("sub_steps")
_OTHER, _META = 7, 8
_STEP_CODE = {t: _OTHER for t in _T}  # per step type: 0-3 F/B/I/W, 4 OVERLAP, 5 send/recv, 6 BATCH, 7 other,
_STEP_CODE.update(_SIMPLE)  # 8 metadata send/recv
_STEP_CODE.update({_T.OVERLAP_B_F: 4, _T.OVERLAP_F_B: 4, _BATCH: 6})
_STEP_CODE.update({t: _META if t.is_meta else 5 for t in _MESSAGES})
assert {t for t, c in _STEP_CODE.items() if c in (5, 6, 8)} == {t for t in _T if t.is_comm}  # lowered = any of them
assert {t for t, c in _STEP_CODE.items() if c == _META} == {t for t in _T if t.is_meta}
_PART_CODE = {t: k for k, t in enumerate(_MESSAGES)}  # message part type -> row of the tables below
_TYPE_INDEX = {t: k for k, t in enumerate(_T)}  # a step's type read once, as a number: its code and row follow
_CODE_OF_TYPE = np.asarray([_STEP_CODE[t] for t in _T], dtype=np.int8)
_ROW_OF_TYPE = np.asarray([_PART_CODE.get(t, -1) for t in _T], dtype=np.int64)
_PART_KIND = np.asarray([_KIND_CODE[kind] for kind, _, _ in _MESSAGES.values()], dtype=np.int64)
_PART_SHIFT = np.asarray([shift for _, shift, _ in _MESSAGES.values()], dtype=np.int64)
_PART_SEND = np.asarray([send for _, _, send in _MESSAGES.values()], dtype=bool)
_NO_OPS: tuple[int, ...] = ()


@dataclass
class CompiledJob:
    """Flat programs per rank plus what the fast run needs about cells and messages.

    A communication step is a *group* ``g`` (its entry in a program is ``-1 - g``); its
    operations are the consecutive cells ``group_start[g] .. group_start[g + 1] - 1``."""

    ranks: list[int]
    program: dict[int, list[int]]
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
    group_steps: list[MetaStep] = field(default_factory=list)
    group_start: list[int] = field(default_factory=list)  # one more entry than groups
    group_meta: list[bool] = field(default_factory=list)
    group_blocking: list[tuple[int, ...]] = field(default_factory=list)  # the receives it waits for
    group_rank: list[int] = field(default_factory=list)
    sends: dict[int, list[int]] = field(default_factory=dict)  # rank -> its send cells in program order
    arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False)  # the same as numpy arrays
    listed: bool = False  # whether the list fields were filled from the arrays (`lists`)

    @property
    def num_ops(self) -> int:
        return len(self.op_steps)

    def lists(self) -> CompiledJob:
        """Fill the list fields from ``arrays`` (once): the general run reads them item by item; the
        chain run (``fast_chain.py``) reads the arrays and never needs them."""
        if self.listed:
            return self
        self.listed = True
        a = self.arrays
        self.deps, self.adds, self.received = a["deps"].tolist(), a["adds"].tolist(), a["received"].tolist()
        self.op_send, self.op_other = a["op_send"].tolist(), a["op_other"].tolist()
        self.op_time, self.op_group = a["op_time"].tolist(), a["op_group"].tolist()
        self.group_start, self.group_meta = a["group_start"].tolist(), a["group_meta"].tolist()
        self.group_rank = a["group_rank"].tolist()
        ends = self.ranks + [self.ranks[-1] + 1] if self.ranks else []
        bounds = np.searchsorted(a["entry_rank"], ends)
        sends = np.flatnonzero(a["op_send"])
        send_bounds = np.searchsorted(a["op_rank"][sends], ends)
        for k, rank in enumerate(self.ranks):
            self.program[rank] = a["entries"][bounds[k]:bounds[k + 1]].tolist()
            self.sends[rank] = sends[send_bounds[k]:send_bounds[k + 1]].tolist()
        return self

    def group_ops(self, group: int) -> range:
        return range(self.group_start[group], self.group_start[group + 1])


def compile_job(
    schedule: Schedule,
    stage_to_rank: dict[int, int],
    step_time: Callable[[MetaStep], float],
    link_time: Callable[[str, int], float],
    *,
    lowered: bool | None,
    wait_at_post: bool,
) -> CompiledJob | None:
    """The job as flat arrays (see the module docstring); None where the exact model must run.

    ``step_time(step)`` is a compute step's duration (for F, B, I and W it may depend only on
    the step's type and stage); ``link_time(kind, stage)`` the message time of every value
    ``(kind, stage, micro)``. ``lowered=None``: lowered when a step is a send/recv or BATCH."""
    try:
        return _Compiler(schedule, stage_to_rank, step_time, link_time, lowered, wait_at_post).run()
    except Unsupported:
        return None


def _ints(steps: list[MetaStep], field: attrgetter) -> np.ndarray:
    """A step index (``field``: ints, or None as -1) of every step as an int64 array; Unsupported
    where one is too large to pass through a float exactly (None becomes NaN there)."""
    try:  # nearly always plain ints: read straight into the array
        array = np.fromiter(map(field, steps), dtype=np.int64, count=len(steps))
    except (TypeError, ValueError, OverflowError):  # None (or an index an int64 cannot hold)
        return _ints_of(list(map(field, steps)))
    if array.size and (int(array.max()) >= 2 ** 52 or int(array.min()) <= -2 ** 52):
        raise Unsupported  # as below: the same indices are declined either way
    return array


def _ints_of(values: list) -> np.ndarray:
    """`_ints` of a list that may hold None."""
    array = np.asarray(values, dtype=np.float64)
    if array.size and np.nanmax(np.abs(array), initial=0.0) >= 2.0 ** 52:
        raise Unsupported
    return np.where(np.isnan(array), -1.0, array).astype(np.int64)


class _Compiler:
    def __init__(self, schedule: Schedule, stage_to_rank: dict[int, int], step_time: Callable[[MetaStep], float],
                 link_time: Callable[[str, int], float], lowered: bool | None, wait_at_post: bool) -> None:
        self.schedule = schedule
        self.num_stages = len(stage_to_rank)
        self.owner = [stage_to_rank.get(s) for s in range(self.num_stages)]
        self.step_time = step_time
        self.link_time = link_time
        self.lowered = lowered
        self.wait_at_post = wait_at_post
        # OVERLAP steps, worked out part by part: (step number, slot, key) consumed, (step number, key) made
        self.extra_wanted: list[tuple[int, int, int]] = []
        self.extra_made: list[tuple[int, int]] = []
        self.extra_durations: dict[int, float] = {}
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

    # ------------------------------------------------------------------ the lists, as arrays
    def _run(self) -> CompiledJob:
        job = CompiledJob(sorted(self.schedule), {})
        if not all(isinstance(r, (int, np.integer)) for r in (*job.ranks, *(o for o in self.owner if o is not None))):
            raise Unsupported  # rank ids the int arrays would change (0.2 and 0.4 both become 0)
        flat: list[MetaStep] = []
        bounds = [0]
        for rank in job.ranks:
            flat.extend(filter(None, self.schedule[rank]))  # a MetaStep is never falsy
            bounds.append(len(flat))
        total = len(flat)
        types = np.fromiter(map(_TYPE_INDEX.__getitem__, map(_TYPE, flat)), dtype=np.int8, count=total)
        codes = _CODE_OF_TYPE[types]
        rank_of = np.repeat(np.asarray(job.ranks, dtype=np.int64), np.diff(bounds))
        is_compute = codes <= 4
        is_comm = (codes == 5) | (codes == 6) | (codes == _META)
        compute_at = np.flatnonzero(is_compute)
        comm_at = np.flatnonzero(is_comm)
        if self.lowered is None:  # a send/recv or BATCH step: a lowered list
            self.lowered = bool(comm_at.size)
        if comm_at.size and not self.lowered:
            raise Unsupported
        entry = np.zeros(total, dtype=np.int64)
        entry[compute_at] = np.arange(compute_at.size)
        entry[comm_at] = -1 - np.arange(comm_at.size)
        kept = codes != _OTHER
        positions = np.flatnonzero(kept)  # where each program entry sits in `flat`
        entries = entry[positions]

        job.steps = list(compress(flat, is_compute.tolist()))
        compute_codes = codes[compute_at].astype(np.int64)
        compute_rank = rank_of[compute_at]
        job.group_steps = list(compress(flat, is_comm.tolist()))
        self._comms(job, codes, types, comm_at, rank_of)
        job.arrays.update(code=compute_codes, rank=compute_rank, entries=entries, entry_rank=rank_of[positions],
                          compute_entry=np.searchsorted(positions, compute_at),
                          group_entry=np.searchsorted(positions, comm_at))
        self._compute_arrays(job, compute_codes, compute_rank)
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

    def _comms(self, job: CompiledJob, codes: np.ndarray, types: np.ndarray, comm_at: np.ndarray,
               rank_of: np.ndarray) -> None:
        """The communication steps: their operations (cells), counterparts, message times."""
        comms = job.group_steps
        comm_codes = codes[comm_at]
        if np.all(comm_codes == 6):  # BATCH steps only: their sub-steps (None: none)
            parts_of = list(map(_SUBS, comms))
        elif np.any(comm_codes == 6):  # some: the others are their one operation
            parts_of = list(map(_SUBS, comms))
            for k in np.flatnonzero(comm_codes != 6).tolist():
                parts_of[k] = (comms[k],)
        else:  # no BATCH: every step is its one operation
            parts_of = None
        if parts_of is None:
            counts = np.ones(len(comms), dtype=np.int64)
            job.op_steps = parts = list(comms)
            row = _ROW_OF_TYPE[types[comm_at]]  # their types, read already
        else:
            if None in parts_of:  # a BATCH without sub-steps: no operations
                parts_of = [() if subs is None else subs for subs in parts_of]
            counts = np.fromiter(map(len, parts_of), dtype=np.int64, count=len(parts_of))
            job.op_steps = parts = list(chain.from_iterable(parts_of))
            try:
                row = np.fromiter(map(_PART_CODE.__getitem__, map(_TYPE, parts)), dtype=np.int64, count=len(parts))
            except KeyError:
                raise Unsupported from None  # no message: the exact model raises
        ops = len(parts)
        if np.any(row < 0):
            raise Unsupported
        stage = _ints(parts, _STAGE)
        micro = _ints(parts, _MICRO)
        if np.any(stage < 0) or np.any(micro < 0):
            raise Unsupported
        stages_total = self.num_stages
        kind, is_send = _PART_KIND[row], _PART_SEND[row]
        stage = stage + _PART_SHIFT[row]
        if np.any((stage < 0) | (stage >= stages_total)):
            raise Unsupported
        key = (micro * stages_total + stage) * 3 + kind
        group = np.repeat(np.arange(len(comms), dtype=np.int64), counts)
        op_rank = np.repeat(rank_of[comm_at], counts)
        group_meta = comm_codes == _META
        send_cells, recv_cells = np.flatnonzero(is_send), np.flatnonzero(~is_send)
        send_order = send_cells[np.argsort(key[send_cells], kind="stable")]
        recv_order = recv_cells[np.argsort(key[recv_cells], kind="stable")]
        send_keys, recv_keys = key[send_order], key[recv_order]
        for keys in (send_keys, recv_keys):
            if keys.size > 1 and np.any(keys[1:] == keys[:-1]):
                raise Unsupported  # sent or received twice
        if send_keys.size != recv_keys.size or np.any(send_keys != recv_keys):
            raise Unsupported  # a message without its counterpart
        consumer = np.where(kind[recv_order] == 1, stage[recv_order] - 1, stage[recv_order] + 1)
        if np.any((consumer < 0) | (consumer >= stages_total)):
            raise Unsupported
        owner = np.asarray(self.owner, dtype=np.int64)
        if np.any(owner[consumer] != op_rank[recv_order]):
            raise Unsupported
        if np.any(group_meta[group[send_order]] != group_meta[group[recv_order]]):
            raise Unsupported
        other = np.empty(ops, dtype=np.int64)
        other[send_order] = recv_order
        other[recv_order] = send_order
        links = np.asarray([[self._link(k, s) for k in "FGM"] for s in range(stages_total)], np.float64)
        start = np.zeros(len(comms) + 1, dtype=np.int64)
        np.cumsum(counts, out=start[1:])
        blocking = [_NO_OPS] * len(comms)
        waits = (group_meta | self.wait_at_post)[group] & ~is_send
        for g, op in zip(group[waits].tolist(), np.flatnonzero(waits).tolist()):
            blocking[g] += (op,)
        job.group_blocking = blocking
        self.recv_sorted, self.recv_cells = recv_keys, recv_order
        self.op_rank = op_rank
        job.arrays.update(op_group=group, op_other=other, op_send=is_send, op_time=links[stage, kind],
                          op_rank=op_rank, group_meta=group_meta, group_start=start, group_rank=rank_of[comm_at])

    # ------------------------------------------------------------------ compute steps, with numpy
    def _compute_arrays(self, job: CompiledJob, code: np.ndarray, rank: np.ndarray) -> None:
        count = len(job.steps)
        stages_total = self.num_stages
        simple = code < 4
        stage = _ints(job.steps, _STAGE)
        micro = _ints(job.steps, _MICRO)
        for number in np.flatnonzero(~simple).tolist():
            self._overlap(job.steps[number], number)
        stage[~simple] = 0
        micro[~simple] = 0
        if np.any(simple & ((stage < 0) | (stage >= stages_total) | (micro < 0))):
            raise Unsupported
        job.arrays.update(stage=stage, micro=micro)
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
        recv_sorted, recv_cells, op_rank = self.recv_sorted, self.recv_cells, self.op_rank

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
        job.arrays.update(deps=deps, adds=adds, received=received)

    def _keys(self, kind: int, stage: np.ndarray, micro: np.ndarray) -> np.ndarray:
        return (micro * self.num_stages + stage) * 3 + kind

    def _durations(self, job: CompiledJob, code: np.ndarray, stage: np.ndarray) -> list[float]:
        """``step_time`` once per (type, stage) of the F/B/I/W steps, per step for OVERLAP."""
        pair = code * self.num_stages + np.where(code < 4, stage, 0)
        kinds, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
        table = np.asarray([float(self.step_time(job.steps[k])) if kinds[j] < 4 * self.num_stages else 0.0
                            for j, k in enumerate(first.tolist())], dtype=np.float64)
        durations = table[inverse]
        for number, value in self.extra_durations.items():
            durations[number] = value
        job.arrays["durations"] = durations
        return durations.tolist()


def _lookup(sorted_keys: np.ndarray, values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``values`` of ``keys`` in a sorted key array; Unsupported when one is missing."""
    at = np.searchsorted(sorted_keys, keys)
    if np.any(at >= sorted_keys.size) or np.any(sorted_keys[np.minimum(at, sorted_keys.size - 1)] != keys):
        raise Unsupported  # a value nobody makes or receives here: the exact model reports the wait
    return values[at]
