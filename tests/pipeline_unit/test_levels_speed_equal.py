"""The faster levels lowering (branch levels-speed) makes the very lists it made before.

``_levels_before.py`` is ``lowering/levels.py`` as of cd39060, running on ``_flow_before.py`` (the
flow as of the same commit), both unchanged. For every library schedule, p = 1..6, v = 1..4 where
the class takes it, m at its minimum and a few others (below, at and above p, not a multiple of
it), every metadata mode, with overlap pairs fused, forward steps only, shuffled (runnable or
stuck), cut, doubled and misplaced compute lists, random placements with greedy orders (stages of
one rank next to each other, sends to several ranks at one boundary) and steps whose stage is not
a plain int, ``lower_by_levels`` must give what the old one gives: None, the same error (type and
message), or lists EQUAL element by element, each step of the same class with fields of the same
types (sub-steps a tuple of the same). ``rank_list`` is compared rank by rank too, as ``plan_rank``
calls it (without the job's shared boundaries), and so is ``carried`` (``rank_checks`` reads it).
"""

from __future__ import annotations

import enum
import random

import _flow_before
import _levels_before as old
import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.ir.steps import unchecked_step
from hyper_parallel.core.pipeline_parallel.lowering import levels
from hyper_parallel.core.pipeline_parallel.lowering.flow import flow_of
from hyper_parallel.core.pipeline_parallel.schedule import _forwards_only
from hyper_parallel.core.pipeline_parallel.schedules.overlap_pairs import fuse_overlap_pairs
from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules

T = MetaStepType
METADATA = ("none", "first", "all")
CLASSES = sorted(available_schedules().values(), key=lambda cls: cls.__name__)


def _layout(step):
    """Everything about a step code could see: its class, its fields in ``__dict__`` order with
    their types, sub-steps the same way."""
    fields = []
    for name, value in vars(step).items():
        if name == "sub_steps" and value is not None:
            value = (type(value), tuple(_layout(sub) for sub in value))
        fields.append((name, type(value), value))
    return type(step), tuple(fields)


def _outcome(lowering, compute, placement, metadata):
    try:
        return lowering(compute, placement, metadata)
    except Exception as exc:  # any error: the same type and message from both
        return type(exc), str(exc)


def _assert_same_lists(got, want, where):
    assert type(got) is type(want), where
    if not isinstance(want, dict):
        assert got == want, where
        return
    assert list(got) == list(want), where
    for rank in want:
        assert type(got[rank]) is list and len(got[rank]) == len(want[rank]), (*where, rank)
        assert got[rank] == want[rank], (*where, rank)
        assert list(map(_layout, got[rank])) == list(map(_layout, want[rank])), (*where, rank)
        assert list(map(hash, got[rank])) == list(map(hash, want[rank])), (*where, rank)


def _assert_same(compute, placement, where, per_rank=True):
    """``lower_by_levels`` and, where the job runs, each rank's ``rank_list`` and ``carried``,
    against the old ones, for every metadata mode. Returns whether the job was lowered."""
    lowered = False
    for metadata in METADATA:
        got = _outcome(levels.lower_by_levels, compute, placement, metadata)
        want = _outcome(old.lower_by_levels, compute, placement, metadata)
        _assert_same_lists(got, want, (*where, metadata))
        lowered = lowered or isinstance(want, dict)
    if not per_rank or not lowered:
        return lowered
    m = 1 + max(step.micro_index for steps in compute.values() for step in steps  # as lower_by_levels
                if step is not None and type(step.micro_index) is int)
    flow, old_flow = flow_of(compute, placement, m, "none", False), _flow_before.flow_of(compute, placement, m, "none", False)
    level, old_level = flow.run(None, levels=True), old_flow.run(None, levels=True)
    assert level == old_level, where
    for metadata in METADATA:
        for rank in sorted(flow.items):
            got = _outcome(lambda *a: levels.rank_list(flow, rank, level, metadata), None, None, None)
            want = _outcome(lambda *a: old.rank_list(old_flow, rank, old_level, metadata), None, None, None)
            _assert_same_lists({rank: got} if isinstance(got, list) else got,
                               {rank: want} if isinstance(want, list) else want, (*where, metadata, rank))
            assert levels.carried(flow, level, metadata, rank) == old.carried(old_flow, old_level, metadata, rank)
    return lowered


def _configs(cls):
    for p in range(1, 7):
        for v in range(1, 5):
            if not cls.min_chunks <= v <= cls.max_chunks:
                continue
            low = cls.min_microbatches(p, v)
            for m in sorted({low, low + 1, p + 1, 2 * p + 3} - {0}):
                if m >= low and (p <= 4 or m in (low, 2 * p + 3)):
                    yield p, v, m


def _shuffled(compute, rng):
    """A few compute steps moved on one or two ranks: some lists still run, others get stuck."""
    out = {rank: list(steps) for rank, steps in compute.items()}
    for _ in range(rng.randint(1, 2)):
        steps = out[rng.choice(sorted(out))]
        if len(steps) > 1:
            k = rng.randrange(len(steps))
            steps.insert(max(0, min(len(steps) - 1, k + rng.randint(-3, 3))), steps.pop(k))
    return out


def _broken(compute, rng, m):
    """A step dropped, doubled, given to another rank or micro-batch, or made something the flow
    does not model (a send, sub-steps, an idle slot next to it)."""
    out = {rank: list(steps) for rank, steps in compute.items()}
    rank = rng.choice(sorted(out))
    steps = out[rank]
    if not steps:
        return out
    k = rng.randrange(len(steps))
    step = steps[k]
    what = rng.choice(["drop", "double", "rank", "micro", "send", "subs", "idle"])
    if what == "drop":
        steps.pop(k)
    elif what == "double":
        steps.insert(rng.randrange(len(steps) + 1), step)
    elif what == "rank":
        other = out[rng.choice(sorted(out))]
        other.insert(rng.randrange(len(other) + 1), steps.pop(k))
    elif what == "micro" and step.meta_type.is_compute and not step.meta_type.is_overlap:
        steps[k] = MetaStep(rng.choice([m, step.micro_index ^ 1]), step.meta_type, step.stage_index)
    elif what == "send":
        steps.insert(k, MetaStep(0, T.FWD_SEND, 0))
    elif what == "subs":
        steps[k] = MetaStep(None, T.BATCH_SEND_RECV, None, [MetaStep(0, T.FWD_SEND, 0)])
    else:
        steps.insert(k, None)
    return out


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_library_schedules_lower_as_before(cls):
    rng = random.Random(7)
    lowered = 0
    for p, v, m in _configs(cls):
        compute, placement = cls.generate(p, v, m), cls.stage_placement(p, v)
        where = (cls.__name__, p, v, m)
        small = p <= 3 and m <= 2 * p + 3
        lowered += _assert_same(compute, placement, where, per_rank=small)
        _assert_same(_forwards_only(compute), placement, (*where, "forward only"), per_rank=small)
        if v > 1 and p > 1:
            _assert_same(fuse_overlap_pairs(compute, placement), placement, (*where, "fused"), per_rank=small)
        if p > 1 and p <= 4:
            for k in range(2):
                _assert_same(_shuffled(compute, rng), placement, (*where, "shuffled", k), per_rank=small)
            _assert_same(_broken(compute, rng, m), placement, (*where, "broken"), per_rank=False)
    assert lowered > 5


def _greedy(placement, m, rng, split):
    """Compute lists for any placement: each round, each rank runs one step whose inputs were made
    (chosen at random), forward then backward (split into I and W, or not)."""
    stages = len(placement)
    kinds = (T.FWD, T.BWD_INPUT, T.BWD_WEIGHT) if split else (T.FWD, T.BWD)
    todo = {rank: [(kind, s, i) for s in range(stages) if placement[s] == rank for i in range(m) for kind in kinds]
            for rank in sorted(set(placement.values()))}
    made: set[tuple] = set()
    lists: dict[int, list[MetaStep]] = {rank: [] for rank in todo}

    def ready(kind, s, i):
        if kind is T.FWD:
            return s == 0 or ("F", s - 1, i) in made
        if kind is T.BWD_WEIGHT:
            return ("G", s, i) in made
        return ("F", s, i) in made and (s == stages - 1 or ("G", s + 1, i) in made)

    while any(todo.values()):
        done = []
        for rank, left in todo.items():
            can = [step for step in left if ready(*step)]
            if can:
                step = rng.choice(can[:3])
                left.remove(step)
                lists[rank].append(MetaStep(step[2], step[0], step[1]))
                done.append(step)
        assert done
        for kind, s, i in done:
            made.add(("W" if kind is T.BWD_WEIGHT else "G" if kind is not T.FWD else "F", s, i))
    return lists


def test_random_placements_lower_as_before():
    """Several stages on one rank, next to each other or not, sends to several ranks at once."""
    rng = random.Random(11)
    for trial in range(40):
        ranks = rng.randint(1, 4)
        stages = rng.randint(ranks, 7)
        owners = list(range(ranks)) + [rng.randrange(ranks) for _ in range(stages - ranks)]
        rng.shuffle(owners)
        placement = dict(enumerate(owners))
        m = rng.randint(1, 5)
        compute = _greedy(placement, m, rng, split=trial % 2 == 1)
        if trial % 5 == 0:
            compute[ranks] = []  # a rank that holds no stage
        _assert_same(compute, placement, ("random", trial, placement, m))
        _assert_same(_shuffled(compute, rng), placement, ("random shuffled", trial, placement, m))


class _Stage(enum.IntEnum):
    ONE = 1


def test_stages_that_are_not_plain_ints_lower_as_before():
    """A stage given as True (possible only without MetaStep's checks, ``unchecked_step``): the same
    TypeError; as an IntEnum member (which the checks accept): the same lists, with its type."""
    cls = available_schedules()["1f1b"]
    compute, placement = cls.generate(3, 1, 4), cls.stage_placement(3, 1)
    for stage in (True, _Stage.ONE):
        for kinds in ((T.FWD,), (T.BWD,), (T.FWD, T.BWD)):
            lists = {rank: [unchecked_step(step.micro_index, step.meta_type, stage)
                            if step.stage_index == 1 and step.meta_type in kinds and step.micro_index < 2 else step
                            for step in steps] for rank, steps in compute.items()}
            _assert_same(lists, placement, ("stage", stage, kinds))
    lists = {0: ["not a step"], 1: [], 2: []}
    _assert_same(lists, placement, ("not a step",))


def test_an_irregular_job_by_hand():
    """Two forward values of one stage boundary in one batch, shapes of a later boundary in the
    same gap (a second batch), a rank that waits on two ranks at one boundary."""
    F, B = T.FWD, T.BWD
    placement = {0: 0, 1: 1, 2: 0, 3: 2}
    compute = {
        0: [MetaStep(0, F, 0), MetaStep(1, F, 0), MetaStep(0, F, 2), MetaStep(1, F, 2), MetaStep(0, B, 2),
            MetaStep(1, B, 2), MetaStep(0, B, 0), MetaStep(1, B, 0)],
        1: [MetaStep(0, F, 1), MetaStep(1, F, 1), MetaStep(0, B, 1), MetaStep(1, B, 1)],
        2: [MetaStep(0, F, 3), MetaStep(1, F, 3), MetaStep(1, B, 3), MetaStep(0, B, 3)],
    }
    assert _assert_same(compute, placement, ("by hand",))
