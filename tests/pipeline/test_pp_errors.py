"""Bad input raises a clear error before any communication; cross-rank problems name both ranks."""

from __future__ import annotations

import pytest
from pp_harness import batch, models, small_config

from hyper_parallel import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster, RankFailedError
from hyper_parallel.demo.gpt import init_gpt_weights

CONFIG = small_config()
WEIGHTS = init_gpt_weights(CONFIG, 0)


def _stage(index: int, num: int, **kw):
    return PipelineStage(models("torch").GPTStage(CONFIG, index, num, WEIGHTS), index, num, **kw)


def _single_rank(fn):
    """Run ``fn`` as the only rank of a pipeline (no peer to talk to) and return its result."""
    return LocalCluster(1, platform="torch", timeout=30).run(fn)[0]


def _raises(fn, error, match):
    def body():
        with pytest.raises(error, match=match):
            fn()
        return True

    assert _single_rank(body)


def test_stage_index_and_count_are_checked():
    module = models("torch").GPTStage(CONFIG, 0, 2, WEIGHTS)
    _raises(lambda: PipelineStage(module, 2, 2), ValueError, r"stage_index must be in \[0, 2\), got 2")
    _raises(lambda: PipelineStage(module, -1, 2), ValueError, r"stage_index must be in \[0, 2\), got -1")
    _raises(lambda: PipelineStage(module, 0, 0), ValueError, "stage_num must be >= 1, got 0")
    _raises(lambda: PipelineStage(module, 0.0, 1), TypeError, "stage_index must be an int")


def test_micro_batch_num_is_checked():
    _raises(lambda: ScheduleGPipe(_stage(0, 1), 0), ValueError, "micro_batch_num must be >= 1, got 0")
    _raises(lambda: Schedule1F1B(_stage(0, 1), "4"), TypeError, "micro_batch_num must be an int, got '4'")
    _raises(lambda: Schedule1F1B(_stage(0, 1), True), TypeError, "micro_batch_num must be an int")


def test_unknown_transport_and_wrong_stage_lists():
    _raises(lambda: ScheduleGPipe(_stage(0, 1), 2, p2p_transport="nccl"), ValueError,
            "unknown p2p_transport 'nccl'; valid: auto, plain, batch")
    _raises(lambda: Schedule1F1B([_stage(0, 2), _stage(1, 2)], 2), ValueError,
            "Schedule1F1B runs one stage per rank, but 2 stages were given")
    _raises(lambda: ScheduleInterleaved1F1B(_stage(0, 1), 2), ValueError,
            "ScheduleInterleaved1F1B needs between 2 and 64 stages per rank, got 1")
    _raises(lambda: ScheduleLoopedBFS([_stage(0, 3), _stage(1, 3)], 2), ValueError, "needs stage_num=2, got \\[3\\]")


def _swapped_placement():
    p = get_platform()
    Schedule1F1B(_stage(1 - p.rank, 2), 2)


def test_wrong_stage_placement_is_refused_before_communicating():
    with pytest.raises(RankFailedError, match=r"rank 0 failed: ValueError: Schedule1F1B places stages \[0\] on "
                       r"pipeline rank 0, but this rank was given stages \[1\]"):
        LocalCluster(2, platform="torch", timeout=30).run(_swapped_placement)


def _run_one(loss_fn, tokens, target, **kw):
    schedule = ScheduleGPipe(_stage(0, 1), 4, loss_fn=loss_fn, **kw)
    return schedule.run(tokens, target=target)


def test_indivisible_batch_names_argument_size_and_micro_batch_num():
    import torch

    tokens, targets = (torch.from_numpy(a) for a in batch(CONFIG, 6))
    loss = models("torch").cross_entropy_loss
    _raises(lambda: _run_one(loss, tokens, targets), ValueError,
            r"args\[0\] has size 6 along dim 0, which does not divide into micro_batch_num=4")
    good_tokens = torch.from_numpy(batch(CONFIG, 8)[0])
    _raises(lambda: _run_one(loss, good_tokens, targets), ValueError,
            "target has size 6 along dim 0, which does not divide into micro_batch_num=4")


def test_loss_checks():
    import torch

    tokens, targets = (torch.from_numpy(a) for a in batch(CONFIG, 8))
    mod = models("torch")
    _raises(lambda: _run_one(mod.cross_entropy_loss, tokens, None), ValueError,
            "loss_fn was given but run\\(\\) got no target")
    per_token = lambda logits, tgt: torch.nn.functional.cross_entropy(  # noqa: E731
        logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    _raises(lambda: _run_one(per_token, tokens, targets), ValueError,
            r"the loss of micro-batch 0 must be a scalar tensor, got \(16,\)")
    _raises(lambda: _run_one(None, tokens, None), ValueError, r"must be a scalar tensor, got \(2, 8, 24\)")
    _raises(lambda: _run_one(None, tokens, targets), ValueError, "got a target but the schedule has no loss_fn")
    _raises(lambda: _run_one(mod.cross_entropy_loss, tokens, targets, swap=True, swap_threshold=1), ValueError,
            "swap_threshold must be >= 2 compute slots")
    _raises(lambda: _run_one(None, tokens, None, output_concat_dim=0), ValueError, "output_concat_dim needs a loss_fn")


def _different_micro_batch_counts():
    p = get_platform()
    Schedule1F1B(_stage(p.rank, 2), 2 + p.rank)


def test_ranks_that_built_different_schedules_are_named():
    with pytest.raises(RankFailedError, match="pipeline ranks disagree on micro_batch_num: rank 0 has 2 but rank 1 has 3"):
        LocalCluster(2, platform="torch", timeout=30).run(_different_micro_batch_counts)


def _shape_changes_within_a_run():
    import torch
    from mlp_harness import MatrixJob, batch, build_stages, mse

    job = MatrixJob(Schedule1F1B, 1, 4, vary=True)  # stage 0's output width depends on the micro-batch
    stages = build_stages(job, 2, {0: 0, 1: 1})
    schedule = Schedule1F1B(stages[0], 4, loss_fn=mse)
    x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, True))
    schedule.run(x, target=y if stages[0].is_last else None)


def test_static_shapes_that_change_within_a_run_name_both_ranks():
    with pytest.raises(RankFailedError, match=r"stage 0 on rank 0 produced \(float32\[2, 4\], float32\[2, 4\]\) for "
                       r"micro-batch 1, but the shapes agreed with stage 1 on rank 1 for the first micro-batch of this "
                       r"run are \(float32\[2, 3\], float32\[2, 3\]\)"):
        LocalCluster(2, platform="torch", timeout=30).run(_shape_changes_within_a_run)


def test_static_shapes_may_change_from_run_to_run():
    import torch
    from mlp_harness import MatrixJob, batch, build_stages, check, mse

    def body(size):
        job = MatrixJob(Schedule1F1B, 1, 2, batch_size=size)
        stages = build_stages(job, 2, {0: 0, 1: 1})
        schedule = Schedule1F1B(stages[0], 2, loss_fn=mse)
        for run_size in (8, size):  # a first run with another batch size, then the one checked
            schedule.zero_grad()
            x, y = (torch.from_numpy(a) for a in batch(run_size, 2, False))
            losses = schedule.run(x, target=y if stages[0].is_last else None)
        grads = {f"{st.stage_index}.{n}": g.numpy() for st in stages for n, g in st.named_gradients().items()}
        return {"losses": [float(v) for v in losses], "grads": grads}

    job = MatrixJob(Schedule1F1B, 1, 2, batch_size=4)
    check(job, LocalCluster(2).run(body, 4), 2)


def _dyn_shape_disagrees():
    import torch

    p = get_platform()
    mod = models("torch")
    schedule = Schedule1F1B(_stage(p.rank, 2, dyn_shape=p.rank == 0), 2, loss_fn=mod.cross_entropy_loss)
    tokens, targets = (torch.from_numpy(a) for a in batch(CONFIG, 4))
    schedule.run(tokens, target=targets)


def test_neighbours_that_disagree_on_dyn_shape_are_named():
    with pytest.raises(RankFailedError, match="pipeline ranks disagree on dyn_shape: rank 0 has True but rank 1 "
                       "has False"):
        LocalCluster(2, platform="torch", timeout=30).run(_dyn_shape_disagrees)


def test_errors_are_the_same_on_mindspore():
    def body():
        import mindspore as ms

        stage = PipelineStage(models("mindspore").GPTStage(CONFIG, 0, 1, WEIGHTS), 0, 1)
        schedule = ScheduleGPipe(stage, 4, loss_fn=models("mindspore").cross_entropy_loss)
        tokens, targets = batch(CONFIG, 6)
        with pytest.raises(ValueError, match=r"args\[0\] has size 6 along dim 0, which does not divide into "
                           "micro_batch_num=4"):
            schedule.run(ms.Tensor(tokens), target=ms.Tensor(targets))
        with pytest.raises(ValueError, match=r"stage_index must be in \[0, 1\), got 1"):
            PipelineStage(stage.submodule, 1, 1)
        return True

    assert LocalCluster(1, platform="mindspore", timeout=60).run(body) == [True]
