"""A pipeline whose first stage takes a dict argument and a keyword argument split along dim 1.

Checked on torch LocalCluster against a non-pipelined run of the same modules: every
micro-batch loss (each micro-batch cut by hand with slicing) and every parameter gradient
(one backward of the whole batch's mean loss).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyper_parallel import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

RANKS, MICRO, BATCH, D, OUT = 4, 4, 8, 6, 3
TOL = dict(rtol=1e-5, atol=1e-7)


def weights(num_stages: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    out = []
    for s in range(num_stages):
        cols = OUT if s == num_stages - 1 else D
        out.append({"w": (rng.standard_normal((D, cols)) * 0.6).astype(np.float32),
                    "b": (rng.standard_normal(cols) * 0.1).astype(np.float32)})
    return out


def inputs() -> tuple[dict, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(3)
    batch = {
        "x": torch.from_numpy(rng.standard_normal((BATCH, D)).astype(np.float32)),
        "extra": [torch.from_numpy(rng.standard_normal((BATCH, D)).astype(np.float32)), 0.75],  # split, whole
        "bias": torch.from_numpy(rng.standard_normal(D).astype(np.float32)),  # whole (spec -1)
    }
    mask = torch.from_numpy(rng.uniform(0.5, 1.5, (D, BATCH)).astype(np.float32))  # batch along dim 1
    target = torch.from_numpy(rng.standard_normal((BATCH, OUT)).astype(np.float32))
    return batch, mask, target


class Layer(torch.nn.Module):
    def __init__(self, w: np.ndarray, b: np.ndarray) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.from_numpy(w.copy()))
        self.b = torch.nn.Parameter(torch.from_numpy(b.copy()))


class First(Layer):
    def forward(self, batch, *, mask):
        shift, scale = batch["extra"]
        h = torch.tanh((batch["x"] + shift + batch["bias"]) @ self.w + self.b) * scale
        return h * mask.t()


class Middle(Layer):
    def forward(self, h):
        return torch.tanh(h @ self.w + self.b)


class Last(Layer):
    def forward(self, h):
        return h @ self.w + self.b


def build(s: int, num_stages: int, w: list[dict[str, np.ndarray]]) -> torch.nn.Module:
    cls = First if s == 0 else Last if s == num_stages - 1 else Middle
    return cls(w[s]["w"], w[s]["b"])


def mse(out, target):
    return (out - target).pow(2).mean()


SCHEDULES = {"1f1b": (Schedule1F1B, 1), "interleaved": (ScheduleInterleaved1F1B, 2)}


def rank_body(name: str):
    p = get_platform()
    cls, chunks = SCHEDULES[name]
    num_stages = RANKS * chunks
    w = weights(num_stages)
    stages = [PipelineStage(build(s, num_stages, w), s, num_stages)
              for s in (c * RANKS + p.rank for c in range(chunks))]
    schedule = cls(stages if chunks > 1 else stages[0], MICRO, loss_fn=mse,
                   args_batch_dim=[{"x": 0, "extra": [0, -1], "bias": -1}], kwargs_batch_dim={"mask": 1})
    batch, mask, target = inputs()
    losses = schedule.run(batch, target=target if stages[-1].is_last else None, mask=mask)
    grads = {f"s{st.stage_index}.{k}": g.clone() for st in stages for k, g in st.named_gradients().items()}
    return [float(v) for v in losses], grads


def oracle(num_stages: int):
    modules = [build(s, num_stages, weights(num_stages)) for s in range(num_stages)]
    batch, mask, target = inputs()

    def chain(b, m):
        h = modules[0](b, mask=m)
        for module in modules[1:]:
            h = module(h)
        return h

    size = BATCH // MICRO
    losses = []
    with torch.no_grad():
        for i in range(MICRO):
            rows = slice(i * size, (i + 1) * size)
            micro = {"x": batch["x"][rows], "extra": [batch["extra"][0][rows], 0.75], "bias": batch["bias"]}
            losses.append(float(mse(chain(micro, mask[:, rows]), target[rows])))
    names = [f"s{s}.{k}" for s, m in enumerate(modules) for k, _ in m.named_parameters()]
    params = [prm for m in modules for prm in m.parameters()]
    grads = torch.autograd.grad(mse(chain(batch, mask), target), params)
    return losses, dict(zip(names, grads, strict=True))


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_dict_argument_and_dim1_keyword_match_the_non_pipelined_run(name):
    results = LocalCluster(RANKS, platform="torch", timeout=60).run(rank_body, name)
    ref_losses, ref_grads = oracle(RANKS * SCHEDULES[name][1])
    assert [bool(r[0]) for r in results] == [False] * (RANKS - 1) + [True]
    np.testing.assert_allclose(results[-1][0], ref_losses, **TOL)
    assert len(set(ref_losses)) == MICRO  # every micro-batch saw its own rows
    grads = {k: g for _, rank_grads in results for k, g in rank_grads.items()}
    assert set(grads) == set(ref_grads)
    for key, ref in ref_grads.items():
        torch.testing.assert_close(grads[key], ref, **TOL, msg=key)
