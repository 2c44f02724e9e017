"""Issue 22: the batch lists made by levels run bitwise the same as the lists of the lowering they
replaced. Every library schedule on LocalCluster (torch, 4 ranks, ``batch``, ``overlap_p2p``) runs
one training step with the lists a rank plans now and again with the old lowering's lists
(``_lowering_oracle.py``) put in their place: every loss and every gradient must be equal, bit for
bit (only where receives are posted differs, never what is computed or in which order)."""

from __future__ import annotations

import _lowering_oracle
import pytest

import hyper_parallel.core.pipeline_parallel as pp
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

P = 4
SCHEDULES = [("ScheduleGPipe", 1, 6), ("Schedule1F1B", 1, 6), ("ScheduleInterleaved1F1B", 2, 8),
             ("ScheduleLoopedBFS", 2, 5), ("ScheduleInterleavedZeroBubble", 2, 8), ("ScheduleZBVZeroBubble", 2, 8),
             ("ScheduleDualPipeV", 2, 8)]


def _step(name, chunks, micro, use_old):
    import torch

    rank = get_platform().rank
    cls = getattr(pp, name)
    placement = cls.stage_placement(P, chunks)
    mine = sorted(s for s, r in placement.items() if r == rank)
    stages = []
    for s in mine:
        torch.manual_seed(100 + s)
        layer = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
        stages.append(PipelineStage(layer, s, len(placement)))
    schedule = cls(stages, micro, p2p_transport="batch", loss_fn=lambda out, target: (out - target).pow(2).mean())
    metadata = schedule._training_metadata()
    planned = schedule._lowered(metadata)
    assert sorted(planned) == [rank]  # the rank planned its own list
    if use_old:
        old = _lowering_oracle.lower(cls.generate(P, chunks, micro), placement, "batch", metadata=metadata,
                                     prefetch=True)
        assert old[rank] != planned[rank] or name == "ScheduleGPipe"  # the lists do differ (mostly)
        schedule._lowered_cache[(metadata, False)] = {rank: old[rank]}
    torch.manual_seed(7)
    x, y = torch.randn(2 * micro, 6), torch.randn(2 * micro, 6)
    losses = schedule.run(x, target=y)
    grads = {f"{st.stage_index}.{n}": prm.grad.clone() for st in stages for n, prm in st.submodule.named_parameters()}
    return [loss.detach().clone() for loss in losses], grads


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, chunks, micro", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_batch_lists_by_levels_compute_bitwise_what_the_old_lists_did(name, chunks, micro):
    import torch

    new = LocalCluster(P, platform="torch").run(_step, name, chunks, micro, False)
    old = LocalCluster(P, platform="torch").run(_step, name, chunks, micro, True)
    compared = 0
    for (new_losses, new_grads), (old_losses, old_grads) in zip(new, old, strict=True):
        assert len(new_losses) == len(old_losses)
        assert all(torch.equal(a, b) for a, b in zip(new_losses, old_losses))
        assert new_grads.keys() == old_grads.keys()
        for key in new_grads:
            assert torch.equal(new_grads[key], old_grads[key]), key
            compared += 1
    assert compared >= 2 * P
