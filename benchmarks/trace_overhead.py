"""What step tracing costs, and a picture of a measured run next to its plan.

Overhead: 4 torch LocalCluster ranks, 1F1B, one ``Linear(16, 16)`` per stage (so the runtime's
own work dominates), m=32. Runs with tracing off and on alternate in one invocation; the table
gives the median step time of each, their ratio, and the difference per executed step of the
ranks' executed steps (a lowered step: compute or communication; LocalCluster ranks take turns, so a
step's cost adds to the step time whichever rank runs it).

Picture (``--png``): a traced 1F1B run of 4 gloo processes (torchrun), m=8, whose stages cost a
fixed sleep (forward 10 ms, backward 20 ms: sleeping processes do not compete for the 2 cores, so
the run shows the schedule, not the machine; LocalCluster ranks take turns, so they cannot show it); the per-stage costs are fitted from the trace itself
(`costs_from_records`), the same schedule is simulated with them, and the plan and the measured
run are drawn one above the other.

    .venv/bin/python benchmarks/trace_overhead.py [--rounds 15] [--png docs/images/plan_vs_measured_1f1b.png]

Writes benchmarks/results/trace_overhead.md. Times on a shared 2-core machine are noisy: the
ratio of alternating runs is what to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyper_parallel import PipelineStage, Schedule1F1B  # noqa: E402
from hyper_parallel.platform import get_platform  # noqa: E402
from hyper_parallel.platform.local import LocalCluster  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "trace_overhead.md")
P = 4


def _stage_module(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(get_platform().rank)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _overhead_job(rounds: int, m: int) -> dict:
    p = get_platform()
    torch.set_num_threads(1)
    stage = PipelineStage(_stage_module(16, 1), p.rank, P)
    schedule = Schedule1F1B(stage, m, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    x, y = torch.randn(m * 2, 16), torch.randn(m * 2, 16)
    times: dict[bool, list[float]] = {False: [], True: []}
    steps = 0
    for r in range(rounds * 2 + 2):
        traced = r % 2 == 1
        schedule.tracer.enabled = traced
        p.barrier()
        start = time.perf_counter()
        schedule.run(x, target=y)
        p.barrier()
        if r >= 2:  # the first pair builds and warms up
            times[traced].append(time.perf_counter() - start)
        if traced:
            steps = len(schedule.gather_trace())
    return {"off": times[False], "on": times[True], "records": steps}


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed time."""

    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):  # noqa: ANN001
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        time.sleep(ctx.bwd_s)
        return grad, None, None


class _SleepStage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):  # noqa: ANN001
        return _Sleep.apply(x * self.scale, 0.010, 0.020)


def _picture_worker(m: int, out: str) -> None:
    """One torchrun rank of the picture's run; rank 0 writes all ranks' records to ``out``."""
    import json

    p = get_platform()
    stage = PipelineStage(_SleepStage(), p.rank, P)
    schedule = Schedule1F1B(stage, m, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    x, y = torch.randn(m * 2, 8), torch.randn(m * 2, 8)
    schedule.run(x, target=y)  # warm up
    schedule.tracer.enabled = True
    schedule.run(x, target=y)
    records = schedule.gather_trace()
    if p.rank == 0:
        with open(out, "w") as f:
            json.dump(records, f)
    p.barrier()
    torch.distributed.destroy_process_group()


def _picture(path: str, m: int) -> str:
    from hyper_parallel.core.pipeline_parallel.schedules.one_f_one_b import generate_1f1b
    from hyper_parallel.core.pipeline_parallel.simulation.simulate import simulate
    from hyper_parallel.core.pipeline_parallel.tools.trace import compare, convert, costs_from_records
    from hyper_parallel.core.pipeline_parallel.tools.visualize import plot_timelines

    import json
    import socket
    import subprocess
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.json")
        env = dict(os.environ, HYPER_PARALLEL_PLATFORM="torch", OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={P}",
                        "--master-addr=127.0.0.1", f"--master-port={port}", os.path.abspath(__file__),
                        "--picture-worker", out, "-m", str(m)], check=True, timeout=300, env=env)
        with open(out) as f:
            records = json.load(f)
    costs = costs_from_records(records, P, "s")
    plan = simulate(generate_1f1b(P, m), {r: r for r in range(P)}, costs).records
    measured = convert(records, "s", "ms")
    plot_timelines(path, [("plan (costs fitted from the run)", plan, "ms"), ("measured, 4 gloo processes", measured, "ms")], "1F1B, p=4, m=8")
    report = compare(records, plan, "s", "ms")
    return f"makespan measured / planned: {report['makespan_ratio']:.3f}" if "makespan_ratio" in report else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("-m", type=int, default=32)
    parser.add_argument("--png", default="")
    parser.add_argument("--picture-worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.picture_worker:
        _picture_worker(args.m, args.picture_worker)
        return
    per_rank = LocalCluster(P).run(_overhead_job, args.rounds, args.m)
    off = statistics.median(max(r["off"][i] for r in per_rank) for i in range(args.rounds))
    on = statistics.median(max(r["on"][i] for r in per_rank) for i in range(args.rounds))
    records = per_rank[0]["records"]
    lines = [
        "# Tracing overhead",
        "",
        f"Written by `benchmarks/trace_overhead.py`: 4 torch LocalCluster ranks, 1F1B, Linear(16, 16) per stage, "
        f"m={args.m}, {args.rounds} alternating runs with tracing off and on, medians of the slowest rank.",
        "",
        "| tracing | step (ms) | vs off | executed steps, all ranks | cost per step (us) |",
        "|---|---:|---:|---:|---:|",
        f"| off | {off * 1e3:.2f} | 1.000 | {records} | |",
        f"| on | {on * 1e3:.2f} | {on / off:.3f} | {records} | {(on - off) / records * 1e6:.2f} |",
        "",
        "The per-step cost is the difference of the medians divided by all ranks' executed steps (LocalCluster "
        "ranks take turns); on a shared machine it is noise-bound and can come out negative.",
    ]
    if args.png:
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        note = _picture(args.png, 8)
        lines += ["", f"Picture: `{os.path.relpath(args.png, os.path.dirname(HERE))}`. {note}".rstrip()]
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
