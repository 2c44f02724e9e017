"""Schedule validation that raises `ScheduleError` with a per-rank grid and the bad step marked.

`validate_compute` checks a compute-only schedule (placement, counts, order on each rank and
freedom from cross-rank cycles); `validate_lowered` checks a lowered schedule (the same, plus
send/recv pairing, FIFO order per rank pair, send/recv and metadata placement, and a whole-job
run of the job model of ``job_model.py`` with the communication semantics of the transport).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType, Schedule, message_key
from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc
from hyper_parallel.core.pipeline_parallel.lowering.job_model import known_to_finish, run_job
from hyper_parallel.core.pipeline_parallel.lowering.p2p import TRANSPORTS, counterpart, peer_rank
from hyper_parallel.core.pipeline_parallel.ir.placement import check_count

Pos = tuple[int, int]
"""(rank, index in that rank's list)."""

_T = MetaStepType
_BACKWARD = (_T.BWD, _T.BWD_INPUT)


class ScheduleError(ValueError):
    """An invalid schedule. ``reason`` says what is wrong and ``marks`` lists the (rank, index)
    of the offending steps; the message is the reason followed by the per-rank grid in which
    those steps are wrapped in ``>>...<<``."""

    def __init__(self, reason: str, schedule: Schedule, marks: Iterable[Pos] = ()) -> None:
        self.reason = reason
        self.schedule = schedule
        self.marks = tuple(marks)
        super().__init__(f"{reason}\n{format_grid(schedule, self.marks)}")


def format_grid(schedule: Schedule, marks: Iterable[Pos] = ()) -> str:
    """One line per rank with its step texts in aligned columns; idle = '.'; marked steps
    are shown as ``>>step<<``."""
    marked = set(marks)
    rows = []
    for rank in sorted(schedule):
        cells = ["." if step is None else str(step) for step in schedule[rank]]
        rows.append((rank, [f">>{c}<<" if (rank, k) in marked else c for k, c in enumerate(cells)]))
    ncols = max((len(cells) for _, cells in rows), default=0)
    widths = [max(len(cells[k]) for _, cells in rows if k < len(cells)) for k in range(ncols)]
    label = max((len(str(rank)) for rank, _ in rows), default=1)
    lines = []
    for rank, cells in rows:
        body = " ".join(cell.ljust(widths[k]) for k, cell in enumerate(cells))
        lines.append(f"rank {rank:>{label}} | {body}".rstrip())
    return "\n".join(lines)


def validate_compute(compute: Schedule, stage_to_rank: dict[int, int], num_microbatches: int) -> None:
    """Check a compute-only schedule; raise ScheduleError on the first problem."""
    checker = _Checker(compute, stage_to_rank, num_microbatches)
    checker.check_compute_steps(allow_comm=False)
    checker.check_counts()
    checker.check_progress(lowered=False)


def validate_lowered(
    lowered: Schedule,
    stage_to_rank: dict[int, int],
    num_microbatches: int,
    transport: str = "plain",
    forward_only: bool = False,
    engine: str | None = None,
) -> None:
    """Check a lowered schedule; raise ScheduleError on the first problem.

    ``engine`` picks the communication model of the whole-job run: ``"eager"`` (gloo,
    LocalCluster: a send never waits for its receive) or ``"stream"`` (NCCL/HCCL: a rank's
    operations run in order on one stream and a send completes when its receive is posted); by
    default ``"stream"`` for the ``batch`` transport and ``"eager"`` for ``plain``. The runtime
    waits for a data receive at the compute that consumes it. ``forward_only`` (an evaluation
    pass) needs no backward steps.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; valid transports: {', '.join(TRANSPORTS)}")
    with paused_gc():
        checker = _Checker(lowered, stage_to_rank, num_microbatches)
        checker.check_compute_steps(allow_comm=True)
        checker.check_counts(forward_only)
        checker.check_comm()
        if engine is None:
            engine = "stream" if transport == "batch" else "eager"
        checker.check_progress(lowered=True, model=engine)


def validate_schedule(schedule: Schedule, stage_to_rank: dict[int, int], num_microbatches: int) -> None:
    """`validate_lowered` if the schedule holds any send/recv step, else `validate_compute`."""
    lowered = any(s is not None and s.meta_type.is_comm for steps in schedule.values() for s in steps)
    check = validate_lowered if lowered else validate_compute
    check(schedule, stage_to_rank, num_microbatches)


def _checked_stage_map(stage_to_rank: dict[int, int]) -> dict[int, int]:
    stages = sorted(stage_to_rank)
    if stages != list(range(len(stages))) or not stages:
        raise ValueError(f"stage_to_rank must map stages 0..n-1 (n >= 1), got stages {stages}")
    return stage_to_rank


class _Checker:
    def __init__(self, schedule: Schedule, stage_to_rank: dict[int, int], num_microbatches: int):
        self.schedule = schedule
        self.stage_to_rank = _checked_stage_map(stage_to_rank)
        self.num_micro = check_count("num_microbatches", num_microbatches, 1)
        self.num_stages = len(stage_to_rank)
        self.where: dict[tuple[MetaStepType, int, int], Pos] = {}

    def fail(self, reason: str, *marks: Pos) -> None:
        raise ScheduleError(reason, self.schedule, marks)

    def entries(self) -> Iterator[tuple[int, int, MetaStep]]:
        for rank in sorted(self.schedule):
            for index, step in enumerate(self.schedule[rank]):
                if step is not None:
                    yield rank, index, step

    def seen(self, kind: MetaStepType, stage: int, micro: int) -> Pos | None:
        return self.where.get((kind, stage, micro))

    # --- compute steps -----------------------------------------------------------------------

    def check_compute_steps(self, allow_comm: bool) -> None:
        for rank, index, step in self.entries():
            pos = (rank, index)
            if step.meta_type.is_comm and not allow_comm:
                self.fail(f"{step} is a communication step in a compute-only schedule", pos)
            for op in step.comm_parts:
                if not (op.meta_type.is_send or op.meta_type.is_recv) or (
                    op.meta_type.is_meta and step.meta_type is _T.BATCH_SEND_RECV
                ):
                    self.fail(f"{step}: a BATCH may only hold data sends and recvs", pos)
            if not step.meta_type.is_compute:
                continue
            parts = self.parts_of(step, pos)
            for part in parts:
                self.check_place(part, rank, pos)
            for part in parts:
                self.check_order(part, rank, pos)
            for part in parts:
                self.where[(part.meta_type, part.stage_index, part.micro_index)] = pos

    def parts_of(self, step: MetaStep, pos: Pos) -> tuple[MetaStep, ...]:
        if not step.meta_type.is_overlap:
            if step.sub_steps:
                self.fail(f"{step}: F/B/I/W steps take no sub-steps", pos)
            return (step,)
        subs = step.sub_steps or ()
        forwards = [s for s in subs if s.meta_type is _T.FWD]
        backwards = [s for s in subs if s.meta_type in (*_BACKWARD, _T.BWD_WEIGHT)]
        if len(subs) != 2 or len(forwards) != 1 or len(backwards) != 1:
            self.fail(f"{step}: an OVERLAP step must hold one forward and one backward", pos)
        return subs

    def check_place(self, part: MetaStep, rank: int, pos: Pos) -> None:
        stage, micro = part.stage_index, part.micro_index
        if stage not in self.stage_to_rank:
            self.fail(f"{part}: unknown stage {stage} (stages are 0..{self.num_stages - 1})", pos)
        if micro is None or not 0 <= micro < self.num_micro:
            self.fail(f"{part}: micro-batch {micro} out of range 0..{self.num_micro - 1}", pos)
        owner = self.stage_to_rank[stage]
        if owner != rank:
            self.fail(f"{part} is on rank {rank} but stage {stage} belongs to rank {owner}", pos)

    def check_order(self, part: MetaStep, rank: int, pos: Pos) -> None:
        kind, s, i = part.meta_type, part.stage_index, part.micro_index
        local = self.stage_to_rank.get
        if kind is _T.FWD:
            if self.seen(_T.FWD, s, i):
                self.fail(f"{part} runs twice", self.seen(_T.FWD, s, i), pos)
            if s > 0 and local(s - 1) == rank and not self.seen(_T.FWD, s - 1, i):
                self.fail(f"{part} runs before F.s{s - 1}.m{i}, which feeds it on this rank", pos)
        elif kind in _BACKWARD:
            earlier = self.seen(_T.BWD, s, i) or self.seen(_T.BWD_INPUT, s, i)
            if earlier:
                self.fail(f"{part}: stage {s} already ran the backward of micro-batch {i}", earlier, pos)
            if not self.seen(_T.FWD, s, i):
                self.fail(f"{part} runs before its forward F.s{s}.m{i}", pos)
            nxt = s + 1
            if local(nxt) == rank and not (
                self.seen(_T.BWD, nxt, i) or self.seen(_T.BWD_INPUT, nxt, i)
            ):
                self.fail(f"{part} runs before the backward of stage {nxt}, which feeds it", pos)
        elif kind is _T.BWD_WEIGHT:
            if self.seen(_T.BWD_WEIGHT, s, i):
                self.fail(f"{part} runs twice", self.seen(_T.BWD_WEIGHT, s, i), pos)
            if self.seen(_T.BWD, s, i):
                self.fail(f"{part} follows a full backward B.s{s}.m{i}", self.seen(_T.BWD, s, i), pos)
            if not self.seen(_T.BWD_INPUT, s, i):
                self.fail(f"{part} runs before its I.s{s}.m{i}", pos)

    def check_counts(self, forward_only: bool = False) -> None:
        for s in range(self.num_stages):
            for i in range(self.num_micro):
                fwd = self.seen(_T.FWD, s, i)
                if fwd is None:
                    owner = self.stage_to_rank[s]
                    self.fail(f"F.s{s}.m{i} is missing (stage {s} is on rank {owner})")
                if forward_only:
                    continue
                if not (self.seen(_T.BWD, s, i) or self.seen(_T.BWD_INPUT, s, i)):
                    self.fail(f"F.s{s}.m{i} has no backward (B.s{s}.m{i}, or I and W)", fwd)
                split = self.seen(_T.BWD_INPUT, s, i)
                if split and not self.seen(_T.BWD_WEIGHT, s, i):
                    self.fail(f"I.s{s}.m{i} has no W.s{s}.m{i}", split)

    # --- communication -----------------------------------------------------------------------

    def check_comm(self) -> None:
        sends: dict[DataKey, tuple[Pos, MetaStep]] = {}
        recvs: dict[DataKey, tuple[Pos, MetaStep]] = {}
        order: dict[tuple[bool, int, int], list[tuple[DataKey, Pos, MetaStep]]] = defaultdict(list)
        for rank, index, step in self.entries():
            if not step.meta_type.is_comm:
                continue
            pos = (rank, index)
            for op in step.comm_parts:
                peer = self.check_op(op, rank, pos)
                is_send = op.meta_type.is_send
                table = sends if is_send else recvs
                key = message_key(op)
                if key in table:
                    self.fail(f"{op} appears twice", table[key][0], pos)
                table[key] = (pos, op)
                pair = (rank, peer) if is_send else (peer, rank)
                order[(is_send, op.meta_type.is_meta, *pair)].append((key, pos, op))
        for mine, other in ((sends, recvs), (recvs, sends)):
            for key, (pos, op) in mine.items():
                if key not in other:
                    peer = peer_rank(op, self.stage_to_rank)
                    self.fail(f"{op} has no matching {counterpart(op)} on rank {peer}", pos)
        self.check_fifo(order)
        self.check_op_placement(sends, recvs)

    def check_op(self, op: MetaStep, rank: int, pos: Pos) -> int:
        self.check_place(op, rank, pos)
        try:
            peer = peer_rank(op, self.stage_to_rank)
        except ValueError as exc:
            self.fail(str(exc), pos)
        if peer == rank:
            self.fail(f"{op} talks to its own rank {rank}; stages on one rank hand over directly", pos)
        return peer

    def check_fifo(self, order: dict) -> None:
        for (is_send, is_meta, src, dst), sent in sorted(order.items()):
            if not is_send:
                continue
            received = order.get((False, is_meta, src, dst), [])
            channel = "metadata" if is_meta else "data"
            for k, (sent_op, recv_op) in enumerate(zip(sent, received)):
                if sent_op[0] != recv_op[0]:
                    self.fail(
                        f"FIFO order violation from rank {src} to rank {dst}: {channel} send #{k + 1} is "
                        f"{sent_op[2]} but {channel} recv #{k + 1} is {recv_op[2]} (messages between two "
                        "ranks are matched in order)",
                        sent_op[1],
                        recv_op[1],
                    )

    def check_op_placement(self, sends: dict, recvs: dict) -> None:
        self.check_meta_placement(sends, recvs)
        for (pos, op) in sends.values():
            s, i = op.stage_index, op.micro_index
            kinds = _BACKWARD if op.meta_type is _T.BWD_SEND else (_T.FWD,)
            producer = next((self.seen(k, s, i) for k in kinds if self.seen(k, s, i)), None)
            if producer is None or producer[1] > pos[1]:
                marks = [pos] + ([producer] if producer else [])
                self.fail(f"{op} comes before the step that produces its data", *marks)
        for (pos, op) in recvs.values():
            s, i = op.stage_index, op.micro_index
            kinds = _BACKWARD if op.meta_type is _T.BWD_RECV else (_T.FWD,)
            consumer = next((self.seen(k, s, i) for k in kinds if self.seen(k, s, i)), None)
            if consumer is not None and consumer[1] < pos[1]:
                self.fail(f"{op} comes after the step that consumes its data", pos, consumer)
        for (kind, s, i), pos in self.where.items():
            if kind is _T.FWD and s > 0 and self.stage_to_rank[s - 1] != pos[0]:
                need = MetaStep(i, _T.FWD_RECV, s)
            elif kind in _BACKWARD and s + 1 < self.num_stages and self.stage_to_rank[s + 1] != pos[0]:
                need = MetaStep(i, _T.BWD_RECV, s)
            else:
                continue
            if message_key(need) not in recvs:
                self.fail(f"{self.schedule[pos[0]][pos[1]]} needs {need} before it", pos)

    def check_meta_placement(self, sends: dict, recvs: dict) -> None:
        """Shapes travel right before their data: a SEND_META no later than its SEND_F, a
        RECV_META in an earlier step than its RECV_F (the data buffer is made from it)."""
        for table, what in ((sends, "send"), (recvs, "receive")):
            for key, (pos, op) in table.items():
                if key[0] != "M":
                    continue
                data = table.get(("F", key[1], key[2]))
                if data is None:
                    self.fail(f"{op} has no data {what} of the same forward output on its rank", pos)
                if op.meta_type is _T.META_SEND and data[0][1] < pos[1]:
                    self.fail(f"{op} comes after {data[1]}, whose shapes it describes", pos, data[0])
                if op.meta_type is _T.META_RECV and data[0][1] <= pos[1]:
                    self.fail(f"{data[1]} needs its shapes from {op} in an earlier step", pos, data[0])

    # --- whole-job run -----------------------------------------------------------------------

    def check_progress(self, lowered: bool, model: str = "eager") -> None:
        """Run all ranks together in the job model; fail with every stuck rank marked."""
        if lowered and known_to_finish(self.schedule, self.stage_to_rank, model):
            return  # lowering's last run ran these very lists (job_model.known_to_finish)
        outcome = run_job(self.schedule, self.stage_to_rank, lowered=lowered, model=model)
        if outcome.finished:
            return
        marks = []
        lines = []
        for rank, (index, wait) in sorted(outcome.stuck.items()):
            position = self.position_of(rank, index)
            marks.append(position)
            step = self.schedule[rank][position[1]] if position[1] < len(self.schedule[rank]) else "its end"
            lines.append(f"  rank {rank} is stuck at {step}, waiting for {wait}")
        self.fail("deadlock: every unfinished rank is blocked\n" + "\n".join(lines), *marks)

    def position_of(self, rank: int, index: int) -> Pos:
        """(rank, position in the list with idle slots) of the index-th non-idle step."""
        seen = -1
        for k, step in enumerate(self.schedule[rank]):
            if step is not None:
                seen += 1
                if seen == index:
                    return (rank, k)
        return (rank, len(self.schedule[rank]) - 1)
