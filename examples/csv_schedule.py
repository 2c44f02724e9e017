"""A custom schedule loaded from a CSV file (one row per rank, one step per cell), trained (PyTorch).

``examples/schedules/two_ranks_eager.csv`` is 1F1B on 2 ranks with one more warm-up forward on rank 0
(it holds 3 micro-batches' activations instead of 2; with these costs the makespan is the same). Edit it,
or write one with ``save_schedule_csv`` / ``hyper-parallel tune --save-order``; the schedule is
validated (dependencies, send/receive pairs, deadlock freedom) when it is built. Its ranks run on a
LocalCluster in this process, or under torchrun::

    python examples/csv_schedule.py
    torchrun --nproc-per-node 2 examples/csv_schedule.py --launcher torchrun

It prints the schedule as a chart and the last stage's loss of each step.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch

import hyper_parallel as hp
from hyper_parallel.core.pipeline_parallel import load_schedule_csv
from hyper_parallel.core.pipeline_parallel.ir import MetaStep

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CSV = os.path.join(HERE, "schedules", "two_ranks_eager.csv")
WIDTH = 16


def schedule_class_from_csv(path: str, chunks: int = 1) -> type[hp.PipelineSchedule]:
    """A schedule class whose step lists are the file's (``chunks`` stages per rank, looped placement)."""
    steps: dict[int, list[MetaStep | None]] = load_schedule_csv(path)

    class ScheduleFromCsv(hp.PipelineSchedule):
        placement = "looped" if chunks > 1 else "single"
        min_chunks = max_chunks = chunks

        @classmethod
        def _generate(cls, num_ranks: int, num_chunks: int, num_microbatches: int) -> dict:
            micro = {s.micro_index for row in steps.values() for s in row if s is not None}
            if len(steps) != num_ranks or micro != set(range(num_microbatches)):
                raise ValueError(f"{path} has {len(steps)} rank(s) and micro-batches {sorted(micro)}; "
                                 f"this job has {num_ranks} rank(s) and {num_microbatches} micro-batches")
            return {rank: list(row) for rank, row in steps.items()}

    ScheduleFromCsv.__name__ = f"ScheduleFromCsv[{os.path.basename(path)}]"
    return ScheduleFromCsv


def chart(path: str) -> str:
    """The file's schedule simulated with a forward of 1 and a backward of 2 time units, as a chart."""
    from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate
    from hyper_parallel.core.pipeline_parallel.tools.visualize import ascii_chart

    steps = load_schedule_csv(path)
    placement = {rank: rank for rank in steps}  # one stage per rank
    return f"{path}:\n{ascii_chart(simulate(steps, placement, CostModel.per_rank_share(len(steps), 1)))}"


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def build_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen)


def train(csv_path: str, steps: int, micro_batches: int) -> dict:
    """One rank: stage 0 = Linear + Tanh, stage 1 = Linear; returns the losses and this rank's gradients
    after the first step (for comparing with a non-pipelined step)."""
    platform = hp.get_platform()
    model = build_model()
    module = model[:2] if platform.rank == 0 else model[2:]
    schedule = schedule_class_from_csv(csv_path)(hp.PipelineStage(module, platform.rank, 2), micro_batches,
                                                 loss_fn=loss_fn)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    x, y = data()
    losses, first_grads = [], {}
    for step in range(steps):
        optimizer.zero_grad()
        out = schedule.run(x, target=y)
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        optimizer.step()
        if out:
            losses.append(sum(float(v) for v in out) / len(out))
            print(f"step {step}: loss {losses[-1]:.5f}", flush=True)
    return {"losses": losses, "first_grads": first_grads}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", default=DEFAULT_CSV)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--launcher", choices=("local", "torchrun"), default="local")
    args = parser.parse_args(argv)
    print(chart(args.csv))
    if args.launcher == "torchrun":
        return [train(args.csv, args.steps, args.micro_batches)]
    from hyper_parallel.platform.local import LocalCluster

    return LocalCluster(2).run(train, args.csv, args.steps, args.micro_batches)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        gc.collect()  # free gloo work objects left in reference cycles while the group lives
        torch.distributed.destroy_process_group()
