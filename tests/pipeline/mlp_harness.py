"""A tiny MLP pipeline for wide option matrices on torch LocalCluster, and its non-pipelined oracle.

Every stage maps two tensors ``(h, skip)`` to two tensors (so two tensors cross every
boundary); the first stage takes ``x`` and the last returns one prediction for an MSE loss.
With ``tie`` the first and the last stage share one weight (``shared_parameters``). With
``vary`` the first stage cuts its output to a width that depends on the micro-batch (read
from the input), so shapes change from micro-batch to micro-batch (``dyn_shape``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform

WIDTH = 6
TOL = dict(rtol=1e-5, atol=1e-7)


class MLPStage(nn.Module):
    def __init__(self, index: int, num: int, weights: dict[str, np.ndarray], vary: bool) -> None:
        super().__init__()
        self.index, self.num, self.vary = index, num, vary
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.from_numpy(weights[f"{index}.lin.weight"]))
            self.lin.bias.copy_(torch.from_numpy(weights[f"{index}.lin.bias"]))
            self.mix.weight.copy_(torch.from_numpy(weights[f"{index}.mix.weight"]))

    def forward(self, h: torch.Tensor, skip: torch.Tensor | None = None) -> Any:
        if self.index == 0:
            x = h
            h = torch.tanh(self.lin(x))
            skip = self.mix(x)
            if self.vary:  # a width set by the data: micro-batch i of the demo batch has width 3 + i % 3
                width = 3 + int(x[0, 0].round().item()) % 3
                h, skip = h[:, :width], skip[:, :width]
            return h, skip
        width = h.shape[1]
        h = torch.tanh(h @ self.lin.weight[:width, :width].t() + self.lin.bias[:width]) + skip
        skip = skip @ self.mix.weight[:width, :width].t()
        if self.index == self.num - 1:
            return (h * skip).sum(dim=1, keepdim=True)
        return h, skip


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def weights(num: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for s in range(num):
        out[f"{s}.lin.weight"] = (rng.standard_normal((WIDTH, WIDTH)) * 0.5).astype(np.float32)
        out[f"{s}.lin.bias"] = (rng.standard_normal(WIDTH) * 0.1).astype(np.float32)
        out[f"{s}.mix.weight"] = (rng.standard_normal((WIDTH, WIDTH)) * 0.5).astype(np.float32)
    return out


def batch(size: int, micro: int, vary: bool, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size, WIDTH)).astype(np.float32)
    if vary:  # the first feature of every row of micro-batch i is i: width 3 + i % 3 there
        per = size // micro
        x[:, 0] = np.repeat(np.arange(micro, dtype=np.float32), per)
    return x, rng.standard_normal((size, 1)).astype(np.float32)


@dataclass
class MatrixJob:
    schedule_cls: Any
    chunks: int
    micro: int
    options: dict[str, Any] = field(default_factory=dict)
    dyn_shape: bool = False
    vary: bool = False
    tie: bool = False
    batch_size: int = 0

    def size(self) -> int:
        return self.batch_size or 2 * self.micro


def build_stages(job: MatrixJob, num_stages: int, placement: dict[int, int]) -> list[PipelineStage]:
    p = get_platform()
    w = weights(num_stages)
    stages = []
    for s in sorted(st for st, r in placement.items() if r == p.rank):
        ties = {"tie": "lin.weight"} if job.tie and s in (0, num_stages - 1) else {}
        stages.append(PipelineStage(MLPStage(s, num_stages, w, job.vary), s, num_stages, dyn_shape=job.dyn_shape,
                                    shared_parameters=ties))
    return stages


def run_matrix_job(job: MatrixJob) -> dict[str, Any]:
    """Body of one rank: losses (per micro-batch) and gradients by ``stage.param`` name."""
    p = get_platform()
    placement = job.schedule_cls.stage_placement(p.world_size, job.chunks)
    stages = build_stages(job, len(placement), placement)
    schedule = job.schedule_cls(stages if len(stages) > 1 else stages[0], job.micro, loss_fn=mse, **job.options)
    x, y = batch(job.size(), job.micro, job.vary)
    target = torch.from_numpy(y) if stages[-1].is_last else None
    losses = schedule.run(torch.from_numpy(x), target=target)
    grads = {f"{st.stage_index}.{n}": g.numpy().copy() for st in stages for n, g in st.named_gradients().items()}
    return {"losses": [float(v) for v in losses], "grads": grads, "peak": schedule.peak_activations}


def oracle(job: MatrixJob, num_stages: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """Per-micro-batch losses and gradients of the same stages chained in one process."""
    w = weights(num_stages)
    modules = [MLPStage(s, num_stages, w, job.vary) for s in range(num_stages)]
    if job.tie and num_stages > 1:
        modules[-1].lin.weight = modules[0].lin.weight
    x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, job.vary))

    def chain(xs: torch.Tensor) -> torch.Tensor:
        out = modules[0](xs)
        for m in modules[1:]:
            out = m(*out)
        return out

    per = job.size() // job.micro
    total = 0.0
    losses = []
    for i in range(job.micro):
        loss = mse(chain(x[i * per:(i + 1) * per]), y[i * per:(i + 1) * per])
        losses.append(float(loss.detach()))
        total = total + loss / job.micro  # mean over micro-batches = the full-batch mean loss
    total.backward()
    grads = {}
    for s, m in enumerate(modules):
        for n, prm in m.named_parameters():
            if prm.grad is not None:
                grads[f"{s}.{n}"] = prm.grad.numpy().copy()
    if job.tie and num_stages > 1:
        grads[f"{num_stages - 1}.lin.weight"] = grads["0.lin.weight"]
    return losses, grads


def check(job: MatrixJob, results: list[dict[str, Any]], num_stages: int) -> None:
    ref_losses, ref_grads = oracle(job, num_stages)
    losses = next(r["losses"] for r in results if r["losses"])
    np.testing.assert_allclose(losses, ref_losses, **TOL, err_msg="per-micro-batch losses")
    grads: dict[str, np.ndarray] = {}
    for r in results:
        grads.update(r["grads"])
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name, g in grads.items():
        ref = ref_grads[name]
        scale = float(np.abs(ref).max()) or 1.0
        np.testing.assert_allclose(g, ref, rtol=TOL["rtol"], atol=TOL["atol"] * max(scale, 1.0),
                                   err_msg=f"gradient of {name}")
