"""A tie held by two stages on one non-owner rank (looped placement), over several runs.

Interleaved 1F1B on 2 ranks x 2 chunks puts stages 0 and 2 on rank 0 and stages 1 and 3 on
rank 1. Tying ``lin.weight`` of stages 0, 1 and 3 makes rank 0 the owner and rank 1 hold the
tie twice. The owner must send the summed gradient to rank 1 once (not once per stage there):
a second copy is left in flight and the next run reads it as its own sum.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mlp_harness import MLPStage, batch, mse, weights

from hyper_parallel.core.pipeline_parallel.schedule import ScheduleInterleaved1F1B, ScheduleLoopedBFS
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

NUM_STAGES, MICRO, RUNS = 4, 4, 3
TIED = (0, 1, 3)


def _stages(placement: dict[int, int]) -> list[PipelineStage]:
    p = get_platform()
    w = weights(NUM_STAGES)
    out = []
    for s in sorted(st for st, r in placement.items() if r == p.rank):
        ties = {"tie": "lin.weight"} if s in TIED else {}
        out.append(PipelineStage(MLPStage(s, NUM_STAGES, w, False), s, NUM_STAGES, shared_parameters=ties))
    return out


def _oracle() -> dict[str, np.ndarray]:
    w = weights(NUM_STAGES)
    modules = [MLPStage(s, NUM_STAGES, w, False) for s in range(NUM_STAGES)]
    for s in TIED[1:]:
        modules[s].lin.weight = modules[TIED[0]].lin.weight
    x, y = (torch.from_numpy(a) for a in batch(2 * MICRO, MICRO, False))
    per = 2
    total = 0.0
    for i in range(MICRO):
        out = modules[0](x[i * per:(i + 1) * per])
        for m in modules[1:]:
            out = m(*out)
        total = total + mse(out, y[i * per:(i + 1) * per]) / MICRO
    total.backward()
    grads = {f"{s}.{n}": prm.grad.numpy().copy() for s, m in enumerate(modules) for n, prm in m.named_parameters()}
    for s in TIED[1:]:
        grads[f"{s}.lin.weight"] = grads[f"{TIED[0]}.lin.weight"]
    return grads


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", [ScheduleInterleaved1F1B, ScheduleLoopedBFS])
@pytest.mark.parametrize("transport", ["plain", "batch"])
@pytest.mark.parametrize("zero_between", [False, True])
def test_tie_held_twice_on_one_non_owner_rank_over_several_runs(cls, transport, zero_between):
    def body():
        p = get_platform()
        placement = cls.stage_placement(p.world_size, 2)
        stages = _stages(placement)
        sched = cls(stages, MICRO, loss_fn=mse, p2p_transport=transport)
        x, y = (torch.from_numpy(a) for a in batch(2 * MICRO, MICRO, False))
        target = y if stages[-1].is_last else None
        per_run = []
        for _ in range(RUNS):
            if zero_between:
                sched.zero_grad()
            sched.run(x, target=target)
            per_run.append({f"{st.stage_index}.{n}": g.numpy().copy()
                            for st in stages for n, g in st.named_gradients().items()})
        return per_run

    results = LocalCluster(2).run(body)
    ref = _oracle()
    for step in range(RUNS):
        factor = 1 if zero_between else step + 1  # gradients accumulate over runs unless zeroed
        grads: dict[str, np.ndarray] = {}
        for per_run in results:
            grads.update(per_run[step])
        assert set(grads) == set(ref), set(grads) ^ set(ref)
        for name, g in grads.items():
            expected = factor * ref[name]
            scale = max(float(np.abs(expected).max()), 1.0)
            np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7 * scale,
                                       err_msg=f"run {step + 1}: gradient of {name}")
