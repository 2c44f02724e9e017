"""The run contract on MindSpore (LocalCluster): the documented optimizer pattern with several
stages per rank, parameters read at every run, and gradients put back after a failed run."""

from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn  # noqa: E402

from hyper_parallel.core.pipeline_parallel.runtime.executor import StageError  # noqa: E402
from hyper_parallel.core.pipeline_parallel.schedule import ScheduleInterleaved1F1B  # noqa: E402
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage  # noqa: E402
from hyper_parallel.platform import get_platform  # noqa: E402
from hyper_parallel.platform.local import LocalCluster  # noqa: E402

RNG = np.random.default_rng(0)
W = [RNG.standard_normal((4, 4)).astype(np.float32) * 0.5 for _ in range(2)]
X = RNG.standard_normal((4, 4)).astype(np.float32)
Y = RNG.standard_normal((4, 4)).astype(np.float32)


def _cell(k: int) -> nn.Cell:
    """Built apart from the others: its parameters are named 0.weight / 0.bias, like every stage's."""
    cell = nn.SequentialCell(nn.Dense(4, 4))
    cell[0].weight.set_data(ms.Tensor(W[k]))
    cell[0].bias.set_data(ms.Tensor(np.zeros(4, np.float32)))
    return cell


def _mse(out, target):
    return ((out - target) ** 2).mean()


class _FailAt:
    def __init__(self):
        self.armed, self.calls = False, 0

    def __call__(self, out, target):
        if self.armed:
            self.calls += 1
            if self.calls == 2:
                raise FloatingPointError("bad loss")
        return _mse(out, target)


def _reference():
    cells = [_cell(0), _cell(1)]
    params = [p for c in cells for p in c.trainable_params()]

    def loss(x):
        return _mse(cells[1](cells[0](x)), ms.Tensor(Y))

    _, grads = ms.value_and_grad(loss, None, weights=params)(ms.Tensor(X))
    return [g.asnumpy() for g in grads]


def test_two_stages_per_rank_optimizer_pattern_and_failed_run():
    def body():
        p = get_platform()
        loss = _FailAt()
        first, last = _cell(0), _cell(1)
        last_names = [q.name for q in last.trainable_params()]
        stages = [PipelineStage(first, 0, 2), PipelineStage(last, 1, 2)]
        sched = ScheduleInterleaved1F1B(stages, 2, loss_fn=loss)
        params = sched.parameters()
        names = [q.name for q in params]
        optimizer = nn.SGD(params, learning_rate=0.1)  # MindSpore refuses two parameters of one name
        sched.run(ms.Tensor(X), target=ms.Tensor(Y))
        grads = [p.to_numpy(p.get_grad(q)).copy() for q in params]
        loss.armed = True
        with pytest.raises(StageError, match="bad loss"):
            sched.run(ms.Tensor(X), target=ms.Tensor(Y))
        after = [p.to_numpy(p.get_grad(q)).copy() for q in params]
        optimizer(tuple(p.get_grad(q) for q in params))
        last.trainable_params()[1].requires_grad = False  # frozen after the schedule was built
        sched.zero_grad()
        loss.armed = False
        sched.run(ms.Tensor(X), target=ms.Tensor(Y))
        frozen = sorted(sched.named_gradients())
        return names, last_names, grads, after, frozen

    names, last_names, grads, after, frozen = LocalCluster(1, platform="mindspore").run(body)[0]
    assert last_names == ["0.weight", "0.bias"] and len(set(names)) == len(names), names
    for got, ref in zip(grads, _reference()):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    for got, before in zip(after, grads):
        assert np.array_equal(got, before)
    assert frozen == ["stage0.0.bias", "stage0.0.weight", "stage1.0.weight"], frozen
