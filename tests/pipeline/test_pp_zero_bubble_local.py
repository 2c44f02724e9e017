"""The zero-bubble schedule classes on LocalCluster against the non-pipelined oracle.

torch (tiny MLP, ``mlp_harness``): ZB-H1 with one and two looped chunks, ZB-V and DualPipeV for
p in {2, 3, 4} and m at the schedule's minimum, 2p and 2p+1, cycling through transport x
dyn_shape x overlap_p2p so that each schedule and p meets six of the eight and every schedule
all eight; the peak activations measured by the runtime are checked against the schedule's
bound. Tied first/last weights (one rank holds both stages under V placement) and shapes that
change per micro-batch run once per schedule. MindSpore (small GPT, ``pp_harness``): each
schedule on 2 ranks. Argument errors are raised before any communication.
"""

from __future__ import annotations

import itertools

import pytest
from mlp_harness import MatrixJob, check, run_matrix_job
from pp_harness import SCHEDULES, Job, batch, check_against_oracle, full_model_oracle, merged, run_job, small_config

from hyper_parallel import (
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster, RankFailedError

ZERO_BUBBLE = [(ScheduleInterleavedZeroBubble, 1), (ScheduleInterleavedZeroBubble, 2), (ScheduleZBVZeroBubble, 2),
               (ScheduleDualPipeV, 2)]
OPTIONS = list(itertools.product(("plain", "batch"), (False, True), (False, True)))  # transport, dyn, overlap


def peak_bound(cls, chunks: int, p: int, m: int) -> int:
    """Most (stage, micro-batch) activations a rank may hold: p micro-batches of its layers for
    ZB-H1 and ZB-V (fewer when m < p), p + 1/2 for DualPipeV."""
    if cls is ScheduleDualPipeV:
        return 2 * p + 1
    return chunks * min(p, m)


def _cases():
    for cls, v in ZERO_BUBBLE:
        for p in (2, 3, 4):
            micro = sorted({cls.min_microbatches(p, v), 2 * p, 2 * p + 1})
            for k, m in enumerate(micro):
                for j in (0, 1):
                    transport, dyn, overlap = OPTIONS[(2 * k + j + 3 * (p - 2)) % len(OPTIONS)]
                    yield pytest.param(cls, v, p, m, transport, dyn, overlap,
                                       id=f"{cls.__name__}-v{v}-p{p}-m{m}-{transport}"
                                          f"{'-dyn' if dyn else ''}{'-overlap' if overlap else ''}")


CASES = list(_cases())


def test_every_schedule_meets_every_option():
    met = {(c.values[0], c.values[1], c.values[4:]) for c in CASES}
    for cls, v in ZERO_BUBBLE:
        assert {opts for c, w, opts in met if (c, w) == (cls, v)} == set(OPTIONS), cls.__name__


@pytest.mark.parametrize("cls, v, p, m, transport, dyn, overlap", CASES)
def test_zero_bubble_matches_oracle(cls, v, p, m, transport, dyn, overlap):
    job = MatrixJob(cls, v, m, dict(p2p_transport=transport, overlap_p2p=overlap), dyn_shape=dyn)
    results = LocalCluster(p).run(run_matrix_job, job)
    check(job, results, p * v)
    peaks = [r["peak"] for r in results]
    assert max(peaks) <= peak_bound(cls, v, p, m), peaks
    if m >= 2 * p:  # the schedule uses the memory it is allowed on its busiest rank
        assert max(peaks) == peak_bound(cls, v, p, m), peaks


@pytest.mark.parametrize("cls, v", ZERO_BUBBLE)
def test_tied_first_and_last_weights(cls, v):
    job = MatrixJob(cls, v, 7, dict(p2p_transport="batch", overlap_p2p=True), tie=True)
    check(job, LocalCluster(3).run(run_matrix_job, job), 3 * v)


@pytest.mark.parametrize("cls, v", ZERO_BUBBLE)
def test_shapes_that_change_per_micro_batch(cls, v):
    job = MatrixJob(cls, v, 5, dict(p2p_transport="plain", overlap_p2p=True), dyn_shape=True, vary=True)
    check(job, LocalCluster(2).run(run_matrix_job, job), 2 * v)


# ---------------------------------------------------------------- MindSpore, lean
MS_CASES = [  # two transformer blocks over the stages keep MindSpore's per-op cost small
    pytest.param("zb-h1", 3, dict(p2p_transport="plain"), id="zb-h1-m3-plain"),
    pytest.param("zbv", 4, dict(p2p_transport="batch", overlap_p2p=True), id="zbv-m4-batch-overlap"),
    pytest.param("dualpipev", 4, dict(p2p_transport="plain", overlap_p2p=True), id="dualpipev-m4-plain-overlap"),
]


@pytest.fixture
def zero_bubble_names():
    added = {"zb-h1": (ScheduleInterleavedZeroBubble, 1), "zbv": (ScheduleZBVZeroBubble, 2),
             "dualpipev": (ScheduleDualPipeV, 2)}
    SCHEDULES.update(added)
    yield
    for name in added:
        del SCHEDULES[name]


@pytest.mark.parametrize("name, m, options", MS_CASES)
def test_mindspore_matches_non_pipelined(zero_bubble_names, name, m, options):
    config = small_config(n_layers=2)
    tokens, targets = batch(config, 2 * m)
    results = LocalCluster(2, platform="mindspore").run(run_job, Job(name, m, config, tokens, targets,
                                                                     options=options))
    losses, grads = merged(results)
    assert len(losses) == 1 and len(losses[0]) == m
    ref_loss, ref_grads = full_model_oracle("mindspore", config, tokens, targets)
    check_against_oracle("mindspore", losses[0], grads, ref_loss, ref_grads)


# ---------------------------------------------------------------- argument errors
def _mlp_stage(index: int, num: int) -> PipelineStage:
    from mlp_harness import MLPStage, weights

    return PipelineStage(MLPStage(index, num, weights(num), False), index, num)


def _build(cls, indices, num, m):
    def body():
        cls([_mlp_stage(s, num) for s in indices[get_platform().rank]], m)

    return body


@pytest.mark.parametrize("cls", [ScheduleZBVZeroBubble, ScheduleDualPipeV])
def test_v_schedules_refuse_looped_stages(cls):
    # rank 0 must hold stages 0 and 3 of 4 under V placement; looped placement gives it 0 and 2
    with pytest.raises(RankFailedError, match=rf"rank 0 failed: ValueError: {cls.__name__} uses V placement: with 2 "
                       r"pipeline ranks there are 4 stages and rank 0 holds stages \[0, 3\], but it was given "
                       r"stages \[0, 2\] of stage_num 4"):
        LocalCluster(2, timeout=30).run(_build(cls, {0: [0, 2], 1: [1, 3]}, 4, 8))


@pytest.mark.parametrize("cls", [ScheduleZBVZeroBubble, ScheduleDualPipeV])
def test_v_schedules_need_exactly_two_stages(cls):
    for indices, count in (({0: [0]}, 1), ({0: [0, 1, 2]}, 3)):
        with pytest.raises(RankFailedError, match=rf"{cls.__name__} runs exactly 2 stages per rank \(rank r holds "
                           rf"stages r and 2p-1-r\), got {count}"):
            LocalCluster(1, timeout=30).run(_build(cls, indices, 3, 2))
    with pytest.raises(RankFailedError, match=r"rank 0 holds stages \[0, 1\], but it was given stages \[0, 1\] "
                       r"of stage_num 3"):
        LocalCluster(1, timeout=30).run(_build(cls, {0: [0, 1]}, 3, 2))


def test_interleaved_zero_bubble_refuses_v_stages():
    with pytest.raises(RankFailedError, match=r"ScheduleInterleavedZeroBubble places stages \[0, 2\] on pipeline "
                       r"rank 0, but this rank was given stages \[0, 3\]"):
        LocalCluster(2, timeout=30).run(_build(ScheduleInterleavedZeroBubble, {0: [0, 3], 1: [1, 2]}, 4, 4))


@pytest.mark.parametrize("p, m", [(1, 1), (2, 3)])
def test_dualpipe_v_names_its_minimum_micro_batch_count(p, m):
    v_stages = {r: [r, 2 * p - 1 - r] for r in range(p)}
    with pytest.raises(RankFailedError, match=rf"ScheduleDualPipeV with {p} ranks needs at least {2 * p} "
                       rf"micro-batches, got {m}"):
        LocalCluster(p, timeout=30).run(_build(ScheduleDualPipeV, v_stages, 2 * p, m))


def test_unknown_keyword_arguments_reach_the_base_class():
    with pytest.raises(RankFailedError, match="unexpected keyword argument 'no_such_option'"):
        LocalCluster(1, timeout=30).run(lambda: ScheduleZBVZeroBubble([_mlp_stage(0, 2), _mlp_stage(1, 2)], 2,
                                                                      no_such_option=True))
