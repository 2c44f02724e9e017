"""The faster schedule generators (branch gen-speed) make the very lists they made before.

``_generate_before.py`` holds the generators, ``place_weights`` and MetaStep's argument checks as
they were before the speed-ups, unchanged. For every library schedule (and the MPipe body, the
fused overlap pairs of interleaved 1F1B), many small (p, v, m) -- m below, at and above p, not a
multiple of p, v = 1..4 -- the new lists must be EQUAL to the old ones element by element: the
same ranks in the same order, the same steps with fields of the same types and the same
``__dict__`` layout. ``place_weights`` is also run directly on random F/I/B/W lists and limits,
including lists that get stuck (the same RuntimeError message), and MetaStep's constructor must
accept and refuse the same arguments with the same errors.
"""

from __future__ import annotations

import dataclasses
import pickle
import random

import _generate_before as old
import pytest

from hyper_parallel.core.pipeline_parallel.ir import MetaStep, MetaStepType
from hyper_parallel.core.pipeline_parallel.ir.steps import unchecked_step
from hyper_parallel.core.pipeline_parallel.schedule import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.schedules import (
    generate_dualpipe_v,
    generate_interleaved_1f1b,
    generate_interleaved_zero_bubble,
    generate_zbv_zero_bubble,
)
from hyper_parallel.core.pipeline_parallel.schedules._weights import place_weights
from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules
from hyper_parallel.core.pipeline_parallel.zero_bubble_schedules import (
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

T = MetaStepType

ORACLE = {  # class -> the frozen generator of (p, v, m)
    ScheduleGPipe: lambda p, v, m: old.generate_gpipe(p, m),
    Schedule1F1B: lambda p, v, m: old.generate_1f1b(p, m),
    ScheduleInterleaved1F1B: old.generate_interleaved_1f1b,
    ScheduleLoopedBFS: old.generate_looped_bfs,
    ScheduleInterleavedZeroBubble: old.generate_interleaved_zero_bubble,
    ScheduleZBVZeroBubble: lambda p, v, m: old.generate_zbv_zero_bubble(p, m),
    ScheduleDualPipeV: lambda p, v, m: old.generate_dualpipe_v(p, m),
}


def _mpipe_body(p, v, m):  # ScheduleMPipeTranspose._generate, with the frozen generators
    return old.generate_1f1b(p, m) if v == 1 else old.generate_interleaved_1f1b(p, v, m)


def _mpipe_class():
    try:
        from hyper_parallel.core.pipeline_parallel.features.mpipe.transpose import ScheduleMPipeTranspose
    except ImportError:  # a framework it needs is missing
        return None
    return ScheduleMPipeTranspose


def _layout(step):
    """Everything about a step that code could see: its class, its fields in ``__dict__`` order
    with their types, sub-steps the same way."""
    if step is None:
        return None
    fields = []
    for name, value in vars(step).items():
        if name == "sub_steps" and value is not None:
            value = (type(value), tuple(_layout(sub) for sub in value))
        fields.append((name, type(value), value))
    return type(step), tuple(fields)


def _assert_same(new, before, where):
    assert type(new) is type(before), where
    assert list(new) == list(before), where  # the same ranks, in the same order
    for rank in before:
        assert type(new[rank]) is list, where
        assert len(new[rank]) == len(before[rank]), (where, rank)
        for k, (a, b) in enumerate(zip(new[rank], before[rank])):
            assert _layout(a) == _layout(b), (where, rank, k, a, b)
    assert new == before, where


def _shapes(cls, ps=range(1, 9), extra=((8, 2, 21), (7, 3, 30), (9, 1, 40), (6, 4, 13))):
    for p in ps:
        for v in range(1, 5):
            if not cls.min_chunks <= v <= cls.max_chunks:
                continue
            low = cls.min_microbatches(p, v)
            for m in sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 2, 4 * p, low, low + 1}):
                if m >= low:
                    yield p, v, m
    for p, v, m in extra:
        if cls.min_chunks <= v <= cls.max_chunks and m >= cls.min_microbatches(p, v):
            yield p, v, m


def _outcome(make, *args):
    try:
        return "ok", make(*args)
    except Exception as exc:  # any error: the same type and message from both
        return type(exc), str(exc)


def test_every_catalog_class_has_an_oracle():
    assert set(available_schedules().values()) <= set(ORACLE)


@pytest.mark.parametrize("cls", list(ORACLE), ids=lambda c: c.__name__)
def test_generate_equals_before(cls):
    for p, v, m in _shapes(cls):
        _assert_same(cls._generate(p, v, m), ORACLE[cls](p, v, m), (cls.__name__, p, v, m))


def test_mpipe_body_equals_before():
    cls = _mpipe_class()
    if cls is None:
        pytest.skip("ScheduleMPipeTranspose is not importable here")
    for p in range(1, 6):
        for v in range(1, 4):
            for m in sorted({1, p - 1, p, p + 1, 2 * p + 1, 3 * p}):
                if m >= 1:
                    _assert_same(cls._generate(p, v, m), _mpipe_body(p, v, m), ("mpipe", p, v, m))


def test_overlap_pairs_equal_before():
    for p in range(1, 5):
        for v in (2, 3):
            for m in (p, p + 1, 2 * p + 1, 3 * p):
                new = generate_interleaved_1f1b(p, v, m, overlap_b_f=True)
                _assert_same(new, old.generate_interleaved_1f1b(p, v, m, overlap_b_f=True), ("overlap", p, v, m))


BAD_ARGS = [
    (generate_interleaved_zero_bubble, old.generate_interleaved_zero_bubble,
     [(0, 1, 1), (2, 0, 3), (2, 1, 0), (2, 1, True), (True, 1, 2), (2.0, 1, 2), (2, 1, "3")]),
    (generate_zbv_zero_bubble, old.generate_zbv_zero_bubble, [(0, 1), (2, 0), (2, None), (False, 2)]),
    (generate_dualpipe_v, old.generate_dualpipe_v, [(2, 3), (1, 1), (0, 4), (3, 5), (2, 4.0)]),
    (generate_interleaved_1f1b, old.generate_interleaved_1f1b, [(2, 1, 3), (0, 2, 3), (2, 2, 0)]),
]


@pytest.mark.parametrize("new, before, cases", BAD_ARGS, ids=lambda x: getattr(x, "__name__", ""))
def test_bad_arguments_fail_the_same(new, before, cases):
    for args in cases:
        assert _outcome(new, *args) == _outcome(before, *args), args


# --- place_weights directly --------------------------------------------------------------------


def _fi_orders(schedule):
    """The F/I (and B) lists a zero-bubble schedule was placed from: its W's left out."""
    return {rank: [s for s in steps if s.meta_type is not T.BWD_WEIGHT] for rank, steps in schedule.items()}


def _placed(place, orders, num_stages, limits):
    return _outcome(place, {rank: list(steps) for rank, steps in orders.items()}, num_stages, limits)


def _assert_placed_same(orders, num_stages, limits, where):
    new = _placed(place_weights, orders, num_stages, limits)
    before = _placed(old.place_weights, orders, num_stages, limits)
    if before[0] == "ok" and new[0] == "ok":
        _assert_same(new[1], before[1], where)
    else:
        assert new == before, where


def test_place_weights_random_limits_on_real_orders():
    rng = random.Random(7)
    cases = [(generate_interleaved_zero_bubble(p, v, m), v * p) for p, v, m in
             [(1, 1, 3), (2, 1, 3), (3, 2, 5), (4, 1, 9), (4, 3, 6), (5, 2, 12)]]
    cases += [(generate_zbv_zero_bubble(p, m), 2 * p) for p, m in [(1, 2), (2, 3), (3, 7), (4, 5)]]
    cases += [(generate_dualpipe_v(p, m), 2 * p) for p, m in [(2, 4), (3, 7)]]  # F, B, I: no OVERLAP in place
    seen_stuck = False
    for schedule, stages in cases:
        orders = {rank: [s for s in steps if not s.meta_type.is_overlap] for rank, steps in _fi_orders(schedule).items()}
        for _ in range(12):
            limits = {rank: rng.choice([0, 1, 2, 3, stages, 10 ** 6, -1]) for rank in orders}
            _assert_placed_same(orders, stages, limits, (stages, limits))
            seen_stuck |= _placed(place_weights, orders, stages, limits)[0] is RuntimeError
    assert seen_stuck  # some limits starve a rank: the same RuntimeError, at the same time


def _random_step(rng, stages, micros):
    kind = rng.choice([T.FWD, T.FWD, T.BWD_INPUT, T.BWD_INPUT, T.BWD, T.BWD_WEIGHT, T.FSDP_UNSHARD])
    stage = rng.choice([None] + list(range(-1, stages + 1)) if rng.random() < 0.1 else list(range(stages)))
    micro = rng.choice([None, -2, 2 ** 40]) if rng.random() < 0.05 else rng.randrange(micros)
    return MetaStep(micro, kind, stage)


def test_place_weights_random_lists():
    rng = random.Random(11)
    outcomes = set()
    for case in range(400):
        ranks = rng.sample(range(-2, 9), rng.randint(1, 4))
        stages, micros = rng.randint(1, 5), rng.randint(1, 4)
        orders = {rank: [_random_step(rng, stages, micros) for _ in range(rng.randint(0, 9))] for rank in ranks}
        limits = {rank: rng.randint(0, 4) for rank in ranks}
        _assert_placed_same(orders, stages, limits, case)
        outcomes.add(_placed(place_weights, orders, stages, limits)[0])
    assert outcomes == {"ok", RuntimeError}


def test_place_weights_shuffled_and_odd_inputs():
    rng = random.Random(3)
    orders = _fi_orders(generate_interleaved_zero_bubble(3, 2, 5))
    for _ in range(30):
        shuffled = {rank: rng.sample(steps, len(steps)) for rank, steps in orders.items()}
        _assert_placed_same(shuffled, 6, dict.fromkeys(orders, 6), "shuffled")
    duplicated = {rank: steps + steps[:3] for rank, steps in orders.items()}
    _assert_placed_same(duplicated, 6, dict.fromkeys(orders, 6), "duplicated")
    f = MetaStep(0, T.FWD, 0)
    for make_orders, limits in [  # a function: a generator value can be read once, each side gets its own
        (lambda: {}, {}),
        (lambda: {0: [], 1: []}, {}),  # nothing to run: the limits are never read
        (lambda: {1: [f], 0: []}, {1: 1}),  # a missing limit: the same KeyError
        (lambda: {1: [f], 0: []}, {0: 1, 1: 1}),
        (lambda: {2: (s for s in [f]), 1: (MetaStep(0, T.FWD, 1),)}, {1: 1, 2: 1}),  # any iterable
        (lambda: {0: [f, f, MetaStep(0, T.BWD_INPUT, 0)]}, {0: 5}),  # the same object twice
        (lambda: {0: [MetaStep(0, T.BWD_WEIGHT, 0), f]}, {0: 0}),
        (lambda: {0: [MetaStep(0, T.FWD, 1)], "a": [f]}, {0: 1, "a": 1}),  # ranks that cannot be sorted
        (lambda: {0: [None]}, {0: 1}),  # not a step: never ready, as before
        (lambda: {0: [f, MetaStep(0, T.BWD_INPUT, 0), None], 1: [MetaStep(0, T.FWD, 1)]}, {0: 1, 1: 1}),
        (lambda: {0: [f, 3]}, {0: 1}),  # the same AttributeError
    ]:
        new = _outcome(place_weights, make_orders(), 1, limits)
        before = _outcome(old.place_weights, make_orders(), 1, limits)
        assert new == before, make_orders()


# --- MetaStep's constructor --------------------------------------------------------------------

F0 = MetaStep(0, T.FWD, 0)
GOOD_AND_BAD = [
    (3, T.FWD, 5), (None, T.FSDP_UNSHARD, 0), (None, T.BATCH_SEND_RECV, None, []), (-1, T.BWD, -7),
    (None, T.OVERLAP_B_F, None, [F0, F0]), (None, T.OVERLAP_B_F, None, (F0,)),
    (1, "F", 0), (1, None, 0), (True, T.FWD, 0), (1, T.FWD, False), (1.0, T.FWD, 0), (1, T.FWD, "0"),
    ("x", "y", 2.5), (1, T.FWD, 0, [1]), (1, T.FWD, 0, 5), (1, T.FWD, 0, "ab"), (1, T.FWD, 0, [F0, None]),
    (2 ** 70, T.FWD, -(2 ** 70)),
]


def _made(cls, args, kwargs=None):
    try:
        step = cls(*args, **(kwargs or {}))
    except Exception as exc:  # any error: the same type and message (the class named the same)
        return type(exc), str(exc).replace("OldMetaStep", "MetaStep")
    return tuple((name, type(value), value) for name, value in vars(step).items())


@pytest.mark.parametrize("args", GOOD_AND_BAD, ids=str)
def test_metastep_checks_equal_before(args):
    assert _made(MetaStep, args) == _made(old.OldMetaStep, args)
    names = ("micro_index", "meta_type", "stage_index", "sub_steps")
    kwargs = dict(zip(names, args))
    assert _made(MetaStep, (), kwargs) == _made(old.OldMetaStep, (), kwargs)


def test_metastep_sub_steps_from_an_iterator_equal_before():
    for subs in ([F0, F0], [F0, 3], []):
        assert _made(MetaStep, (None, T.OVERLAP_B_F, None, iter(subs))) == _made(
            old.OldMetaStep, (None, T.OVERLAP_B_F, None, iter(subs)))


@pytest.mark.parametrize("args, kwargs", [((), {}), ((1,), {}), ((1, T.FWD, 0, None, 5), {}),
                                          ((1, T.FWD), {"stage": 0}), ((1, T.FWD, 0), {"micro_index": 2})])
def test_metastep_call_errors_equal_before(args, kwargs):
    assert _made(MetaStep, args, kwargs) == _made(old.OldMetaStep, args, kwargs)


def test_unchecked_step_is_the_checked_step():
    for args in [(3, T.FWD, 5), (None, T.FSDP_UNSHARD, 0), (0, T.BWD_WEIGHT, None)]:
        fast, checked = unchecked_step(*args), MetaStep(*args)
        assert _layout(fast) == _layout(checked)
        assert fast == checked and hash(fast) == hash(checked) and str(fast) == str(checked)
        assert pickle.dumps(fast) == pickle.dumps(checked)
        assert pickle.loads(pickle.dumps(fast)) == checked
        assert dataclasses.replace(fast, micro_index=9) == dataclasses.replace(checked, micro_index=9)
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast.micro_index = 1  # type: ignore[misc]
    pair = unchecked_step(None, T.OVERLAP_B_F, None, (F0, F0))
    assert _layout(pair) == _layout(MetaStep(None, T.OVERLAP_B_F, None, [F0, F0]))
    assert str(pair) == "OVERLAP_B_F[F.s0.m0+F.s0.m0]"
