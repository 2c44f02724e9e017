"""torch.distributed.pipelining's own usage pattern, run once with torch's classes and once with
ours (only the import changes), on the same model and batch; rank r writes what it got.

Usage: torchrun --nproc-per-node=4 torch_pipelining_parity_worker.py OUT_DIR
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch
import torch.distributed as dist
from gloo_exit import run_and_leave

N_MICROBATCHES = 8
# name -> (stages per rank, placement): looped puts stage c * world + rank on rank; "v" puts stages
# rank and 2 * world - 1 - rank on rank (torch's ZBV and DualPipeV require exactly that)
SCHEDULES = {"ScheduleGPipe": (1, "looped"), "Schedule1F1B": (1, "looped"), "ScheduleInterleaved1F1B": (2, "looped"),
             "ScheduleLoopedBFS": (2, "looped"), "ScheduleInterleavedZeroBubble": (2, "looped"),
             "ScheduleZBVZeroBubble": (2, "v"), "ScheduleDualPipeV": (2, "v")}


def stage_indices(rank: int, world: int, chunks: int, placement: str) -> list[int]:
    if placement == "v":
        return [rank, 2 * world - 1 - rank]
    return [c * world + rank for c in range(chunks)]


def stage_module(index: int) -> torch.nn.Module:
    torch.manual_seed(100 + index)  # the same weights for both libraries
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def train_step(library: str, schedule_name: str, rank: int, world: int) -> dict:
    """The pattern of torch.distributed.pipelining's documentation; ``library`` is the import."""
    lib = importlib.import_module(library)
    PipelineStage = lib.PipelineStage  # noqa: N806 - the import's own names
    ScheduleClass = getattr(lib, schedule_name)  # noqa: N806
    chunks, placement = SCHEDULES[schedule_name]
    num_stages = world * chunks
    device = torch.device("cpu")
    indices = stage_indices(rank, world, chunks, placement)
    modules = [stage_module(i) for i in indices]
    stages = [PipelineStage(m, i, num_stages, device) for i, m in zip(indices, modules)]
    schedule = ScheduleClass(stages if chunks > 1 else stages[0], n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)

    torch.manual_seed(0)
    x = torch.randn(16, 8)
    target = torch.randn(16, 8)
    losses: list = []
    output = None
    if 0 in indices and num_stages - 1 in indices:  # V placement: rank 0 holds the first and the last stage
        output = schedule.step(x, target=target, losses=losses)
    elif 0 in indices:
        schedule.step(x)
    elif num_stages - 1 in indices:
        output = schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    grads = {f"{i}.{n}": p.grad.tolist() for i, m in zip(indices, modules) for n, p in m.named_parameters()}
    return {"losses": [float(v) for v in losses], "output": None if output is None else output.tolist(),
            "grads": grads, "last": num_stages - 1 in indices}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in SCHEDULES:
        results[name] = {lib: train_step(lib, name, rank, world)
                         for lib in ("torch.distributed.pipelining", "hyper_parallel")}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_leave(main, sys.argv[1])
