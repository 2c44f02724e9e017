# ruff: noqa
# The schedule generators (schedules/*.py), place_weights (schedules/_weights.py) and MetaStep's
# argument checks (ir/steps.py) as of commit d9e2615, before the generation speed-ups of branch
# gen-speed: the pre-speed-up code, kept unchanged as the oracle of test_generate_speed_equal.py.
# Do not edit. (Only the imports are gathered here, the module docstrings dropped and MetaStep
# renamed OldMetaStep, to compare the errors of its checks.)
"""Frozen pre-speed-up schedule generators: the oracle of ``test_generate_speed_equal.py``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hyper_parallel.core.pipeline_parallel.ir.placement import check_count, is_int, looped_placement
from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.schedules.overlap_pairs import fuse_overlap_pairs

_T = MetaStepType

# --- ir/steps.py: data flow ---

def consumes(part: MetaStep, num_stages: int) -> list[DataKey]:
    """Values a compute part (F/B/I/W) needs before it can run."""
    stage, micro, kind = part.stage_index, part.micro_index, part.meta_type
    if stage is None or micro is None:
        return []
    if kind is MetaStepType.FWD:
        return [("F", stage - 1, micro)] if stage > 0 else []
    if kind in (MetaStepType.BWD, MetaStepType.BWD_INPUT):
        needs = [("F", stage, micro)]
        if stage < num_stages - 1:
            needs.append(("G", stage + 1, micro))
        return needs
    if kind is MetaStepType.BWD_WEIGHT:
        return [("G", stage, micro)]
    return []


def produces(part: MetaStep) -> list[DataKey]:
    """Values a compute part (F/B/I/W) makes available once it finished."""
    stage, micro, kind = part.stage_index, part.micro_index, part.meta_type
    if stage is None or micro is None:
        return []
    if kind is MetaStepType.FWD:
        return [("F", stage, micro)]
    if kind is MetaStepType.BWD:
        return [("G", stage, micro), ("W", stage, micro)]
    if kind is MetaStepType.BWD_INPUT:
        return [("G", stage, micro)]
    if kind is MetaStepType.BWD_WEIGHT:
        return [("W", stage, micro)]
    return []


# --- ir/steps.py: MetaStep's checks ---

def _check_index(name: str, value: object) -> None:
    if value is not None and not is_int(value):
        raise TypeError(f"MetaStep.{name} must be an int or None, got {value!r}")


@dataclass(frozen=True, repr=False)
class OldMetaStep:
    """MetaStep's fields and __post_init__ checks before gen-speed (the errors to compare)."""

    micro_index: int | None
    meta_type: MetaStepType
    stage_index: int | None
    sub_steps: tuple[MetaStep, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.meta_type, MetaStepType):
            raise TypeError(f"MetaStep.meta_type must be a MetaStepType, got {self.meta_type!r}")
        micro, stage = self.micro_index, self.stage_index
        if not (micro is None or type(micro) is int):  # the common case without a call: millions are made
            _check_index("micro_index", micro)
        if not (stage is None or type(stage) is int):
            _check_index("stage_index", stage)
        if self.sub_steps is not None:
            subs = tuple(self.sub_steps)
            for sub in subs:
                if not isinstance(sub, MetaStep):
                    raise TypeError(f"MetaStep.sub_steps must hold MetaSteps, got {sub!r}")
            object.__setattr__(self, "sub_steps", subs)


# --- schedules/_common.py ---

def fwd(stage: int, micro: int) -> MetaStep:
    """Forward of ``micro`` on ``stage``."""
    return MetaStep(micro, MetaStepType.FWD, stage)


def bwd(stage: int, micro: int) -> MetaStep:
    """Full backward of ``micro`` on ``stage``."""
    return MetaStep(micro, MetaStepType.BWD, stage)


def one_f_one_b(forwards: list[MetaStep], backwards: list[MetaStep], warmup: int) -> list[MetaStep]:
    """``warmup`` forwards, then pairs (next forward, next backward), then the remaining
    backwards. Forwards and backwards keep their given order."""
    if len(forwards) != len(backwards):
        raise ValueError(f"{len(forwards)} forwards but {len(backwards)} backwards")
    warmup = min(warmup, len(forwards))
    steps = list(forwards[:warmup])
    for k in range(len(forwards) - warmup):
        steps += [forwards[warmup + k], backwards[k]]
    steps += backwards[len(forwards) - warmup :]
    return steps


# --- schedules/_weights.py ---

def input_backward(stage: int, micro: int) -> MetaStep:
    """Input-gradient backward (``I``) of ``micro`` on ``stage``."""
    return MetaStep(micro, _T.BWD_INPUT, stage)


def weight_backward(stage: int, micro: int) -> MetaStep:
    """Weight-gradient backward (``W``) of ``micro`` on ``stage``."""
    return MetaStep(micro, _T.BWD_WEIGHT, stage)


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


# --- schedules/gpipe.py ---

def generate_gpipe(num_ranks: int, num_microbatches: int) -> dict[int, list[MetaStep | None]]:
    """Stage r on rank r: forwards of micro-batches 0..m-1, then their backwards 0..m-1."""
    p = check_count("num_ranks", num_ranks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    return {
        r: [fwd(r, i) for i in range(m)] + [bwd(r, i) for i in range(m)]
        for r in range(p)
    }


# --- schedules/one_f_one_b.py ---

def generate_1f1b(num_ranks: int, num_microbatches: int) -> dict[int, list[MetaStep | None]]:
    """Stage r on rank r. Rank r warms up with min(m, p - r - 1) forwards, so it never holds
    more than min(m, p - r) micro-batches forwarded but not yet backwarded."""
    p = check_count("num_ranks", num_ranks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    schedule: dict[int, list[MetaStep | None]] = {}
    for r in range(p):
        forwards = [fwd(r, i) for i in range(m)]
        backwards = [bwd(r, i) for i in range(m)]
        schedule[r] = list(one_f_one_b(forwards, backwards, warmup=p - r - 1))
    return schedule


# --- schedules/interleaved_1f1b.py ---

def microbatch_rounds(num_ranks: int, num_microbatches: int) -> list[range]:
    """Consecutive rounds of ``num_ranks`` micro-batches; the last may be shorter."""
    p, m = num_ranks, num_microbatches
    return [range(start, min(start + p, m)) for start in range(0, m, p)]


def interleaved_warmup(num_ranks: int, num_chunks: int, num_microbatches: int, rank: int) -> int:
    """Number of warm-up forwards of ``rank`` (see the module docstring)."""
    p, v, m = num_ranks, num_chunks, num_microbatches
    shortest = min(len(rnd) for rnd in microbatch_rounds(p, m))
    return min(v * m, (v - 1) * p + min(2 * (p - 1 - rank), p + shortest))


def generate_interleaved_1f1b(
    num_ranks: int, num_chunks: int, num_microbatches: int, overlap_b_f: bool = False
) -> dict[int, list[MetaStep | None]]:
    """Interleaved 1F1B with stage ``c * p + r`` on rank r; any m >= 1, v >= 2.

    With ``overlap_b_f`` the steady state's pairs of a backward and the next forward of another
    chunk become ``OVERLAP_B_F`` steps (``overlap_pairs.fuse_overlap_pairs``)."""
    p = check_count("num_ranks", num_ranks, 1)
    v = check_count("num_chunks", num_chunks, 2)
    m = check_count("num_microbatches", num_microbatches, 1)
    rounds = microbatch_rounds(p, m)
    schedule: dict[int, list[MetaStep | None]] = {}
    for r in range(p):
        forwards = [fwd(c * p + r, i) for rnd in rounds for c in range(v) for i in rnd]
        backwards = [bwd(c * p + r, i) for rnd in rounds for c in reversed(range(v)) for i in rnd]
        schedule[r] = list(one_f_one_b(forwards, backwards, interleaved_warmup(p, v, m, r)))
    if overlap_b_f:
        return fuse_overlap_pairs(schedule, looped_placement(p, v))
    return schedule


# --- schedules/looped_bfs.py ---

def generate_looped_bfs(
    num_ranks: int, num_chunks: int, num_microbatches: int
) -> dict[int, list[MetaStep | None]]:
    """Looped placement (stage c*p + r on rank r). Chunks 0..v-1 each forward all
    micro-batches, then chunks v-1..0 each backward all micro-batches."""
    p = check_count("num_ranks", num_ranks, 1)
    v = check_count("num_chunks", num_chunks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    schedule: dict[int, list[MetaStep | None]] = {}
    for r in range(p):
        forwards = [fwd(c * p + r, i) for c in range(v) for i in range(m)]
        backwards = [bwd(c * p + r, i) for c in reversed(range(v)) for i in range(m)]
        schedule[r] = forwards + backwards
    return schedule


# --- schedules/interleaved_zero_bubble.py ---

def generate_interleaved_zero_bubble(
    num_ranks: int, num_chunks: int, num_microbatches: int
) -> dict[int, list[MetaStep | None]]:
    """ZB-H1 style schedule with stage ``c * p + r`` on rank r; any p, v >= 1, m >= 1."""
    p = check_count("num_ranks", num_ranks, 1)
    v = check_count("num_chunks", num_chunks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    rounds = microbatch_rounds(p, m)
    orders: dict[int, list[MetaStep]] = {}
    for r in range(p):
        forwards = [fwd(c * p + r, i) for rnd in rounds for c in range(v) for i in rnd]
        inputs = [input_backward(c * p + r, i) for rnd in rounds for c in reversed(range(v)) for i in rnd]
        warmup = min(len(forwards), v * p - r)
        steps = forwards[:warmup]
        later = forwards[warmup:]
        for k, step in enumerate(inputs):
            steps.append(step)
            if k < len(later):
                steps.append(later[k])
        orders[r] = steps
    return place_weights(orders, v * p, dict.fromkeys(range(p), v * p))


# --- schedules/zbv.py ---

def generate_zbv_zero_bubble(num_ranks: int, num_microbatches: int) -> dict[int, list[MetaStep | None]]:
    """ZB-V with stages r and 2p-1-r on rank r; any p >= 1, m >= 1."""
    p = check_count("num_ranks", num_ranks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    orders = {r: _rank_order(p, m, r) for r in range(p)}
    return place_weights(orders, 2 * p, dict.fromkeys(range(p), 2 * p))


def _rank_order(p: int, m: int, r: int) -> list[MetaStep]:
    """The F/I order of rank r (see the module docstring)."""
    chunk = (r, 2 * p - 1 - r)
    queues = {
        ("F", c): deque(fwd(chunk[c], i) for i in range(m)) for c in (0, 1)
    } | {("I", c): deque(input_backward(chunk[c], i) for i in range(m)) for c in (0, 1)}
    steps: list[MetaStep] = []

    def take(*names: tuple[str, int]) -> None:
        for name in names:
            if queues[name]:
                steps.append(queues[name].popleft())

    f0, f1, i0, i1 = ("F", 0), ("F", 1), ("I", 0), ("I", 1)
    for _ in range(2 * (p - r) - 1):
        take(f0)
    for _ in range(r):
        take(f1, f0)
    for _ in range(p - r):
        take(f1, i1)
    while queues[f0] or queues[f1]:
        take(f0, i0, f1, i1)
    while queues[i0] or queues[i1]:
        take(i0, i1)
    return steps


# --- schedules/dualpipe_v.py ---

def generate_dualpipe_v(num_ranks: int, num_microbatches: int) -> dict[int, list[MetaStep | None]]:
    """DualPipeV with stages r and 2p-1-r on rank r; any p >= 1, m >= 2p."""
    p = check_count("num_ranks", num_ranks, 1)
    m = check_count("num_microbatches", num_microbatches, 1)
    if m < 2 * p:
        raise ValueError(
            f"DualPipeV needs at least 2 * num_ranks = {2 * p} micro-batches with {p} ranks, got {m}"
        )
    return {r: _RankSteps(p, r).build(m) for r in range(p)}


def overlap_b_f(backward: MetaStep, forward: MetaStep) -> MetaStep:
    """One ``OVERLAP_B_F`` step: ``backward`` (B or I) of one micro-batch, ``forward`` of another."""
    return MetaStep(None, MetaStepType.OVERLAP_B_F, None, (backward, forward))


class _RankSteps:
    """The list of one rank, built phase by phase; tracks the next micro-batch of each kind."""

    def __init__(self, num_ranks: int, rank: int) -> None:
        self.p, self.r = num_ranks, rank
        self.stages = (rank, 2 * num_ranks - 1 - rank)
        self.next_forward = [0, 0]
        self.next_backward = [0, 0]
        self.weights: deque[MetaStep] = deque()
        self.steps: list[MetaStep | None] = []

    def f(self, chunk: int) -> MetaStep:
        micro = self.next_forward[chunk]
        self.next_forward[chunk] += 1
        return fwd(self.stages[chunk], micro)

    def b(self, chunk: int, split: bool = False) -> MetaStep:
        """Full backward, or (``split``) its input half with the weight half left pending."""
        stage, micro = self.stages[chunk], self.next_backward[chunk]
        self.next_backward[chunk] += 1
        if not split:
            return bwd(stage, micro)
        self.weights.append(weight_backward(stage, micro))
        return input_backward(stage, micro)

    def w(self) -> MetaStep:
        return self.weights.popleft()

    def build(self, m: int) -> list[MetaStep | None]:
        p, r, add = self.p, self.r, self.steps.extend
        for _ in range(2 * (p - r - 1)):
            add([self.f(0)])
        for _ in range(r + 1):
            add([self.f(0), self.f(1)])
        for _ in range(p - r - 1):
            add([self.b(1, split=True), self.w(), self.f(1)])
        for k in range(m - 2 * p + r + 1):
            if k == 0 and r == p - 1:
                add([self.f(0), self.b(1)])
            else:
                add([overlap_b_f(self.b(1), self.f(0))])
            add([overlap_b_f(self.b(0), self.f(1))])
        for _ in range(p - r - 1):
            add([self.b(1), overlap_b_f(self.b(0), self.f(1))])
        split = False
        for k in range(r + 1):
            split |= k == (r + 1) // 2 and r % 2 == 1
            add([self.b(1, split)])
            split |= k == (r + 1) // 2 and r % 2 == 0
            add([self.b(0, split)])
        for _ in range(p - r - 1):
            add([self.w(), self.b(0, split=True)])
        for _ in range(r + 1):
            add([self.w()])
        assert self.next_forward == [m, m] and self.next_backward == [m, m] and not self.weights
        return self.steps
