"""Where a sleep-cost pipeline loses time between two compute steps, for ours and torch's.

Section 1 of ``make bench`` shows both libraries at about 0.9 of the ideal makespan. This splits
the loss:

1. **gloo's own calls** (2 processes, one 64-byte tensor, median of 100 trips): posting a send when the
   receive is already posted / not yet posted, posting a receive before / after the data arrived,
   and waiting on a receive whose data arrived milliseconds earlier.
2. **the gap between two compute steps** of the 1F1B sleep workload (4 processes, m = 16, F = 10
   ms, B = 20 ms, ``bench_schedules``; ours' and torch's steps alternate): each stage's sleeps are timed with the one clock of the
   machine; a compute step whose inputs were already there (its previous local step ended after
   the remote input's producer) shows what the runtime spends between two computes (send, post
   the next receive, wait, forward/backward set-up and tear-down); one waiting on a remote
   input shows that plus the hand-over to the other process.

    .venv/bin/python benchmarks/handover_cost.py [--steps 10] [--m 16] [--trips 100] [--out PATH]

Writes benchmarks/results/handover_cost.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

RESULTS = os.path.join(HERE, "results", "handover_cost.md")


def gloo_calls_job(trips: int = 100) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    rank, t = dist.get_rank(), torch.zeros(16)
    out: dict[str, list[float]] = {"send, receive posted": [], "send, receive not posted": [],
                                   "post receive before data": [], "post receive after data": [],
                                   "wait, data arrived": []}

    def timed(key: str, fn: Any) -> Any:
        start = time.perf_counter()
        result = fn()
        out[key].append(time.perf_counter() - start)
        return result

    for _ in range(trips):
        dist.barrier()
        if rank == 1:
            work = timed("post receive before data", lambda: dist.irecv(t, 0))
            time.sleep(0.005)
        else:
            time.sleep(0.003)
            work = timed("send, receive posted", lambda: dist.isend(t, 1))
        work.wait()
        dist.barrier()
        if rank == 0:
            timed("send, receive not posted", lambda: dist.isend(t, 1)).wait()
        else:
            time.sleep(0.003)
            work = timed("post receive after data", lambda: dist.irecv(t, 0))
            timed("wait, data arrived", work.wait)
    return {key: statistics.median(v) * 1e6 for key, v in out.items() if v}


def gaps_job(m: int = 16, steps: int = 5) -> dict[str, list[dict[str, list]]]:
    """Ours and torch's, their steps alternating (who goes first swaps every round)."""
    import torch.distributed as dist

    import bench_schedules

    from hyper_parallel.platform.torch import sleep_stage

    events: list[tuple[str, float, float]] = []
    real_sleep = time.sleep

    class _Clock:  # the sleep stage's ``time``, timing each sleep
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        def sleep(self, seconds: float) -> None:
            start = time.perf_counter()
            real_sleep(seconds)
            events.append(("F" if forward[0] else "b", start, time.perf_counter()))  # B sleeps twice

    forward = [False]
    original = sleep_stage._SleepCopy.forward

    def forward_marked(ctx: Any, x: Any, fwd_s: float, bwd_s: float) -> Any:
        forward[0] = bool(fwd_s)
        try:
            return original(ctx, x, fwd_s, bwd_s)
        finally:
            forward[0] = False

    sleep_stage.time = _Clock()
    sleep_stage._SleepCopy.forward = staticmethod(forward_marked)
    libs = ("ours", "torch")
    run = {lib: bench_schedules.build(lib, "Schedule1F1B", bench_schedules._sleep_module(1), m, 1, 16)[1]
           for lib in libs}
    for step in run.values():
        step()
    runs: dict[str, list[dict[str, list]]] = {lib: [] for lib in libs}
    for r in range(steps):
        for lib in (libs if r % 2 == 0 else libs[::-1]):
            dist.barrier()
            events.clear()
            run[lib]()
            fwd = [(a, b) for kind, a, b in events if kind == "F"]
            bwd_sleeps = [(a, b) for kind, a, b in events if kind == "b"]
            bwd = [(bwd_sleeps[2 * k][0], bwd_sleeps[2 * k + 1][1]) for k in range(len(bwd_sleeps) // 2)]
            runs[lib].append({"F": fwd, "B": bwd})
    return runs


def split_gaps(per_rank: list[list[dict[str, list]]]) -> dict[str, list[float]]:
    """Gaps (ms) before each compute step: 'local' when the previous local step ended last,
    'remote' when the remote input's producer did."""
    p = len(per_rank)
    local: list[float] = []
    remote: list[float] = []
    makespans: list[float] = []
    for run in range(len(per_rank[0])):
        fwd = [per_rank[s][run]["F"] for s in range(p)]
        bwd = [per_rank[s][run]["B"] for s in range(p)]
        makespans.append((bwd[0][-1][1] - fwd[0][0][0]) * 1e3)
        for s in range(p):
            steps = sorted([("F", i, a, b) for i, (a, b) in enumerate(fwd[s])]
                           + [("B", i, a, b) for i, (a, b) in enumerate(bwd[s])], key=lambda e: e[2])
            previous = None
            for kind, i, start, end in steps:
                producer = (fwd[s - 1][i][1] if kind == "F" and s > 0 else
                            bwd[s + 1][i][1] if kind == "B" and s < p - 1 else None)
                if producer is not None and (previous is None or producer >= previous):
                    remote.append((start - producer) * 1e3)
                elif previous is not None:
                    local.append((start - previous) * 1e3)
                previous = end
    return {"local": local, "remote": remote, "makespan": makespans}


def main() -> None:
    from bench_common import run_job, write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--trips", type=int, default=100)
    parser.add_argument("--out", default=RESULTS, help="where the table goes (default: %(default)s)")
    args = parser.parse_args()
    calls = run_job("handover_cost", "gloo_calls_job", 2, {"trips": args.trips})
    lines = ["# Hand-over cost: gloo's calls and the gap between two compute steps", "",
             f"## gloo calls (2 processes, 64-byte tensor, median of {args.trips}, microseconds)", "",
             "| call | rank | us |", "|---|---|---|"]
    for rank, result in enumerate(calls):
        for key, value in result.items():
            lines.append(f"| {key} | {rank} | {value:.1f} |")
    lines += ["", f"## Gaps between compute steps (1F1B sleep workload, 4 processes, m={args.m}, {args.steps} steps, ms)", "",
              "| library | makespan (median) | gaps, input already there: n | median | mean "
              "| gaps after a remote input: n | median | mean |", "|---|---|---|---|---|---|---|---|"]
    per_rank = run_job("handover_cost", "gaps_job", 4, {"steps": args.steps, "m": args.m})
    for lib in ("ours", "torch"):
        gaps = split_gaps([r[lib] for r in per_rank])
        loc, rem = gaps["local"], gaps["remote"]
        lines.append(f"| {lib} | {statistics.median(gaps['makespan']):.1f} | {len(loc)} | {statistics.median(loc):.3f} "
                     f"| {statistics.mean(loc):.3f} | {len(rem)} | {statistics.median(rem):.3f} | {statistics.mean(rem):.3f} |")
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
