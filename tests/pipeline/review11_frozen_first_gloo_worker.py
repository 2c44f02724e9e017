"""One rank of test_review11_regressions.py's gloo job: a 2-stage pipeline whose first stage is
frozen (no parameter, no input needs a gradient), so its output is not differentiable and the
output-gradient receive of stage 0 carries no tensor at all. Rank 1 computes the non-pipelined
oracle before it joins the pipeline (rank 0 starts at once); each rank pickles what it got.

Usage (under torchrun, HYPER_PARALLEL_PLATFORM=torch): review11_frozen_first_gloo_worker.py OUT_DIR SCHEDULE TRANSPORT
"""

from __future__ import annotations

import sys

import torch
from gloo_exit import run_and_leave, write_rank_result
from torch import nn

from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B, ScheduleGPipe
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage
from hyper_parallel.platform import get_platform

WIDTH, ROWS, MICRO, RUNS = 256, 32, 8, 3
SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def modules() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)
    for prm in first.parameters():
        prm.requires_grad_(False)  # a frozen first stage (e.g. a frozen embedding when fine-tuning)
    return first, second


def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(ROWS * MICRO, WIDTH), torch.randn(ROWS * MICRO, 1)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def oracle() -> dict[str, object]:
    first, second = modules()
    x, y = data()
    losses = []
    for i in range(MICRO):
        rows = slice(i * ROWS, (i + 1) * ROWS)
        loss = mse(second(first(x[rows])), y[rows])
        (loss / MICRO).backward()
        losses.append(loss.item())
    return {"losses": losses, "grads": {n: p.grad.clone() for n, p in second.named_parameters()}}


def main(out_dir: str, schedule: str, transport: str) -> None:
    torch.set_num_threads(1)
    p = get_platform()
    ref = oracle() if p.rank == 1 else None  # rank 0 runs ahead of its peer
    first, second = modules()
    x, y = data()
    stage = PipelineStage(first if p.rank == 0 else second, p.rank, 2)
    sched = SCHEDULES[schedule](stage, MICRO, loss_fn=mse, p2p_transport=transport)
    runs = []
    for _ in range(RUNS):
        sched.zero_grad()
        if p.rank == 0:
            sched.run(x)
            runs.append(None)
        else:
            losses = sched.run(target=y)
            runs.append({"losses": [float(v) for v in losses],
                         "grads": {n: prm.grad.clone() for n, prm in second.named_parameters()}})
    write_rank_result(out_dir, p.rank, {"runs": runs, "ref": ref})


if __name__ == "__main__":
    run_and_leave(main, *sys.argv[1:])
