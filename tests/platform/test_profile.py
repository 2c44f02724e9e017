"""The profiler on both frameworks: times, bytes, gradients left as they were."""

from __future__ import annotations

import pytest

from hyper_parallel.core.pipeline_parallel.profile import profile_stages

BATCH, WIDTH = 8, 64


def test_torch_times_and_bytes():
    torch = pytest.importorskip("torch")
    from hyper_parallel.platform.torch import TorchPlatform

    torch.manual_seed(0)
    stages = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(2)]
    before = [p.grad for s in stages for p in s.parameters()]
    result = profile_stages(stages, torch.randn(BATCH, WIDTH), platform=TorchPlatform(), warmup=0, repeats=2)
    assert [p.grad for s in stages for p in s.parameters()] == before
    costs = result.costs
    assert costs.micro_batch_size == BATCH and len(costs.stages) == 2 and result.notes == []
    one = BATCH * WIDTH * 4  # one float32 activation of the micro-batch
    first, last = costs.stages
    # the forward saves the Linear's input (for dW) and the Tanh's output (for its own backward)
    assert first.activation_bytes == last.activation_bytes == 2 * one
    # after the input backward of stage 1 only the Linear's input (needed for dW) is left
    assert last.activation_bytes_after_input == one
    assert first.output_bytes == one and last.output_bytes == 0
    assert first.param_bytes == (WIDTH * WIDTH + WIDTH) * 4
    for stage in costs.stages:
        assert min(stage.F, stage.B, stage.I, stage.W) > 0
        assert 0 <= stage.overhead_ms <= min(stage.F, stage.B, stage.I, stage.W)
    assert [len(t["F"]) for t in result.raw_ms] == [4, 4]  # two forwards per repetition


def test_argument_checks():
    with pytest.raises(ValueError, match="at least one stage module"):
        profile_stages([], None)
    with pytest.raises(ValueError, match="repeats must be an int >= 1, got 0"):
        profile_stages([object()], None, repeats=0)
    with pytest.raises(ValueError, match="loss_fn needs a target"):
        profile_stages([object()], None, loss_fn=lambda o, t: o)


@pytest.mark.timeout(240)
def test_mindspore_times_and_what_it_cannot_measure():
    ms = pytest.importorskip("mindspore")
    import numpy as np

    from hyper_parallel.platform.mindspore import MindSporePlatform

    platform = MindSporePlatform()
    stages = [ms.nn.SequentialCell([ms.nn.Dense(8, 8), ms.nn.Tanh()]) for _ in range(2)]
    sample = ms.Tensor(np.ones((4, 8), np.float32))
    result = profile_stages(stages, sample, platform=platform, warmup=0, repeats=1, fit_overhead=False)
    assert result.notes == ["activation bytes are not measured on the mindspore platform (left at 0)"]
    first, last = result.costs.stages
    assert first.param_bytes == (8 * 8 + 8) * 4 and first.output_bytes == 4 * 8 * 4
    assert min(first.F, first.B, first.I, first.W, last.F, last.B) > 0
    assert first.activation_bytes == 0
    for cell in stages:
        for _, param in platform.named_parameters(cell):
            assert platform.get_grad(param) is None
