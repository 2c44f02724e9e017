"""What schedule.run promises around the arithmetic: failed runs, parameters read per run,
cross-rank agreement, custom functions, errors that say where, and waits that say what they wait for."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from mlp_harness import MatrixJob, batch, build_stages, check, mse, oracle, run_matrix_job

from hyper_parallel.core.pipeline_parallel.ir import MetaStepType
from hyper_parallel.core.pipeline_parallel.runtime.executor import StageError
from hyper_parallel.core.pipeline_parallel.schedule import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster, RankFailedError

T = MetaStepType


def _grads(stages):
    return {f"{st.stage_index}.{n}": g.clone() for st in stages for n, g in st.named_gradients().items()}


def _schedule(job: MatrixJob, loss_fn=mse):
    p = get_platform()
    placement = job.schedule_cls.stage_placement(p.world_size, job.chunks)
    stages = build_stages(job, len(placement), placement)
    sched = job.schedule_cls(stages if len(stages) > 1 else stages[0], job.micro, loss_fn=loss_fn, **job.options)
    return stages, sched


class FailingLoss:
    """mse that raises on the n-th call (counting from 0) while ``armed``."""

    def __init__(self, fail_at: int) -> None:
        self.calls, self.fail_at, self.armed = 0, fail_at, False

    def __call__(self, out, target):
        if self.armed:
            self.calls += 1
            if self.calls - 1 == self.fail_at:
                raise FloatingPointError("loss of micro-batch 2 is not finite")
        return mse(out, target)


# ------------------------------------------------------------------ failed runs
@pytest.mark.parametrize("cls", [ScheduleInterleaved1F1B, ScheduleLoopedBFS])
def test_failed_run_puts_gradients_back_and_the_schedule_runs_again(cls):
    job = MatrixJob(cls, 2, 4)

    def body():
        loss = FailingLoss(fail_at=2)
        stages, sched = _schedule(job, loss)
        x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
        sched.run(x, target=y)  # first run: gradients now exist
        before = _grads(stages)
        loss.armed = True
        with pytest.raises(StageError, match="micro-batch 2") as info:
            sched.run(x, target=y)
        assert isinstance(info.value.__cause__, FloatingPointError)
        after = _grads(stages)
        loss.armed = False
        sched.run(x, target=y)
        return before, after, _grads(stages)

    (before, after, again), = LocalCluster(1).run(body)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name  # exactly what was there
    _, ref = oracle(job, 2)
    for name, g in again.items():  # two successful runs accumulated: twice the oracle
        np.testing.assert_allclose(g.numpy(), 2 * ref[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("keep", [True, False])
def test_failed_first_run_leaves_no_gradient_on_any_rank(keep):
    job = MatrixJob(Schedule1F1B, 1, 4, dict(keep_grads_on_error=keep))

    def body():
        p = get_platform()
        loss = FailingLoss(fail_at=2)
        loss.armed = True
        stages, sched = _schedule(job, loss)
        x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
        try:
            sched.run(x, target=y if stages[-1].is_last else None)
        except Exception as exc:  # noqa: BLE001 - every rank fails: the last one first, the others as its peers
            error = type(exc).__name__
        else:
            error = None
        return p.rank, error, _grads(stages)

    for rank, error, grads in LocalCluster(2).run(body):
        assert error is not None, rank
        assert grads == {}, (rank, grads)


# ------------------------------------------------------------------ parameters read per run
def test_parameters_are_read_when_the_run_starts():
    job = MatrixJob(Schedule1F1B, 1, 4)

    def body():
        stages, sched = _schedule(job)
        first = stages[0].submodule
        if stages[0].is_first:
            first.mix.weight.requires_grad_(False)  # frozen after the stage was built
        x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
        sched.run(x, target=y if stages[-1].is_last else None)
        frozen = _grads(stages)
        sched.zero_grad()
        if stages[0].is_first:
            first.mix.weight.requires_grad_(True)  # and unfrozen again
        sched.run(x, target=y if stages[-1].is_last else None)
        return frozen, _grads(stages), sorted(sched.named_parameters())

    results = LocalCluster(2).run(body)
    _, ref = oracle(job, 2)
    frozen = {**results[0][0], **results[1][0]}
    unfrozen = {**results[0][1], **results[1][1]}
    assert "0.mix.weight" not in frozen and set(frozen) == set(ref) - {"0.mix.weight"}
    for name, g in unfrozen.items():
        np.testing.assert_allclose(g.numpy(), ref[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert set(unfrozen) == set(ref)
    assert "stage0.mix.weight" in results[0][2]


# ------------------------------------------------------------------ agreement across ranks
@pytest.mark.parametrize("key, mine, theirs, what", [
    ("scale_grads", True, False, "scale_grads"),
    ("overlap_p2p", False, True, "overlap_p2p"),
    ("p2p_transport", "plain", "batch", "p2p_transport"),
    ("loss_fn", mse, None, "whether a loss_fn is given"),
    ("micro", 4, 2, "micro_batch_num"),
    ("cls", Schedule1F1B, ScheduleGPipe, "schedule class"),
    ("dyn_shape", False, True, "dyn_shape"),
])
def test_settings_that_must_match_are_checked_naming_both_ranks(key, mine, theirs, what):
    def body():
        rank = get_platform().rank
        value = mine if rank == 0 else theirs
        cls = value if key == "cls" else Schedule1F1B
        micro = value if key == "micro" else 4
        stage = PipelineStage(torch.nn.Linear(2, 2), rank, 2, dyn_shape=value if key == "dyn_shape" else False)
        options = {key: value} if key in ("scale_grads", "overlap_p2p", "p2p_transport") else {}
        loss_fn = value if key == "loss_fn" else mse
        cls(stage, micro, loss_fn=loss_fn, **options)

    with pytest.raises(RankFailedError, match=f"pipeline ranks disagree on {what}: rank 0 has .* but rank 1 has"):
        LocalCluster(2).run(body)


# ------------------------------------------------------------------ generators and custom functions
@pytest.mark.parametrize("cls, chunks", [(ScheduleGPipe, 2), (Schedule1F1B, 3), (ScheduleInterleaved1F1B, 1),
                                         (ScheduleLoopedBFS, 0)])
def test_generate_checks_the_chunk_count(cls, chunks):
    with pytest.raises(ValueError, match=f"num_chunks.*{chunks}|got num_chunks={chunks}"):
        cls.generate(2, chunks, 4)


def test_generate_checks_ranks_and_micro_batches():
    with pytest.raises(ValueError, match="num_ranks must be an int >= 1, got 0"):
        Schedule1F1B.generate(0, 1, 4)
    with pytest.raises(ValueError, match="needs at least 1 micro-batches, got 0"):
        Schedule1F1B.generate(2, 1, 0)


def test_custom_point_to_point_functions_under_batch_are_refused():
    def body():
        rank = get_platform().rank
        sched = Schedule1F1B(PipelineStage(torch.nn.Linear(2, 2), rank, 2), 2, loss_fn=mse, p2p_transport="batch")
        with pytest.raises(ValueError, match="register one for MetaStepType.BATCH_SEND_RECV"):
            sched.register_custom_function(T.FWD_RECV, lambda step, ctx: None)
        plain = Schedule1F1B(PipelineStage(torch.nn.Linear(2, 2), rank, 2), 2, loss_fn=mse, p2p_transport="plain")
        with pytest.raises(ValueError, match="no BATCH_SEND_RECV steps"):
            plain.register_custom_function(T.BATCH_SEND_RECV, lambda step, ctx: None)

    LocalCluster(2).run(body)


@pytest.mark.parametrize("transport, kind", [("plain", T.BWD_RECV), ("batch", T.BATCH_SEND_RECV)])
def test_custom_communication_functions_run_under_both_transports(transport, kind):
    job = MatrixJob(Schedule1F1B, 1, 3, dict(p2p_transport=transport))

    def body():
        stages, sched = _schedule(job)
        seen = []

        def spy(step, ctx):
            seen.append(str(step))
            ctx.run_default(step)

        sched.register_custom_function(kind, spy)
        x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
        losses = sched.run(x, target=y if stages[-1].is_last else None)
        grads = {f"{st.stage_index}.{n}": g.numpy() for st in stages for n, g in st.named_gradients().items()}
        return {"losses": [float(v) for v in losses], "grads": grads, "seen": seen}

    results = LocalCluster(2).run(body)
    assert any(r["seen"] for r in results)
    check(job, results, 2)


# ------------------------------------------------------------------ errors that say where
def test_stage_error_names_rank_stage_micro_batch_and_step():
    def body():
        rank = get_platform().rank
        module = torch.nn.Linear(2, 2) if rank == 0 else torch.nn.Linear(3, 2)  # wrong input width on rank 1
        sched = ScheduleGPipe(PipelineStage(module, rank, 2), 2, loss_fn=mse)
        x = torch.ones(4, 2)
        sched.run(x, target=torch.ones(4, 2) if rank == 1 else None)

    with pytest.raises(RankFailedError) as info:
        LocalCluster(2).run(body)
    error = info.value.error
    assert isinstance(error, StageError)
    assert "rank 1: the forward of stage 1 on micro-batch 0 (F.s1.m0) failed: RuntimeError: mat1 and mat2" in str(error)
    assert isinstance(error.__cause__, RuntimeError)


# ------------------------------------------------------------------ long waits are logged
def test_a_long_wait_is_logged_with_its_step_and_peer(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_WAIT_LOG_INTERVAL", "0.05")
    logged = threading.Event()
    messages = []

    class Catch(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
            logged.set()

    handler = Catch()
    logger = logging.getLogger("hyper_parallel")
    logger.addHandler(handler)

    class SlowUntilLogged(torch.nn.Module):
        """Rank 0's stage computes until rank 1's wait for it was logged (no sleep)."""

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            assert logged.wait(timeout=60), "the wait was never logged"
            return self.lin(x)

    def body():
        rank = get_platform().rank
        module = SlowUntilLogged() if rank == 0 else torch.nn.Linear(2, 2)
        sched = ScheduleGPipe(PipelineStage(module, rank, 2), 1, loss_fn=mse)
        sched.run(torch.ones(2, 2), target=torch.ones(2, 2) if rank == 1 else None)

    try:
        LocalCluster(2).run(body)
    finally:
        logger.removeHandler(handler)
    assert any("rank 1: RECV_META.s1.m0 waiting for rank 0 has waited" in m for m in messages), messages


# ------------------------------------------------------------------ gradients disabled
def test_run_under_no_grad_points_to_eval():
    def body():
        sched = ScheduleGPipe(PipelineStage(torch.nn.Linear(2, 2), 0, 1), 2, loss_fn=mse)
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"schedule.eval\(\.\.\.\)"):
            sched.run(torch.ones(4, 2), target=torch.ones(4, 2))

    LocalCluster(1).run(body)


def test_run_matrix_job_still_matches_after_an_eval():
    job = MatrixJob(ScheduleInterleaved1F1B, 2, 3)

    def body():
        stages, sched = _schedule(job)
        x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
        sched.eval(x[:3] if stages[0].is_first else None, target=None)  # other shapes: metadata of its own
        return run_matrix_job_with(sched, stages, x, y)

    check(job, LocalCluster(2).run(body), 4)


def run_matrix_job_with(sched: PipelineSchedule, stages, x, y):
    losses = sched.run(x, target=y if stages[-1].is_last else None)
    grads = {f"{st.stage_index}.{n}": g.numpy().copy() for st in stages for n, g in st.named_gradients().items()}
    return {"losses": [float(v) for v in losses], "grads": grads}


def test_matrix_job_is_deterministic_across_transports():
    results = {}
    for transport in ("plain", "batch"):
        for overlap in (False, True):
            job = MatrixJob(ScheduleInterleaved1F1B, 2, 5, dict(p2p_transport=transport, overlap_p2p=overlap))
            results[(transport, overlap)] = LocalCluster(2).run(run_matrix_job, job)
    reference = results[("plain", False)]
    for key, got in results.items():
        for a, b in zip(reference, got):
            assert a["losses"] == b["losses"], key
            for name in a["grads"]:
                assert np.array_equal(a["grads"][name], b["grads"][name]), (key, name)
