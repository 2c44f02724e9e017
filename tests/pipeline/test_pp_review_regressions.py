"""Regressions found by the adversarial review of the runtime rewrite, each with its reproducer."""

from __future__ import annotations

import pytest
import torch
from mlp_harness import MatrixJob, batch, build_stages, check, mse

from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
from hyper_parallel.core.pipeline_parallel.ir.placement import looped_placement
from hyper_parallel.core.pipeline_parallel.runtime.executor import StageError
from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from hyper_parallel.core.pipeline_parallel.schedules import generate_1f1b
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.lowering.validate import ScheduleError, validate_lowered
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import DeadlockError, LocalCluster, RankFailedError


class _FailingBackward(torch.nn.Module):
    """Stage 0 whose first backward raises while ``armed`` (after stage 1 already sent every gradient)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.armed = False

    def forward(self, x):
        out = self.inner(x)
        if self.armed:
            return tuple(_Boom.apply(o) for o in out)
        return out


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise FloatingPointError("backward of stage 0 failed")


@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_a_run_after_a_failed_multi_rank_run_ignores_its_leftover_messages(transport):
    # Rank 0 fails in its first backward after rank 1 sent all its gradients (GPipe): those
    # gradients are left in flight. The next run must not take them for its own.
    job = MatrixJob(ScheduleGPipe, 1, 4, dict(p2p_transport=transport))

    def body():
        p = get_platform()
        stages = build_stages(job, 2, {0: 0, 1: 1})
        if p.rank == 0:
            stages[0].submodule = _FailingBackward(stages[0].submodule)
            stages = [PipelineStage(stages[0].submodule, 0, 2)]
        sched = ScheduleGPipe(stages[0], 4, loss_fn=mse, p2p_transport=transport)
        x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
        target = y if p.rank == 1 else None
        if p.rank == 0:
            stages[0].submodule.armed = True
            with pytest.raises(StageError, match="backward of stage 0 failed"):
                sched.run(x, target=target)
            stages[0].submodule.armed = False
            assert all(prm.grad is None for prm in stages[0].params)
        else:
            sched.run(x, target=target)  # this rank's run completes: its sends were all issued
            sched.zero_grad()
        losses = sched.run(x, target=target)
        grads = {f"{p.rank}.{n.removeprefix('inner.')}": g.numpy().copy()
                 for st in stages for n, g in st.named_gradients().items()}
        return {"losses": [float(v) for v in losses], "grads": grads}

    check(job, LocalCluster(2).run(body), 2)


def test_plain_transport_is_checked_against_nccl_semantics_when_asked():
    placement = looped_placement(2, 1)
    lowered = lower(generate_1f1b(2, 4), placement, "plain")
    validate_lowered(lowered, placement, 4, "plain")  # gloo: fine
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_lowered(lowered, placement, 4, "plain", engine="stream")  # one NCCL stream: both send first


@pytest.mark.parametrize("keep", [True, False])
def test_a_failed_run_keeps_a_tied_holder_s_gradient(keep):
    job = MatrixJob(Schedule1F1B, 1, 4, dict(keep_grads_on_error=keep), tie=True)

    class Raises:
        armed = False

        def __call__(self, out, target):
            if self.armed:
                raise FloatingPointError("loss")
            return mse(out, target)

    def body():
        stages = build_stages(job, 2, {0: 0, 1: 0})  # both holders of the tie on one rank
        loss = Raises()
        sched = ScheduleInterleaved1F1B(stages, 4, loss_fn=loss, keep_grads_on_error=keep)
        x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
        sched.run(x, target=y)
        before = {f"{st.stage_index}.{n}": g.clone() for st in stages for n, g in st.named_gradients().items()}
        loss.armed = True
        with pytest.raises(StageError, match=r"rank 0: .*failed: FloatingPointError: loss"):
            sched.run(x, target=y)
        after = {f"{st.stage_index}.{n}": g for st in stages for n, g in st.named_gradients().items()}
        return before, after

    before, after = LocalCluster(1).run(body)[0]
    assert "1.lin.weight" in after  # the non-owning holder of the tie still has its gradient
    if keep:
        for name, g in before.items():
            assert torch.equal(g, after[name]), name


def test_restore_keeps_the_gradient_tensors():
    def body():
        stage = PipelineStage(torch.nn.Linear(3, 3), 0, 1)
        sched = ScheduleGPipe(stage, 2, loss_fn=lambda out, t: mse(out, t) if not body.fail else 1 / 0)
        body.fail = False
        sched.run(torch.ones(4, 3), target=torch.zeros(4, 3))
        grad = stage.submodule.weight.grad
        view = grad.view(-1)
        value = grad.clone()
        body.fail = True
        with pytest.raises(StageError, match="ZeroDivisionError: division by zero"):
            sched.run(torch.ones(4, 3), target=torch.zeros(4, 3))
        return stage.submodule.weight.grad is grad, torch.equal(view, value.view(-1))

    assert LocalCluster(1).run(body)[0] == (True, True)


def test_an_empty_boundary_with_dyn_shape():
    class Nothing(torch.nn.Module):
        def forward(self, *xs):
            return ()

    class Source(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x):
            return (x * self.w,)

    class Sink(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self):
            return self.w * 2.0

    def body():
        rank = get_platform().rank
        module = [Source(), Nothing(), Sink()][rank]
        sched = Schedule1F1B(PipelineStage(module, rank, 3, dyn_shape=True), 2)
        return [float(v) for v in sched.run(torch.ones(4, 2))]

    assert LocalCluster(3).run(body)[2] == [2.0, 2.0]


@pytest.mark.parametrize("method", ["eval", "step"])
def test_forward_only_without_a_loss_fn_merges_scalar_outputs(method):
    class OwnLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.lin(x).pow(2).mean()

    def body():
        rank = get_platform().rank
        module = torch.nn.Linear(2, 2) if rank == 0 else OwnLoss()
        sched = Schedule1F1B(PipelineStage(module, rank, 2), 4)
        out = getattr(sched, method)(torch.ones(8, 2))
        return None if out is None else tuple(out.shape)

    assert LocalCluster(2).run(body) == [None, (4,)]


def test_loss_shape_errors_name_the_rank():
    def body():
        rank = get_platform().rank
        sched = ScheduleGPipe(PipelineStage(torch.nn.Linear(2, 2), rank, 2), 2, loss_fn=lambda out, t: out)
        sched.run(torch.ones(4, 2), target=torch.ones(4, 2) if rank == 1 else None)

    with pytest.raises(RankFailedError, match=r"rank 1: the loss of micro-batch 0 must be a scalar tensor"):
        LocalCluster(2).run(body)


def test_a_deadlock_is_reported_as_one_not_as_a_failed_peer():
    def body():
        rank = get_platform().rank
        sched = ScheduleGPipe(PipelineStage(torch.nn.Linear(2, 2), rank, 2), 2, loss_fn=mse)
        if rank == 0:
            return None  # never runs: rank 1 waits for it forever
        sched.run(target=torch.ones(4, 2))

    with pytest.raises(RankFailedError) as info:
        LocalCluster(2).run(body)
    assert isinstance(info.value.error, DeadlockError), info.value.error


def test_parameters_are_listed_once_per_run():
    calls = []

    class Counting(torch.nn.Linear):
        def parameters(self, recurse=True):  # noqa: D102 - counts the walks over the parameters
            calls.append(1)
            return super().parameters(recurse)

        def named_parameters(self, *args, **kwargs):  # noqa: D102
            calls.append(1)
            return super().named_parameters(*args, **kwargs)

    def body():
        sched = ScheduleGPipe(PipelineStage(Counting(2, 2), 0, 1), 8, loss_fn=mse)
        calls.clear()
        sched.run(torch.ones(8, 2), target=torch.ones(8, 2))
        return len(calls)

    assert LocalCluster(1).run(body)[0] <= 3  # not once per micro-batch (8)
