"""The zero-bubble schedule classes on LocalCluster against the non-pipelined oracle.

torch (tiny MLP, ``mlp_harness``): ZB-H1 with one and two looped chunks, ZB-V and DualPipeV for
p in {2, 3, 4} and m at the schedule's minimum, 2p and 2p+1, cycling through transport x
dyn_shape x overlap_p2p so that each schedule and p meets six of the eight and every schedule
all eight; the peak activations measured by the runtime are checked against the schedule's
bound. Tied first/last weights (one rank holds both stages under V placement) and shapes that
change per micro-batch run once per schedule. MindSpore (small GPT, ``pp_harness``, lean: PyNative
is slow): each schedule on 2 ranks for m at its minimum, 2p and 2p+1 and once on 3 ranks, meeting
both transports and overlap_p2p on and off; every micro-batch's loss and every gradient. Argument
errors are raised before any communication.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from mlp_harness import MatrixJob, check, run_matrix_job
from pp_harness import (
    SCHEDULES,
    Job,
    batch,
    check_against_oracle,
    full_model_oracle,
    merged,
    models,
    run_job,
    small_config,
)

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
MS_NAMES = {"zb-h1": (ScheduleInterleavedZeroBubble, 1), "zbv": (ScheduleZBVZeroBubble, 2),
            "dualpipev": (ScheduleDualPipeV, 2)}
MS_CASES = [  # (name, p, m, transport, overlap_p2p): every schedule at p=2 for m at its minimum, 2p and 2p+1
    # and once at p=3, each schedule meeting both transports and overlap_p2p on and off (not the full
    # cross: PyNative is slow); two transformer blocks over the stages keep MindSpore's per-op cost small
    ("zb-h1", 2, 1, "plain", False), ("zb-h1", 2, 4, "batch", True), ("zb-h1", 2, 5, "plain", True),
    ("zb-h1", 3, 3, "batch", False),
    ("zbv", 2, 1, "batch", True), ("zbv", 2, 4, "plain", False), ("zbv", 2, 5, "batch", False),
    ("zbv", 3, 1, "plain", True),
    ("dualpipev", 2, 4, "plain", False), ("dualpipev", 2, 5, "batch", True), ("dualpipev", 3, 6, "plain", True),
]


def test_mindspore_cases_cover_every_m_and_option():
    for name, (cls, v) in MS_NAMES.items():
        cases = [c for c in MS_CASES if c[0] == name]
        assert {m for _, p, m, _, _ in cases if p == 2} == {cls.min_microbatches(2, v), 4, 5}, name
        assert any(p == 3 for _, p, _, _, _ in cases), name
        assert {t for *_, t, _ in cases} == {"plain", "batch"} and {o for *_, o in cases} == {False, True}, name


@pytest.fixture
def zero_bubble_names():
    SCHEDULES.update(MS_NAMES)
    yield
    for name in MS_NAMES:
        del SCHEDULES[name]


def _mindspore_micro_losses(config, tokens, targets, m):
    """Each micro-batch's loss of the non-pipelined model: one forward on the whole batch, the
    cross entropy of each micro-batch's rows in numpy."""
    import mindspore as ms

    from hyper_parallel.demo.gpt import init_gpt_weights

    logits = models("mindspore").GPTFull(config, init_gpt_weights(config, 0))(ms.Tensor(tokens)).asnumpy()
    logits = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]  # (batch, seq)
    return [-float(rows.mean()) for rows in np.split(picked, m)]


@pytest.mark.parametrize("name, p, m, transport, overlap", [
    pytest.param(*c, id=f"{c[0]}-p{c[1]}-m{c[2]}-{c[3]}{'-overlap' if c[4] else ''}") for c in MS_CASES])
def test_mindspore_matches_non_pipelined(zero_bubble_names, name, p, m, transport, overlap):
    """Every micro-batch's loss and every gradient against the non-pipelined model."""
    config = small_config(n_layers=2)
    tokens, targets = batch(config, 2 * m)
    job = Job(name, m, config, tokens, targets, options=dict(p2p_transport=transport, overlap_p2p=overlap))
    results = LocalCluster(p, platform="mindspore").run(run_job, job)
    losses, grads = merged(results)
    assert len(losses) == 1
    np.testing.assert_allclose(losses[0], _mindspore_micro_losses(config, tokens, targets, m), rtol=1e-5, atol=1e-6,
                               err_msg="per-micro-batch losses")
    ref_loss, ref_grads = full_model_oracle("mindspore", config, tokens, targets)
    check_against_oracle("mindspore", losses[0], grads, ref_loss, ref_grads)
    cls, v = MS_NAMES[name]
    assert max(r["peak"] for r in results) <= peak_bound(cls, v, p, m)


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
