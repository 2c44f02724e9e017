"""MPipe transpose, the plan: who preprocesses which micro-batch, and where its steps go.

Pure Python (no tensors). With ``p`` pipeline ranks and ``m`` micro-batches there are
``NT = min(p, m)`` owners: micro-batch ``j`` is owned by pipeline rank ``j % NT``
(``overflow_mode="full"``), or by rank ``j`` for ``j < NT`` and by rank 0 (stage 0's rank) for
the overflow ``j >= NT`` (``"min"``). The owner runs the preprocess of ``j`` (``PF.m<j>``) and,
unless it is stage 0's rank, sends what it made to stage 0's rank (``SEND_P`` / ``RECV_P``). In
training a trainable preprocess gets its backward (``PB``): on stage 0's rank, recomputed from
the shipped inputs (``backward="recompute"``), or on the owner from its kept graph, the gradient
coming back in ``SEND_PG`` / ``RECV_PG`` (``backward="owner"``).

Where the steps go in the lowered lists of the body schedule (`insert_mpipe_steps`):

- stage 0's rank: the preprocess of its own micro-batch 0 first of all (the shapes of every
  message it receives are those of micro-batch 0), that of any other micro-batch it owns right
  before the stage-0 forward that consumes it, as the plain pipeline does; a receive as early as
  the first-in-first-out order of its channel allows; a preprocess backward, or the send of a
  gradient to the owner, right after the stage-0 backward of that micro-batch;
- an owner: the micro-batch ``j < NT`` it owns first of all (its warm-up idle time); an overflow
  micro-batch (``"full"`` only) at the body position ``overflow_slots`` gives
  (``placement.py`` picks it from a timed run of the compute job), by default right before the
  owner's own chunk-0 forward of micro-batch ``j - NT``, a round ahead of stage 0's need;
  kept-graph backwards at the end of its list (the owner finishes its body steps before stage 0's
  rank does).

Messages between two ranks are matched first in, first out (gloo, NCCL, HCCL and LocalCluster
all do), so an MPipe message must sit at the same place among the body's messages of its pair of
ranks on both sides: a send goes earlier until its receive fits before its consumer.
`check_mpipe_steps` checks the result statically; ``model.py`` runs it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from hyper_parallel.core.pipeline_parallel.ir.steps import DataKey, MetaStep, MetaStepType, message_key
from hyper_parallel.core.pipeline_parallel.lowering.p2p import peer_rank
from hyper_parallel.core.pipeline_parallel.ir.placement import check_count, is_int
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError

OVERFLOW_MODES = ("full", "min")
BACKWARD_MODES = ("recompute", "owner")
_T = MetaStepType
MPIPE_TYPES = frozenset({_T.PRE_FWD, _T.PRE_BWD, _T.PRE_SEND, _T.PRE_RECV, _T.PRE_GRAD_SEND, _T.PRE_GRAD_RECV})
_KIND_ORDER = {_T.PRE_FWD: 0, _T.PRE_SEND: 1, _T.PRE_RECV: 2, _T.PRE_GRAD_RECV: 3, _T.PRE_BWD: 4,
               _T.PRE_GRAD_SEND: 5}
Lowered = dict[int, list[MetaStep]]


def check_overflow_mode(mode: object) -> str:
    if mode not in OVERFLOW_MODES:
        raise ValueError(f"overflow_mode must be one of {', '.join(map(repr, OVERFLOW_MODES))}, got {mode!r}")
    return mode  # type: ignore[return-value]


def num_owners(num_ranks: int, num_microbatches: int) -> int:
    """NT = min(p, m): how many pipeline ranks own a micro-batch of the first round."""
    return min(check_count("num_ranks", num_ranks, 1), check_count("num_microbatches", num_microbatches, 1))


def owner_of(micro: int, num_ranks: int, num_microbatches: int, overflow_mode: str = "full") -> int:
    """The pipeline rank that preprocesses micro-batch ``micro`` (see the module docstring)."""
    nt = num_owners(num_ranks, num_microbatches)
    check_overflow_mode(overflow_mode)
    if not is_int(micro) or not 0 <= micro < num_microbatches:
        raise ValueError(f"micro-batch index must be an int in [0, {num_microbatches}), got {micro!r}")
    if micro < nt or overflow_mode == "full":
        return micro % nt
    return 0


def owned_microbatches(pp_rank: int, num_ranks: int, num_microbatches: int, overflow_mode: str = "full") -> list[int]:
    """The micro-batches pipeline rank ``pp_rank`` owns, ascending (empty for a rank >= m)."""
    if not is_int(pp_rank) or not 0 <= pp_rank < num_ranks:
        raise ValueError(f"pp_rank must be an int in [0, {num_ranks}), got {pp_rank!r}")
    return [j for j in range(num_microbatches) if owner_of(j, num_ranks, num_microbatches, overflow_mode) == pp_rank]


def owned_sample_indices(pp_rank: int, num_ranks: int, num_microbatches: int, global_batch_size: int,
                         overflow_mode: str = "full", offset: int = 0) -> list[int]:
    """Indices (``offset`` + row of the global batch) of the samples of the micro-batches
    ``pp_rank`` owns, in micro-batch order: what its data loader reads for one step when the
    schedule is built with ``inputs="owned"``. Micro-batch ``j`` is rows ``j*b .. (j+1)*b - 1``
    with ``b = global_batch_size / num_microbatches``."""
    size = check_count("global_batch_size", global_batch_size, 1)
    if size % num_microbatches:
        raise ValueError(f"global_batch_size {size} does not divide into {num_microbatches} micro-batches")
    per = size // num_microbatches
    return [offset + j * per + k for j in owned_microbatches(pp_rank, num_ranks, num_microbatches, overflow_mode)
            for k in range(per)]


class MPipeBatchSampler:
    """Per training step, the dataset indices this pipeline rank reads under MPipe (a
    ``batch_sampler`` for ``torch.utils.data.DataLoader`` or any loader taking lists of indices).

    Step ``k`` covers the global batch ``[k * global_batch_size, (k + 1) * global_batch_size)``
    of ``dataset_size`` samples (an incomplete last batch is dropped); the rank gets the rows of
    the micro-batches it owns (`owned_sample_indices`). A rank that owns none gets ``[]``.
    """

    def __init__(self, dataset_size: int, global_batch_size: int, num_microbatches: int, num_ranks: int,
                 pp_rank: int, overflow_mode: str = "full") -> None:
        self.dataset_size = check_count("dataset_size", dataset_size, 0)
        self.global_batch_size = check_count("global_batch_size", global_batch_size, 1)
        self.num_microbatches = check_count("num_microbatches", num_microbatches, 1)
        self.num_ranks = check_count("num_ranks", num_ranks, 1)
        self.pp_rank = pp_rank
        self.overflow_mode = check_overflow_mode(overflow_mode)
        owned_sample_indices(pp_rank, num_ranks, num_microbatches, global_batch_size, overflow_mode)  # checks

    def __len__(self) -> int:
        return self.dataset_size // self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(len(self)):
            yield owned_sample_indices(self.pp_rank, self.num_ranks, self.num_microbatches, self.global_batch_size,
                                       self.overflow_mode, offset=step * self.global_batch_size)


@dataclass(frozen=True)
class MPipePlan:
    """What the MPipe steps of one schedule look like.

    ``transpose=False`` gives the plain pipeline's behaviour in the same terms (stage 0's rank
    preprocesses every micro-batch right before its stage-0 forward): the baseline of the
    simulator. ``compute=False`` is the dataload-only mode (``num_transpose_layers=0``: the
    owners ship their raw inputs). ``backward`` is ``None`` (a frozen preprocess, dataload only,
    or an evaluation pass), ``"recompute"`` or ``"owner"``. ``ship_inputs``: the raw inputs travel
    with the preprocess outputs (recompute on stage 0's rank, which does not have them).
    """

    num_ranks: int
    num_microbatches: int
    overflow_mode: str = "full"
    transpose: bool = True
    compute: bool = True
    backward: str | None = None
    ship_inputs: bool = False

    def __post_init__(self) -> None:
        check_count("num_ranks", self.num_ranks, 1)
        check_count("num_microbatches", self.num_microbatches, 1)
        check_overflow_mode(self.overflow_mode)
        if self.backward is not None and self.backward not in BACKWARD_MODES:
            raise ValueError(f"backward must be None or one of {BACKWARD_MODES}, got {self.backward!r}")
        if self.backward is not None and not self.compute:
            raise ValueError("a dataload-only plan (compute=False) has no preprocess backward")

    @property
    def num_owners(self) -> int:
        return num_owners(self.num_ranks, self.num_microbatches) if self.transpose else 1

    def owner(self, micro: int) -> int:
        if not self.transpose:
            return 0
        return owner_of(micro, self.num_ranks, self.num_microbatches, self.overflow_mode)

    def owned(self, pp_rank: int) -> list[int]:
        return [j for j in range(self.num_microbatches) if self.owner(j) == pp_rank]

    def with_backward(self, forward_only: bool) -> MPipePlan:
        """The plan of an evaluation pass (no backward) or of training (this plan)."""
        if not forward_only or self.backward is None:
            return self
        return MPipePlan(self.num_ranks, self.num_microbatches, self.overflow_mode, self.transpose, self.compute,
                         None, self.ship_inputs)


FEATURE = "P"  # DataKey kind of the stage-0 inputs of a micro-batch (made by PF)
FEATURE_GRAD = "D"  # DataKey kind of their gradient (made by stage 0's backward)


def mpipe_key(step: MetaStep) -> DataKey | None:
    """The value an MPipe send/recv carries: ``("P", 0, j)`` or ``("D", 0, j)``."""
    kind = step.meta_type
    if kind in (_T.PRE_SEND, _T.PRE_RECV):
        return (FEATURE, 0, step.micro_index)
    if kind in (_T.PRE_GRAD_SEND, _T.PRE_GRAD_RECV):
        return (FEATURE_GRAD, 0, step.micro_index)
    return None


def channel_ops(step: MetaStep, stage_to_rank: dict[int, int], plan: MPipePlan) -> list[tuple[bool, int, DataKey]]:
    """(is send, peer rank, message) of every data-channel operation of a step (metadata, which
    travels on a channel of its own, left out)."""
    kind = step.meta_type
    zero = stage_to_rank[0]
    if kind in (_T.PRE_SEND, _T.PRE_GRAD_RECV):
        return [(kind is _T.PRE_SEND, zero, mpipe_key(step))]  # type: ignore[list-item]
    if kind in (_T.PRE_RECV, _T.PRE_GRAD_SEND):
        return [(kind is _T.PRE_GRAD_SEND, plan.owner(step.micro_index), mpipe_key(step))]  # type: ignore[list-item]
    out = []
    for op in step.comm_parts:
        if op.meta_type.is_meta:
            continue
        out.append((op.meta_type.is_send, peer_rank(op, stage_to_rank), message_key(op)))
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------------- insertion


def _index(steps: list[MetaStep], kinds: tuple[MetaStepType, ...], stage: int) -> dict[int, int]:
    """micro -> position of the step of one of ``kinds`` on ``stage`` (compute parts looked into)."""
    found: dict[int, int] = {}
    for k, step in enumerate(steps):
        for part in step.parts:
            if part.meta_type in kinds and part.stage_index == stage:
                found.setdefault(part.micro_index, k)
    return found


def _body_channels(steps: Lowered, stage_to_rank: dict[int, int], plan: MPipePlan
                   ) -> tuple[dict[tuple[int, int], list[int]], dict[tuple[int, int], list[int]]]:
    """(src, dst) -> positions of the body's data sends on src / receives on dst, in list order."""
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, items in steps.items():
        for k, step in enumerate(items):
            for is_send, peer, _ in channel_ops(step, stage_to_rank, plan):
                (sends[(rank, peer)] if is_send else recvs[(peer, rank)]).append(k)
    return sends, recvs


def _fifo_slot(send_slot: int, sends: list[int], recvs: list[int], deadline: int) -> tuple[int, int]:
    """Move a send (inserted before body position ``send_slot`` of its rank) earlier until its
    receive, at the matching place among the body's receives of the pair, comes no later than
    ``deadline``; returns (send slot, receive slot)."""
    while True:
        before = bisect_left(sends, send_slot)  # sends are in list order
        recv_slot = 0 if before == 0 else recvs[before - 1] + 1
        if recv_slot <= deadline:
            return send_slot, recv_slot
        send_slot = sends[before - 1]


def overflow_micros(plan: MPipePlan, zero: int = 0) -> list[int]:
    """The micro-batches of the second and later rounds that a rank other than stage 0's owns."""
    return [j for j in range(plan.num_owners, plan.num_microbatches) if plan.owner(j) != zero]


def insert_mpipe_steps(lowered: Lowered, stage_to_rank: dict[int, int], plan: MPipePlan,
                       forward_only: bool = False, overflow_slots: dict[int, int] | None = None,
                       partial: bool = False) -> Lowered:
    """The lowered body lists with the MPipe steps of ``plan`` inserted (see the module docstring).

    ``overflow_slots`` may choose where an overflow micro-batch's preprocess goes on its owner
    (before that body position; the FIFO rule may still move it earlier); ``placement.py``
    chooses them from a timed run. ``partial``: ``lowered`` holds some ranks only, stage 0's
    among them, and only the lists given are made. An owner's list is right when stage 0's is
    given; stage 0's list is right only when every rank it exchanges body messages with is
    given (the MPipe receives from a rank left out go first, as if its channel had no body
    message).
    """
    plan = plan.with_backward(forward_only)
    overflow_slots = overflow_slots or {}
    steps = {rank: [s for s in items if s is not None] for rank, items in lowered.items()}
    zero = stage_to_rank[0]
    m, nt = plan.num_microbatches, plan.num_owners
    if (zero not in steps or not set(steps) <= set(range(plan.num_ranks))) if partial \
            else sorted(steps) != list(range(plan.num_ranks)):
        raise ValueError(f"the plan is for {plan.num_ranks} ranks, the schedule has ranks {sorted(steps)}")
    forwards = _index(steps[zero], (_T.FWD,), 0)
    backwards = _index(steps[zero], (_T.BWD, _T.BWD_INPUT), 0)
    missing = [j for j in range(m) if j not in forwards or (plan.backward and j not in backwards)]
    if missing:
        raise ValueError(f"stage 0 has no forward (or backward) of micro-batch(es) {missing} on rank {zero}")
    sends, recvs = _body_channels(steps, stage_to_rank, plan)
    inserts: dict[int, list[tuple[int, int, int, MetaStep]]] = {rank: [] for rank in steps}

    def put(rank: int, slot: int, kind: MetaStepType, micro: int) -> None:
        if rank in inserts:
            inserts[rank].append((slot, micro, _KIND_ORDER[kind], MetaStep(micro, kind, None)))

    first_local = min(plan.owned(zero))  # always 0: micro-batch 0 is stage 0's rank's own
    pf_slot: dict[int, int] = {}
    own_forwards: dict[int, dict[int, int]] = {}  # owner -> its first chunk's forward positions
    for j in range(m):
        owner = plan.owner(j)
        if owner == zero:
            pf_slot[j] = 0 if j == first_local else forwards[j]
        elif owner not in steps:
            put(zero, 0, _T.PRE_RECV, j)  # no body message from that owner comes before it
        elif j < nt:
            pf_slot[j] = 0
        elif j in overflow_slots:
            pf_slot[j] = overflow_slots[j]
        else:  # overflow of "full": a round ahead, before the owner's chunk-0 forward of j - NT
            if owner not in own_forwards:
                own_forwards[owner] = _index(steps[owner], (_T.FWD,),
                                             min(s for s, r in stage_to_rank.items() if r == owner))
            pf_slot[j] = own_forwards[owner][j - nt]
    for owner in steps:
        if owner == zero:
            continue
        mine = plan.owned(owner)
        pair_sends, pair_recvs = sends.get((owner, zero), []), recvs.get((owner, zero), [])
        for j in mine:
            pf_slot[j], _ = _fifo_slot(pf_slot[j], pair_sends, pair_recvs, forwards[j])
        for a, b in zip(reversed(mine[:-1]), reversed(mine[1:])):  # keep the owner's sends in micro order
            pf_slot[a] = min(pf_slot[a], pf_slot[b])
        for j in mine:
            _, recv_slot = _fifo_slot(pf_slot[j], pair_sends, pair_recvs, forwards[j])
            put(owner, pf_slot[j], _T.PRE_FWD, j)
            put(owner, pf_slot[j], _T.PRE_SEND, j)
            put(zero, recv_slot, _T.PRE_RECV, j)
    for j in plan.owned(zero):
        put(zero, pf_slot[j], _T.PRE_FWD, j)
    if plan.backward is not None:
        for j in range(m):
            owner = plan.owner(j)
            after_b = backwards[j] + 1
            if owner == zero or plan.backward == "recompute":
                put(zero, after_b, _T.PRE_BWD, j)
                continue
            put(zero, after_b, _T.PRE_GRAD_SEND, j)
            if owner not in steps:
                continue
            back = bisect_left(sends.get((zero, owner), []), after_b)  # body messages sent to it before
            pair_recvs = recvs.get((zero, owner), [])
            slot = max(pf_slot[j], pair_recvs[back - 1] + 1 if back else 0)
            if back < len(pair_recvs) and slot > pair_recvs[back]:
                raise ScheduleError(
                    f"MPipe: rank {owner} must post RECV_PG.m{j} after PF.m{j} and before its receive of body message "
                    f"#{back + 1} from rank {zero}, which comes first", lowered, [])
            put(owner, slot, _T.PRE_GRAD_RECV, j)
            put(owner, len(steps[owner]), _T.PRE_BWD, j)
    out: Lowered = {}
    for rank, items in steps.items():
        extra = sorted(inserts[rank], key=lambda e: e[:3])
        merged: list[MetaStep] = []
        k = 0
        for slot, _, _, step in extra:
            while k < slot:
                merged.append(items[k])
                k += 1
            merged.append(step)
        merged.extend(items[k:])
        out[rank] = merged
    return out


# ---------------------------------------------------------------------- static checks


def check_mpipe_steps(lowered: Lowered, stage_to_rank: dict[int, int], plan: MPipePlan,
                      forward_only: bool = False) -> None:
    """Raise ScheduleError (the step marked) unless every micro-batch has its MPipe steps on the
    right ranks, in an order the runtime can execute, and every pair of ranks sends and receives
    its messages (body and MPipe) in the same order."""
    plan = plan.with_backward(forward_only)
    zero = stage_to_rank[0]
    where: dict[tuple[MetaStepType, int], tuple[int, int]] = {}
    for rank, items in lowered.items():
        for k, step in enumerate(items):
            if step is None:
                continue
            if step.meta_type in MPIPE_TYPES:
                key = (step.meta_type, step.micro_index)
                if key in where:
                    raise ScheduleError(f"{step} appears twice", lowered, [where[key], (rank, k)])
                where[key] = (rank, k)
            for part in step.parts:
                if part.stage_index == 0 and part.meta_type in (_T.FWD, _T.BWD, _T.BWD_INPUT):
                    where[(part.meta_type if part.meta_type is _T.FWD else _T.BWD, part.micro_index)] = (rank, k)

    def at(kind: MetaStepType, j: int, rank: int) -> tuple[int, int]:
        pos = where.get((kind, j))
        if pos is None:
            raise ScheduleError(f"MPipe: {MetaStep(j, kind, None)} is missing (expected on rank {rank})", lowered, [])
        if pos[0] != rank:
            raise ScheduleError(f"MPipe: {MetaStep(j, kind, None)} is on rank {pos[0]}, expected rank {rank}",
                                lowered, [pos])
        return pos

    def before(a: tuple[int, int], b: tuple[int, int], what: str) -> None:
        if a[1] >= b[1]:
            raise ScheduleError(f"MPipe: {what}", lowered, [a, b])

    expected: set[tuple[MetaStepType, int]] = set()
    first_pf = at(_T.PRE_FWD, 0, zero)
    for j in range(plan.num_microbatches):
        owner = plan.owner(j)
        pf = at(_T.PRE_FWD, j, owner)
        fwd = where[(_T.FWD, j)]
        expected.add((_T.PRE_FWD, j))
        if owner == zero:
            before(pf, fwd, f"PF.m{j} must come before F.s0.m{j}")
        else:
            send, recv = at(_T.PRE_SEND, j, owner), at(_T.PRE_RECV, j, zero)
            expected |= {(_T.PRE_SEND, j), (_T.PRE_RECV, j)}
            before(pf, send, f"SEND_P.m{j} must follow PF.m{j}")
            before(recv, fwd, f"RECV_P.m{j} must come before F.s0.m{j}")
            before(first_pf, recv, f"RECV_P.m{j} needs the shapes of PF.m0 before it")
        if plan.backward is None:
            continue
        bwd = where[(_T.BWD, j)]
        expected.add((_T.PRE_BWD, j))
        if owner == zero or plan.backward == "recompute":
            before(bwd, at(_T.PRE_BWD, j, zero), f"PB.m{j} must follow the stage-0 backward of micro-batch {j}")
            continue
        gsend, grecv, pb = at(_T.PRE_GRAD_SEND, j, zero), at(_T.PRE_GRAD_RECV, j, owner), at(_T.PRE_BWD, j, owner)
        expected |= {(_T.PRE_GRAD_SEND, j), (_T.PRE_GRAD_RECV, j)}
        before(bwd, gsend, f"SEND_PG.m{j} must follow the stage-0 backward of micro-batch {j}")
        before(pf, grecv, f"RECV_PG.m{j} must follow PF.m{j}")
        before(grecv, pb, f"PB.m{j} must follow RECV_PG.m{j}")
    extra = sorted(set(k for k in where if k[0] in MPIPE_TYPES) - expected, key=lambda k: (k[1], k[0].code))
    if extra:
        kind, j = extra[0]
        raise ScheduleError(f"MPipe: {MetaStep(j, kind, None)} is not expected here", lowered, [where[extra[0]]])
    check_fifo(lowered, stage_to_rank, plan)


def check_fifo(lowered: Lowered, stage_to_rank: dict[int, int], plan: MPipePlan) -> None:
    """Every pair of ranks: the k-th data send from a to b carries what the k-th receive on b
    from a expects (body and MPipe messages together)."""
    order: dict[tuple[bool, int, int], list[tuple[DataKey, tuple[int, int]]]] = defaultdict(list)
    for rank, items in lowered.items():
        for k, step in enumerate(items):
            if step is None:
                continue
            for is_send, peer, key in channel_ops(step, stage_to_rank, plan):
                pair = (rank, peer) if is_send else (peer, rank)
                order[(is_send, *pair)].append((key, (rank, k)))
    for (is_send, src, dst), sent in sorted(order.items()):
        if not is_send:
            continue
        received = order.get((False, src, dst), [])
        for n, (a, b) in enumerate(zip(sent, received)):
            if a[0] != b[0]:
                raise ScheduleError(
                    f"MPipe: FIFO order from rank {src} to rank {dst}: send #{n + 1} carries {a[0]} but receive "
                    f"#{n + 1} expects {b[0]}", lowered, [a[1], b[1]])
        if len(sent) != len(received):
            raise ScheduleError(f"MPipe: rank {src} sends {len(sent)} messages to rank {dst}, which receives "
                                f"{len(received)}", lowered, [])
