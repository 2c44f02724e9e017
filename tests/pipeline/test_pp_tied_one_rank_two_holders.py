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

from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["plain", "batch"])
def test_two_ties_where_a_rank_holds_only_the_second(transport):
    # Tie "a" joins stages 0 and 1, tie "b" stages 0 and 2 (1F1B, 3 ranks). Rank 2 holds no part
    # of "a" and must still take part in summing "b" (ties are synced in name order).
    def stage_ties(s):
        return {0: {"a": "lin.weight", "b": "mix.weight"}, 1: {"a": "lin.weight"}, 2: {"b": "mix.weight"}}[s]

    def body():
        p = get_platform()
        w = weights(3)
        stage = PipelineStage(MLPStage(p.rank, 3, w, False), p.rank, 3, shared_parameters=stage_ties(p.rank))
        sched = Schedule1F1B(stage, MICRO, loss_fn=mse, p2p_transport=transport)
        x, y = (torch.from_numpy(a) for a in batch(2 * MICRO, MICRO, False))
        out = []
        for _ in range(2):
            sched.run(x, target=y if stage.is_last else None)
            out.append({f"{p.rank}.{n}": g.numpy().copy() for n, g in stage.named_gradients().items()})
        return out

    w = weights(3)
    modules = [MLPStage(s, 3, w, False) for s in range(3)]
    modules[1].lin.weight = modules[0].lin.weight
    modules[2].mix.weight = modules[0].mix.weight
    x, y = (torch.from_numpy(a) for a in batch(2 * MICRO, MICRO, False))
    total = 0.0
    for i in range(MICRO):
        out = modules[0](x[2 * i:2 * i + 2])
        for m in modules[1:]:
            out = m(*out)
        total = total + mse(out, y[2 * i:2 * i + 2]) / MICRO
    total.backward()
    ref = {f"{s}.{n}": prm.grad.numpy().copy() for s, m in enumerate(modules) for n, prm in m.named_parameters()}
    ref["1.lin.weight"], ref["2.mix.weight"] = ref["0.lin.weight"], ref["0.mix.weight"]
    results = LocalCluster(3).run(body)
    for step in range(2):
        grads = {k: v for r in results for k, v in r[step].items()}
        assert set(grads) == set(ref)
        for name, g in grads.items():
            expected = (step + 1) * ref[name]
            np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7 * max(float(np.abs(expected).max()), 1.0),
                                       err_msg=f"run {step + 1}: gradient of {name}")
