"""The ``hyper-parallel`` command: ``demo`` (the main job) and ``chart`` (see a schedule)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _chart_text(schedule: str, ranks: int, micro_batches: int) -> str:
    from hyper_parallel.core.pipeline_parallel.simulate import simulate
    from hyper_parallel.core.pipeline_parallel.visualize import ascii_chart
    from hyper_parallel.demo import SCHEDULES

    schedule_class, chunks = SCHEDULES[schedule]
    compute = schedule_class.generate(ranks, chunks, micro_batches)
    result = simulate(compute, schedule_class.stage_placement(ranks, chunks))
    header = (f"{schedule_class.__name__}: {ranks} ranks x {chunks} stage(s) per rank, {micro_batches} micro-batches "
              f"(F=1, B=2 time units)")
    return f"{header}\n{ascii_chart(result)}"


def _demo(args: argparse.Namespace) -> int:
    import numpy as np

    from hyper_parallel.demo import DemoOptions, train_worker

    opts = DemoOptions(schedule=args.schedule, ranks=args.ranks, steps=args.steps,
                       micro_batches=args.micro_batches, batch_size=args.batch_size)
    where = "torch gloo processes" if args.backend == "torch" else "MindSpore LocalCluster ranks"
    print(f"hyper-parallel demo: a small GPT (tied embeddings) on the shipped text, {opts.ranks} pipeline ranks "
          f"as {where}\n")
    print(_chart_text(opts.schedule, opts.ranks, opts.micro_batches) + "\n", flush=True)
    results: list[Any]
    if args.backend == "torch":
        from hyper_parallel.platform.torch.launch import launch_local

        results = launch_local(train_worker, opts.ranks, opts)
    else:
        from hyper_parallel.platform.local import LocalCluster

        results = LocalCluster(opts.ranks, platform="mindspore").run(train_worker, opts)
    losses = next(r["losses"] for r in results if r["losses"])
    diff = results[0]["max_grad_diff"]
    print(f"\nloss: {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
    print("peak in-flight activations per rank:", [r["peak_activations"] for r in results])
    tolerance = 1e-5 if args.backend == "torch" else 1e-4
    verdict = "OK" if np.isfinite(diff) and diff <= tolerance else "MISMATCH"
    print(f"max |gradient difference| vs the same step without a pipeline: {diff:.3e} ({verdict}, "
          f"tolerance {tolerance:g})")
    return 0 if verdict == "OK" else 1


def main(argv: list[str] | None = None) -> int:
    from hyper_parallel.demo import SCHEDULES

    parser = argparse.ArgumentParser(prog="hyper-parallel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT with pipeline parallelism and check its gradients")
    demo.add_argument("--backend", choices=("torch", "mindspore"), default="torch")
    demo.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--micro-batches", type=int, default=8)
    demo.add_argument("--batch-size", type=int, default=16)
    chart = sub.add_parser("chart", help="print a schedule as an ASCII chart with its bubble fraction")
    chart.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    chart.add_argument("--ranks", type=int, default=4)
    chart.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    print(_chart_text(args.schedule, args.ranks, args.micro_batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
