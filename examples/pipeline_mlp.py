"""A small MLP trained with pipeline parallelism (PyTorch), one stage per rank.

Run it for real with torch's launcher, or all ranks in one process with the dry run::

    torchrun --nproc-per-node 2 examples/pipeline_mlp.py --micro-batches 4
    hyper-parallel dryrun examples/pipeline_mlp.py --ranks 2 -- --micro-batches 4

The same file is a profile script: ``build_stages`` follows the convention of
``hyper-parallel profile`` (stage modules plus one sample micro-batch)::

    hyper-parallel profile examples/pipeline_mlp.py --stages 4 -o costs.json
"""

from __future__ import annotations

import argparse

import torch

import hyper_parallel as hp

WIDTH = 64


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def build_stages(num_stages: int = 4, layers_per_stage: int = 2, micro_batch_size: int = 8) -> dict:
    """Stage modules of the MLP and one micro-batch (the profile convention)."""
    torch.manual_seed(0)
    stages = []
    for _ in range(num_stages):
        layers: list[torch.nn.Module] = []
        for _ in range(layers_per_stage):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
        stages.append(torch.nn.Sequential(*layers))
    sample = torch.randn(micro_batch_size, WIDTH)
    return {"stages": stages, "inputs": sample, "loss_fn": loss_fn, "target": torch.randn(micro_batch_size, WIDTH)}


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    platform = hp.get_platform()
    rank, world = platform.rank, platform.world_size
    modules = build_stages(world)["stages"]
    stage = hp.PipelineStage(modules[rank], rank, world)
    schedule = hp.Schedule1F1B(stage, args.micro_batches, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(modules[rank].parameters(), lr=0.05)
    torch.manual_seed(1)
    x = torch.randn(2 * args.micro_batches, WIDTH)
    y = torch.randn(2 * args.micro_batches, WIDTH)
    losses: list[float] = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        step_losses = schedule.run(x, target=y)
        optimizer.step()
        if step_losses:
            losses.append(float(sum(float(v) for v in step_losses) / len(step_losses)))
    if losses:
        print(f"rank {rank}: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    RESULT = main()
