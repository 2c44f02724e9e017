"""Edge cases found in review, each against a non-pipelined run of the same modules and batch."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleLoopedBFS
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster, RankFailedError


class Tanh(torch.nn.Module):
    def __init__(self, seed: int, d: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(d, d, generator=g) * 0.5)
        self.register_buffer("table", torch.arange(float(d)))

    def forward(self, x):
        return torch.tanh(x @ self.w)


class ReturnsBuffer(Tanh):
    """Returns a buffer next to its result: the buffer must survive being sent."""

    def forward(self, x):
        return torch.tanh(x @ self.w), self.table


class TakesBuffer(Tanh):
    def forward(self, x, table):
        return (x @ self.w + table).pow(2).mean()


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


class Residual(Tanh):
    """Returns (hidden, residual) where hidden's matmul saved residual for its backward."""

    def forward(self, x):
        residual = torch.tanh(x @ self.w)
        return residual @ self.w, residual


class WithMask(Tanh):
    """Returns a float mask computed without gradient next to its result."""

    def forward(self, x):
        return torch.tanh(x @ self.w), (x > 0).float()


class TwoInputLoss(Tanh):
    def forward(self, hidden, residual):
        return (hidden * residual @ self.w).pow(2).mean()


class SquareLoss(Tanh):
    def forward(self, x):
        return (x @ self.w).pow(2).mean()


def _oracle(modules, x, m):
    """Mean over micro-batches of the chained modules' losses, one backward, no pipeline."""
    total = 0
    for chunk in x.chunk(m):
        out = chunk
        for mod in modules:
            out = mod(*out) if isinstance(out, tuple) else mod(out)
        total = total + out
    (total / m).backward()
    return {f"{i}.{n}": p.grad.clone() for i, mod in enumerate(modules) for n, p in mod.named_parameters()}


def _pipeline(builders, x, m, schedule=Schedule1F1B):
    def body():
        p = get_platform()
        module = builders[p.rank]()
        stage = PipelineStage(module, p.rank, len(builders))
        schedule(stage, m).run(x)
        state = {n: b.clone() for n, b in module.named_buffers()}
        return {f"{p.rank}.{n}": g.clone() for n, g in stage.named_gradients().items()}, state

    return LocalCluster(len(builders), platform="torch").run(body)


@pytest.mark.parametrize("case", ["buffer", "identity", "saved_residual", "no_grad_output"])
def test_outputs_the_backward_or_the_model_still_needs_are_not_released(case):
    builders = {
        "buffer": [lambda: ReturnsBuffer(0), lambda: TakesBuffer(1)],
        "identity": [lambda: Tanh(0), Identity, lambda: SquareLoss(2)],
        "saved_residual": [lambda: Residual(0), lambda: TwoInputLoss(1)],
        "no_grad_output": [lambda: WithMask(0), lambda: TwoInputLoss(1)],
    }[case]
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    expected = _oracle([b() for b in builders], x, 4)
    results = _pipeline(builders, x, 4)
    grads = {k: v for g, _ in results for k, v in g.items()}
    assert set(grads) == set(expected)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=0, atol=1e-6)
    for _, buffers in results:  # a module's buffer is never emptied
        if "table" in buffers:
            assert buffers["table"].tolist() == [0.0, 1.0, 2.0, 3.0]


class UsesShared(torch.nn.Module):
    def __init__(self, w, last: bool) -> None:
        super().__init__()
        self.w, self.last = w, last

    def forward(self, x):
        y = x @ self.w
        return y.pow(2).mean() if self.last else torch.tanh(y)


@pytest.mark.parametrize("declare_tie", [False, True])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_one_parameter_object_in_two_stages_of_a_rank(declare_tie, m):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 4) * 0.5)
    x = torch.randn(4, 4)
    reference = w.detach().clone().requires_grad_(True)
    _oracle([UsesShared(reference, False), UsesShared(reference, True)], x, m)
    earlier = torch.ones(4, 4)

    def body():
        w.grad = earlier.clone()  # gradients add on top of what was there, scaled only for this step
        ties = {"w": w} if declare_tie else {}
        stages = [PipelineStage(UsesShared(w, False), 0, 2, shared_parameters=ties),
                  PipelineStage(UsesShared(w, True), 1, 2, shared_parameters=ties)]
        ScheduleLoopedBFS(stages, m).run(x)
        return w.grad.clone()

    got = LocalCluster(1, platform="torch").run(body)[0]
    torch.testing.assert_close(got, reference.grad + earlier, rtol=0, atol=1e-6)


class TupleTargetLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.eye(4))

    def forward(self, x):
        return x @ self.w


def test_tuple_target_is_split_per_micro_batch():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    labels = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    weights = torch.rand(6, 1, generator=torch.Generator().manual_seed(3))

    def loss_fn(out, target):
        lab, wt = target
        return ((out - lab).pow(2) * wt).mean()

    def body():
        stage = PipelineStage(TupleTargetLoss(), 0, 1)
        losses = ScheduleGPipe(stage, 3, loss_fn=loss_fn).run(x, target=(labels, weights))
        return [float(v) for v in losses], stage.named_gradients()["w"].clone()

    losses, grad = LocalCluster(1, platform="torch").run(body)[0]
    ref = TupleTargetLoss()
    expected = [float(loss_fn(ref(a), (b, c)).detach()) for a, b, c in zip(x.chunk(3), labels.chunk(3), weights.chunk(3))]
    assert losses == pytest.approx(expected, abs=1e-6)
    (sum(loss_fn(ref(a), (b, c)) for a, b, c in zip(x.chunk(3), labels.chunk(3), weights.chunk(3))) / 3).backward()
    torch.testing.assert_close(grad, ref.w.grad, rtol=0, atol=1e-6)
    with pytest.raises(RankFailedError, match="target must be a tensor or a tuple/list/dict of tensors, got str"):
        LocalCluster(1, platform="torch").run(
            lambda: ScheduleGPipe(PipelineStage(TupleTargetLoss(), 0, 1), 3, loss_fn=loss_fn).run(x, target="y")
        )


class ListOutput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.eye(4) * 0.5)

    def forward(self, x):
        return [x @ self.w, x.sum(-1)]


def test_last_stage_returning_a_list_with_a_loss_fn_and_merged_outputs():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))

    def loss_fn(out, target):
        return (out[0] - target).pow(2).mean() + out[1].mean()

    def body():
        stage = PipelineStage(ListOutput(), 0, 1)
        schedule = ScheduleGPipe(stage, 3, loss_fn=loss_fn, output_concat_dim=0)
        losses = schedule.run(x, target=x)
        return [float(v) for v in losses], schedule.outputs, stage.named_gradients()["w"].clone()

    losses, outputs, grad = LocalCluster(1, platform="torch").run(body)[0]
    ref = ListOutput()
    expected = [loss_fn(ref(a), a) for a in x.chunk(3)]
    assert losses == pytest.approx([float(e.detach()) for e in expected], abs=1e-6)
    (sum(expected) / 3).backward()
    torch.testing.assert_close(grad, ref.w.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(outputs[0], (x @ ref.w).detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(outputs[1], x.sum(-1), rtol=0, atol=1e-6)
