"""Stages and a loss for the issue 21 tests (hooks at the dx/dW boundary, a loss function with
parameters of its own, saved tensors changed in place), the body of one rank and the non-pipelined
oracle; used on torch LocalCluster (test_pp_issue21_split_hooks.py) and real gloo
(issue21_gloo_worker.py).

Every stage is ``out(act(lin(h)))`` and sends one tensor; the last one's output goes through
``ScaledMSE``, whose ``scale`` and ``shift`` are trainable and belong to no stage.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from hyper_parallel import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleMPipeTranspose,
    ScheduleZBVZeroBubble,
)
from hyper_parallel.platform import get_platform

WIDTH, PER_MICRO = 5, 2
RTOL, ATOL_OF_SCALE = 1e-5, 1e-6
SCHEDULES = {  # name -> (class, stages per rank, extra constructor arguments)
    "gpipe": (ScheduleGPipe, 1, {}),
    "1f1b": (Schedule1F1B, 1, {}),
    "interleaved": (ScheduleInterleaved1F1B, 2, {}),
    "looped_bfs": (ScheduleLoopedBFS, 2, {}),
    "zb-h1": (ScheduleInterleavedZeroBubble, 1, {}),
    "zb-h1-v2": (ScheduleInterleavedZeroBubble, 2, {}),
    "zbv": (ScheduleZBVZeroBubble, 2, {}),
    "dualpipev": (ScheduleDualPipeV, 2, {}),
    "mpipe-dataload-only": (ScheduleMPipeTranspose, 1, dict(preprocess_module=None, num_transpose_layers=0)),
}
ZERO_BUBBLE = ["zb-h1", "zb-h1-v2", "zbv", "dualpipev"]
HOOKS = ("boundary", "output", "prehook", "retain")  # the variants of the issue; "all" = every one


class Block(nn.Module):
    """``out(tanh(lin(h)))`` with the hooks named in ``hooks`` put on its graph at every forward.

    boundary: a scaling tensor hook on ``lin``'s output (a weight-consuming node); output: one on
    the stage output; prehook: a scaling prehook on the output's node; retain: ``retain_grad`` and
    an observing hook on ``lin``'s output. ``inplace_at``: the forwards (0, 1, ... in order) that
    use ``relu_`` and then change its saved result with ``add_``; ``valid_inplace``: every forward
    changes ``lin``'s output (which nothing saved) in place and applies ``relu_`` to it (whose
    result is saved at the version relu_ made, then only read): torch accepts both.
    """

    def __init__(self, index: int, hooks: tuple[str, ...] = (), inplace_at: tuple[int, ...] = (),
                 valid_inplace: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(100 + index)
        self.lin, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.hooks, self.inplace_at, self.valid_inplace = hooks, inplace_at, valid_inplace
        self.calls: Counter = Counter()
        self.forwards = 0
        self.retained: list[Any] = []

    def _hook(self, name: str, scale: float | None) -> Any:
        def hook(g: Any) -> Any:
            self.calls[name] += 1
            return None if scale is None else g * scale

        return hook

    def forward(self, h: Any) -> Any:
        pre = self.lin(h)
        if "boundary" in self.hooks:
            pre.register_hook(self._hook("boundary", 2.0))
        if "retain" in self.hooks:
            pre.retain_grad()
            pre.register_hook(self._hook("retain", None))
            self.retained.append(pre)
        if self.forwards in self.inplace_at:
            act = pre.relu_()
            act.add_(1.0)
        elif self.valid_inplace:
            pre.add_(0.1)
            act = torch.relu_(pre)
        else:
            act = torch.tanh(pre)
        self.forwards += 1
        y = self.out(act)
        if "prehook" in self.hooks:
            def prehook(grads: tuple[Any, ...]) -> tuple[Any, ...]:
                self.calls["prehook"] += 1
                return tuple(None if g is None else g * 0.5 for g in grads)

            y.grad_fn.register_prehook(prehook)
        if "output" in self.hooks:
            y.register_hook(self._hook("output", -1.5))
        return y


class ScaledMSE(nn.Module):
    """An MSE loss with trainable parameters of its own (outside every stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.3))
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.3, WIDTH))

    def forward(self, out: Any, target: Any) -> Any:
        return ((out * self.scale + self.shift - target) ** 2).mean()


@dataclass(frozen=True)
class Job:
    schedule: str
    micro: int
    hooks: tuple[str, ...] = ()
    inplace: tuple[tuple[int, int], ...] = ()  # (stage, forward index) pairs using relu_ + add_
    valid_inplace: bool = False

    def num_stages(self, ranks: int) -> int:
        return ranks * SCHEDULES[self.schedule][1]

    def block(self, s: int) -> Block:
        return Block(s, self.hooks, tuple(i for st, i in self.inplace if st == s), self.valid_inplace)


def data(micro: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(3)
    size = micro * PER_MICRO
    return (torch.from_numpy(rng.standard_normal((size, WIDTH)).astype(np.float32)),
            torch.from_numpy(rng.standard_normal((size, WIDTH)).astype(np.float32)))


def run_rank(job: Job) -> dict[str, Any]:
    p = get_platform()
    cls, chunks, extra = SCHEDULES[job.schedule]
    placement = cls.stage_placement(p.world_size, chunks)
    num = len(placement)
    mine = sorted(s for s, r in placement.items() if r == p.rank)
    blocks = {s: job.block(s) for s in mine}
    stages = [PipelineStage(blocks[s], s, num) for s in mine]
    loss_fn = ScaledMSE()
    schedule = cls(stages if len(stages) > 1 else stages[0], job.micro, loss_fn=loss_fn, **extra)
    x, y = data(job.micro)
    losses = schedule.run(x, target=y if (num - 1) in blocks else None)
    grads = {f"{s}.{n}": prm.grad.numpy().copy() for s, b in blocks.items() for n, prm in b.named_parameters()}
    if (num - 1) in blocks:
        grads.update({f"loss.{n}": None if prm.grad is None else prm.grad.numpy().copy()
                      for n, prm in loss_fn.named_parameters()})
    return {"losses": [float(v) for v in losses], "grads": grads,
            "calls": {s: dict(b.calls) for s, b in blocks.items()},
            "retained": {s: [t.grad.numpy().copy() for t in b.retained] for s, b in blocks.items()}}


def oracle(job: Job, num: int) -> dict[str, Any]:
    """The same blocks and loss chained in one process, mean loss over the micro-batches."""
    blocks = [job.block(s) for s in range(num)]
    loss_fn = ScaledMSE()
    x, y = data(job.micro)
    total, losses = 0.0, []
    for i in range(job.micro):
        h = x[i * PER_MICRO:(i + 1) * PER_MICRO]
        for b in blocks:
            h = b(h)
        loss = loss_fn(h, y[i * PER_MICRO:(i + 1) * PER_MICRO])
        losses.append(float(loss.detach()))
        total = total + loss / job.micro
    total.backward()
    grads = {f"{s}.{n}": prm.grad.numpy().copy() for s, b in enumerate(blocks) for n, prm in b.named_parameters()}
    grads.update({f"loss.{n}": prm.grad.numpy().copy() for n, prm in loss_fn.named_parameters()})
    return {"losses": losses, "grads": grads, "calls": {s: dict(b.calls) for s, b in enumerate(blocks)},
            "retained": {s: [t.grad.numpy().copy() for t in b.retained] for s, b in enumerate(blocks)}}


def check(job: Job, results: list[dict[str, Any]], ranks: int) -> None:
    """The ranks' losses, gradients (stage and loss parameters), hook calls and retained gradients
    against the non-pipelined model."""
    ref = oracle(job, job.num_stages(ranks))
    losses = next(r["losses"] for r in results if r["losses"])
    np.testing.assert_allclose(losses, ref["losses"], rtol=RTOL, atol=1e-7, err_msg="per-micro-batch losses")
    grads: dict[str, Any] = {}
    calls: dict[int, Any] = {}
    retained: dict[int, Any] = {}
    for r in results:
        grads.update(r["grads"])
        calls.update(r["calls"])
        retained.update(r["retained"])
    assert set(grads) == set(ref["grads"]), set(grads) ^ set(ref["grads"])
    for name, want in ref["grads"].items():
        assert grads[name] is not None, f"{name} got no gradient"
        scale = float(np.abs(want).max()) or 1.0
        np.testing.assert_allclose(grads[name], want, rtol=RTOL, atol=ATOL_OF_SCALE * scale,
                                   err_msg=f"gradient of {name}")
    assert calls == ref["calls"], f"hook calls per stage {calls}, non-pipelined {ref['calls']}"
    for s, per_micro in ref["retained"].items():
        for i, want in enumerate(per_micro):
            np.testing.assert_allclose(retained[s][i], want, rtol=RTOL, atol=1e-7, err_msg=f"retained grad {s}/{i}")
