"""The zero-bubble schedule classes' compute schedules: the generator checks of
test_pp_zero_bubble_schedules.py (counts, F before I before W, dependencies across ranks, peak)
reached through the classes (their argument checks, placement and chunk counts), for more
ranks, with the peak in the papers' unit -- micro-batches of a rank's layers: ZB-H1 p, ZB-V p on
the worst rank, DualPipeV p + 1 -- and the lowered lists the classes run on CPU."""

from __future__ import annotations

import pytest
from test_pp_zero_bubble_schedules import check_counts_and_order, in_flight_peak

from hyper_parallel import ScheduleDualPipeV, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, chunk_range, resolve_schedule
from hyper_parallel.core.pipeline_parallel.ir import MetaStepType
from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_compute, validate_lowered

CLASSES = [(ScheduleInterleavedZeroBubble, v) for v in (1, 2, 3)] + [(ScheduleZBVZeroBubble, 2),
                                                                     (ScheduleDualPipeV, 2)]
PAPER_PEAK = {ScheduleInterleavedZeroBubble: lambda p: p, ScheduleZBVZeroBubble: lambda p: p,
              ScheduleDualPipeV: lambda p: p + 1}  # micro-batches of a rank's layers


def micro_counts(cls, p: int, v: int) -> list[int]:
    low = cls.min_microbatches(p, v)
    return sorted({low, low + 1, p, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 2} - set(range(low)))


@pytest.mark.parametrize("cls, v", CLASSES, ids=[f"{c.__name__}-v{v}" for c, v in CLASSES])
@pytest.mark.parametrize("p", [1, 2, 3, 5, 7, 8])
def test_class_schedules_counts_order_and_peak(cls, v, p):
    placement = cls.stage_placement(p, v)
    assert sorted(placement) == list(range(p * v))
    for m in micro_counts(cls, p, v):
        compute = cls.generate(p, v, m)
        assert sorted(compute) == list(range(p))
        check_counts_and_order(compute, placement, m)
        validate_compute(compute, placement, m)
        peaks = [in_flight_peak(steps) for steps in compute.values()]
        assert max(peaks) / v <= PAPER_PEAK[cls](p), (m, peaks)
        if m >= 2 * p and cls is not ScheduleDualPipeV:  # the memory the schedule may use is used
            assert max(peaks) == v * p, (m, peaks)
        if cls is ScheduleDualPipeV:  # DualPipe's "PP + 1" stages: p + 1/2 micro-batches
            assert max(peaks) == 2 * p + 1, (m, peaks)
        kinds = {part.meta_type for steps in compute.values() for step in steps if step is not None
                 for part in step.parts}
        assert MetaStepType.BWD_WEIGHT in kinds and MetaStepType.BWD_INPUT in kinds


def test_placements():
    assert ScheduleZBVZeroBubble.stage_placement(3, 2) == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}
    assert ScheduleDualPipeV.stage_placement(2, 2) == {0: 0, 1: 1, 2: 1, 3: 0}
    assert ScheduleInterleavedZeroBubble.stage_placement(2, 3) == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}
    assert chunk_range(ScheduleZBVZeroBubble) == chunk_range(ScheduleDualPipeV) == (2, 2)
    assert chunk_range(ScheduleInterleavedZeroBubble) == (1, 64)


def test_dualpipe_v_overlaps_pairs_and_others_do_not():
    def overlaps(cls, p, v, m):
        return sum(step.meta_type is MetaStepType.OVERLAP_B_F for steps in cls.generate(p, v, m).values()
                   for step in steps if step is not None)

    assert overlaps(ScheduleDualPipeV, 3, 2, 7) > 0
    assert overlaps(ScheduleZBVZeroBubble, 3, 2, 7) == overlaps(ScheduleInterleavedZeroBubble, 3, 2, 7) == 0


@pytest.mark.parametrize(("call", "message"), [
    (lambda: ScheduleDualPipeV.generate(4, 2, 7), "ScheduleDualPipeV with 4 ranks needs at least 8 micro-batches, got 7"),
    (lambda: ScheduleDualPipeV.generate(1, 2, 1), "ScheduleDualPipeV with 1 ranks needs at least 2 micro-batches"),
    (lambda: ScheduleZBVZeroBubble.generate(2, 3, 4), "ScheduleZBVZeroBubble runs between 2 and 2 stages per rank, "
                                                      "got num_chunks=3"),
    (lambda: ScheduleDualPipeV.generate(2, 1, 4), "ScheduleDualPipeV runs between 2 and 2 stages per rank"),
    (lambda: ScheduleInterleavedZeroBubble.generate(2, 65, 4), "between 1 and 64 stages per rank, got num_chunks=65"),
    (lambda: ScheduleZBVZeroBubble.generate(2, 2, 0), "ScheduleZBVZeroBubble with 2 ranks needs at least 1 "
                                                      "micro-batches, got 0"),
])
def test_class_argument_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_minimum_micro_batches():
    for p in range(1, 9):
        assert ScheduleDualPipeV.min_microbatches(p, 2) == 2 * p
        assert ScheduleZBVZeroBubble.min_microbatches(p, 2) == 1
        assert ScheduleInterleavedZeroBubble.min_microbatches(p, 3) == 1
        ScheduleDualPipeV.generate(p, 2, 2 * p)  # the minimum itself is accepted


def test_catalog_names():
    available = available_schedules()
    assert available["interleaved-zb"] is ScheduleInterleavedZeroBubble
    assert available["zbv"] is ScheduleZBVZeroBubble
    assert available["dualpipev"] is ScheduleDualPipeV
    assert resolve_schedule("ScheduleDualPipeV") == ("dualpipev", ScheduleDualPipeV)


LOWERED = [(cls, v, p, m) for cls, v in CLASSES if v < 3 for p in (2, 3, 4)
           for m in sorted({cls.min_microbatches(p, v), 2 * p + 1})]


@pytest.mark.parametrize("cls, v, p, m", LOWERED, ids=[f"{c.__name__}-v{v}-p{p}-m{m}" for c, v, p, m in LOWERED])
@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_lowered_lists_run_on_the_eager_engine(cls, v, p, m, transport):
    # what the constructor validates on CPU (gloo / LocalCluster): metadata for every message
    # (dyn_shape) and for the first one, with and without prefetching receives
    placement = cls.stage_placement(p, v)
    for metadata in ("first", "all"):
        for prefetch in (False, True):
            lowered = lower(cls.generate(p, v, m), placement, transport, metadata=metadata, prefetch=prefetch)
            validate_lowered(lowered, placement, m, transport, engine="eager")
