"""Regressions found by review 9 of the forward-send settling in the runtime (torch LocalCluster)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.base import Handle
from hyper_parallel.platform.local import LocalCluster


class _GlooLikeSend(Handle):
    """A send that completes only when waited (as on gloo): its tensor's data must still be there then."""

    def __init__(self, tensor: torch.Tensor, log: list[str]) -> None:
        self.tensor, self.numel, self.done, self.log = tensor, tensor.numel(), False, log

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        if not self.done and self.tensor.numel() != self.numel:
            self.log.append("a sent output was freed before its send completed")
        self.done = True


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h  # one tensor sent twice


class _Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) * b


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _job(transport: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    p = get_platform()
    log: list[str] = []
    real_isend = p.comm.isend  # the communicator: plain and batched sends both go through it

    def isend(tensor, dst, group=None, tag=0):
        real_isend(tensor, dst, group, tag)
        return _GlooLikeSend(tensor, log)

    p.comm.isend = isend
    module = _Twice() if p.rank == 0 else _Last()
    schedule = Schedule1F1B(PipelineStage(module, p.rank, 2), 4, loss_fn=_mse, p2p_transport=transport)
    torch.manual_seed(5)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    schedule.run(x, target=y if p.rank == 1 else None)
    return log, {f"{p.rank}.{n}": q.grad.clone() for n, q in module.named_parameters()}


@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_output_sent_twice_is_freed_only_after_every_send_of_it_completed(transport):
    # A micro-batch's forward sends were settled one by one: the first send's wait freed the
    # tensor that the second send (same tensor) was still sending (use-after-free on gloo).
    results = LocalCluster(2, timeout=60).run(_job, transport)
    assert results[0][0] == [] and results[1][0] == []
    first, last = _Twice(), _Last()
    torch.manual_seed(5)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    total = sum(_mse(last(*first(x[i * 2:(i + 1) * 2])), y[i * 2:(i + 1) * 2]) for i in range(4)) / 4
    total.backward()
    got = {**results[0][1], **results[1][1]}
    for name, q in [*(("0." + n, q) for n, q in first.named_parameters()),
                    *(("1." + n, q) for n, q in last.named_parameters())]:
        torch.testing.assert_close(got[name], q.grad, rtol=1e-5, atol=1e-6)


def test_switches_take_numpy_bools_and_name_the_refused_type():
    # check_flag refused numpy.bool_ (a bool read from a config array), with "got True" as the reason.
    np = pytest.importorskip("numpy")
    from hyper_parallel.core.pipeline_parallel.ir.placement import check_flag

    assert check_flag("overlap_p2p", np.bool_(True)) is True
    assert check_flag("overlap_p2p", np.bool_(False)) is False
    with pytest.raises(TypeError, match=r"overlap_p2p must be a bool, got 1 \(int\)"):
        check_flag("overlap_p2p", 1)

    def body() -> tuple[object, object]:
        stage = PipelineStage(_Last(), 0, 1, dyn_shape=np.bool_(True), free_sent_outputs=np.bool_(False))
        return stage.dyn_shape, stage.free_sent_outputs

    assert LocalCluster(1, timeout=60).run(body) == [(True, False)]
