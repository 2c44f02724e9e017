"""A stage that returns None or a non-tensor is reported on its own rank, with one message on both backends."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel import PipelineStage, ScheduleGPipe
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster, RankFailedError

RETURNS = {
    "none": lambda y: None,
    "int": lambda y: 3,
    "tuple with an int": lambda y: (y, 3),
}


def _module(backend: str, first_returns):
    """A Dense/Linear layer; on rank 0 its output goes through ``first_returns``."""
    rank = get_platform().rank
    if backend == "torch":
        import torch

        class Layer(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.dense = torch.nn.Linear(4, 4)

            def forward(self, x):
                y = self.dense(x)
                return first_returns(y) if rank == 0 else y

        return Layer()
    import mindspore as ms

    class Cell(ms.nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.dense = ms.nn.Dense(4, 4)

        def construct(self, x):
            y = self.dense(x)
            return first_returns(y) if rank == 0 else y

    return Cell()


def _two_stage_step(backend: str, returns: str) -> None:
    p = get_platform()
    stage = PipelineStage(_module(backend, RETURNS[returns]), p.rank, 2)
    schedule = ScheduleGPipe(stage, 2, loss_fn=lambda out, target: (out * target).sum())
    x = p.from_numpy(np.ones((4, 4), np.float32))
    schedule.run(x, target=x)


@pytest.mark.parametrize(
    ("backend", "returns", "got"),
    [
        ("torch", "none", "NoneType"),
        ("torch", "int", "int"),
        ("torch", "tuple with an int", "int"),
        ("mindspore", "none", "NoneType"),
        ("mindspore", "tuple with an int", "int"),
    ],
)
def test_non_tensor_stage_output_is_reported_on_the_rank_that_returned_it(backend, returns, got):
    if backend == "mindspore":
        pytest.importorskip("mindspore")
    expected = rf"rank 0 failed: TypeError: rank 0: stage 0 must return tensors to pass to stage 1, got {got} \(micro-batch 0\)$"
    with pytest.raises(RankFailedError, match=expected) as info:
        LocalCluster(2, platform=backend, timeout=60).run(_two_stage_step, backend, returns)
    assert info.value.rank == 0
