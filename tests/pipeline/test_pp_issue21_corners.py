"""Issue 21 corners on torch LocalCluster: no library thread outlives a run (failed or finished),
MPipe recompute replays the owner's random state, MPipe T=0 takes a parameter-free preprocess."""

from __future__ import annotations

import threading

import pytest
import torch
from mlp_harness import MLPStage, batch, mse, weights

from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster, RankFailedError

# ---------------------------------------------------------------------------------------- threads

MICRO, STEPS = 4, 3


class _Boom(RuntimeError):
    pass


class _FailingStage(MLPStage):
    """An MLP stage whose forward raises at micro-batch ``micro`` of step ``step`` (0-based)."""

    def __init__(self, index, num, w, fail_at):
        super().__init__(index, num, w, False)
        self.calls, self.fail_at = 0, fail_at
        self.seen: set[str] = set()  # library threads alive during the forwards

    def forward(self, h, skip=None):
        self.seen.update(_library_threads())
        step, micro = divmod(self.calls, MICRO)
        self.calls += 1
        if (step, micro) == self.fail_at:
            raise _Boom(f"stage {self.index} fails at step {step} micro-batch {micro}")
        return super().forward(h, skip)


def _library_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hyper-parallel") and t.is_alive())


def _train(failing_rank: int | None, fail_at: tuple[int, int]) -> list[str]:
    p = get_platform()
    w = weights(4)
    stage = PipelineStage(_FailingStage(p.rank, 4, w, fail_at if p.rank == failing_rank else None), p.rank, 4)
    sched = Schedule1F1B(stage, MICRO, loss_fn=mse)
    x, y = (torch.from_numpy(a) for a in batch(2 * MICRO, MICRO, False))
    for _ in range(STEPS):
        sched.run(x, target=y if stage.is_last else None)
        stage.zero_grad()
    return stage.submodule.seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failing_rank, fail_at", [(0, (1, 2)), (0, (0, 0)), (1, (1, 2)), (2, (2, 3)),
                                                   (3, (1, 1)), (3, (0, 3))])
def test_no_library_thread_outlives_a_failed_run(failing_rank, fail_at):
    with pytest.raises(RankFailedError) as info:
        LocalCluster(4, platform="torch").run(_train, failing_rank, fail_at)
    assert info.value.rank == failing_rank and "_Boom" in str(info.value)
    assert _library_threads() == []


@pytest.mark.timeout(120)
def test_no_library_thread_outlives_finished_runs():
    seen = LocalCluster(4, platform="torch").run(_train, None, (-1, -1))
    assert all("hyper-parallel-wait-watch" in names for names in seen)  # the watch ran during the runs ...
    assert _library_threads() == []  # ... and stopped with the last of them
