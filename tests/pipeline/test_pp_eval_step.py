"""eval() and step() against the same stages chained without a pipeline; outputs kept or freed
after sending; many tensors across a boundary; the stage's device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mlp_harness import MatrixJob, MLPStage, batch, build_stages, mse, weights

from hyper_parallel.core.pipeline_parallel.schedule import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

SCHEDULES = [(ScheduleGPipe, 1), (Schedule1F1B, 1), (ScheduleInterleaved1F1B, 2), (ScheduleLoopedBFS, 2)]


def _chain(num: int, x: torch.Tensor) -> torch.Tensor:
    w = weights(num)
    out = MLPStage(0, num, w, False)(x)
    for s in range(1, num):
        out = MLPStage(s, num, w, False)(*out)
    return out


@pytest.mark.parametrize("cls, v", SCHEDULES)
@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_eval_returns_losses_or_outputs_and_touches_no_gradient(cls, v, transport):
    job = MatrixJob(cls, v, 4, dict(p2p_transport=transport, overlap_p2p=True))

    def body():
        p = get_platform()
        placement = cls.stage_placement(p.world_size, v)
        stages = build_stages(job, len(placement), placement)
        sched = cls(stages if v > 1 else stages[0], 4, loss_fn=mse, **job.options)
        x, y = (torch.from_numpy(a) for a in batch(8, 4, False))
        last = stages[-1].is_last
        losses = sched.eval(x, target=y if last else None)
        outputs = sched.eval(x)  # no target: the merged outputs
        odd = sched.eval(x[:4], target=y[:4] if last else None)  # another batch size: shapes of its own
        grads = [prm.grad for st in stages for prm in st.params]
        if not last:
            return losses, outputs, odd, grads
        return [float(v) for v in losses], outputs.numpy(), len(odd), grads

    results = LocalCluster(2).run(body)
    x, y = (torch.from_numpy(a) for a in batch(8, 4, False))
    with torch.no_grad():
        expected = _chain(2 * v, x)
    per_micro = [float(mse(expected[2 * i:2 * i + 2], y[2 * i:2 * i + 2])) for i in range(4)]
    losses, outputs, odd, _ = results[-1]
    np.testing.assert_allclose(losses, per_micro, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(outputs, expected.numpy(), rtol=1e-6, atol=1e-7)
    assert odd == 4  # one loss per micro-batch, of the other batch size
    assert results[0][:3] == (None, None, None)
    assert all(g is None for r in results for g in r[3])


@pytest.mark.parametrize("cls, v", SCHEDULES)
def test_step_fills_losses_and_returns_the_merged_output(cls, v):
    job = MatrixJob(cls, v, 4)

    def body():
        p = get_platform()
        placement = cls.stage_placement(p.world_size, v)
        stages = build_stages(job, len(placement), placement)
        sched = cls(stages if v > 1 else stages[0], n_microbatches=4, loss_fn=mse)
        x, y = (torch.from_numpy(a) for a in batch(8, 4, False))
        losses: list = []
        out = sched.step(x if stages[0].is_first else None, target=y if stages[-1].is_last else None, losses=losses)
        grads = {f"{st.stage_index}.{n}": g.numpy().copy() for st in stages for n, g in st.named_gradients().items()}
        return [float(v) for v in losses], None if out is None else out.detach().numpy(), grads

    results = LocalCluster(2).run(body)
    x, y = (torch.from_numpy(a) for a in batch(8, 4, False))
    with torch.no_grad():
        expected = _chain(2 * v, x)
    losses, out, _ = results[-1]
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-6, atol=1e-7)
    assert len(losses) == 4 and results[0][0] == [] and results[0][1] is None
    assert all(r[2] for r in results)  # gradients were made


def test_step_without_a_loss_fn_is_forward_only_as_in_torch_pipelining():
    def body():
        rank = get_platform().rank
        stage = PipelineStage(torch.nn.Linear(3, 3), rank, 2)
        sched = Schedule1F1B(stage, 2)
        out = sched.step(torch.ones(4, 3))
        return out, stage.submodule.weight.grad

    results = LocalCluster(2).run(body)
    assert results[0][0] is None and results[1][0].shape == (4, 3)
    assert results[0][1] is None and results[1][1] is None


class KeepsItsOutput(torch.nn.Module):
    """A stage whose forward hook keeps a reference to the output it sends."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.kept: list[torch.Tensor] = []
        self.register_forward_hook(lambda mod, inp, out: self.kept.append(out))

    def forward(self, x):
        return self.lin(x) * 2.0  # a product's output is not saved by its own backward: releasable


@pytest.mark.parametrize("free", [True, False])
def test_sent_outputs_are_freed_unless_the_stage_opts_out(free):
    def body():
        rank = get_platform().rank
        module = KeepsItsOutput() if rank == 0 else torch.nn.Linear(4, 4)
        stage = PipelineStage(module, rank, 2, free_sent_outputs=free)
        sched = ScheduleGPipe(stage, 2, loss_fn=mse)
        sched.run(torch.ones(4, 4), target=torch.ones(4, 4) if rank == 1 else None)
        return [t.numel() for t in module.kept] if rank == 0 else None

    sizes = LocalCluster(2).run(body)[0]
    assert sizes == ([0, 0] if free else [8, 8])


class ManyOut(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        base = self.lin(x)
        return tuple(base * (k + 1) for k in range(self.n))


class SumIn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, *xs):
        return self.lin(sum(xs))


@pytest.mark.parametrize("dyn", [False, True])
def test_many_tensors_cross_a_boundary(dyn):
    n = 60  # 60 tensors of 3 dims: well past what a fixed 128-int metadata buffer held

    def modules():
        torch.manual_seed(0)
        return ManyOut(n), SumIn()

    def body():
        rank = get_platform().rank
        module = modules()[rank]
        stage = PipelineStage(module, rank, 2, dyn_shape=dyn)
        sched = Schedule1F1B(stage, 2, loss_fn=mse)
        losses = sched.run(torch.ones(4, 1, 2), target=torch.zeros(4, 1, 2) if rank == 1 else None)
        return [float(v) for v in losses], module.lin.weight.grad.clone()

    results = LocalCluster(2).run(body)
    first, last = modules()
    loss = mse(last(*first(torch.ones(4, 1, 2))), torch.zeros(4, 1, 2))
    loss.backward()
    assert np.mean(results[1][0]) == pytest.approx(float(loss.detach()), rel=1e-6)
    torch.testing.assert_close(results[0][1], first.lin.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], last.lin.weight.grad, rtol=1e-5, atol=1e-6)


def test_stage_device_is_checked_and_used():
    def body():
        stage = PipelineStage(torch.nn.Linear(2, 2), 0, 1, device="cpu")
        assert stage.device == torch.device("cpu")
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="device cuda.* is not available"):
                PipelineStage(torch.nn.Linear(2, 2), 0, 1, device="cuda")
        with pytest.raises(ValueError, match="not a torch device"):
            PipelineStage(torch.nn.Linear(2, 2), 0, 1, device="no-such-device")
        sched = ScheduleGPipe(stage, 2, loss_fn=mse)
        return sched.run(torch.ones(4, 2), target=torch.ones(4, 2))

    assert len(LocalCluster(1).run(body)[0]) == 2


def test_eval_with_a_run_hook_written_without_before_eval():
    """A feature's run hook that is not a RunHook subclass (the documented duck type: before_run,
    after_run, on_failure) keeps working in eval(), which asks hooks for before_eval only if they have it."""
    calls = []

    class CountingHook:
        def before_run(self, schedule, runtime):
            calls.append("before_run")

        def after_run(self, schedule, runtime):
            calls.append("after_run")

        def on_failure(self, schedule):
            calls.append("on_failure")

    job = MatrixJob(Schedule1F1B, 1, 4, dict(p2p_transport="plain", overlap_p2p=True))

    def body():
        p = get_platform()
        placement = Schedule1F1B.stage_placement(p.world_size, 1)
        stages = build_stages(job, len(placement), placement)
        sched = Schedule1F1B(stages[0], 4, loss_fn=mse, **job.options)
        sched.add_feature(hook=CountingHook())
        x, y = (torch.from_numpy(a) for a in batch(8, 4, False))
        last = stages[-1].is_last
        sched.eval(x, target=y if last else None)
        sched.run(x, target=y if last else None)
        return True

    assert LocalCluster(2).run(body) == [True, True]
    assert calls.count("before_run") == 2 and calls.count("after_run") == 2 and "on_failure" not in calls
