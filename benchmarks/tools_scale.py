"""How long the planning tools take at cluster scale: `hyper-parallel simulate` and `tune`.

Each figure is the wall-clock time of one whole command in a fresh process (import, planning,
simulation, printing), the smallest of ``--rounds``, at p = 64, v = 4, m = 1024 by default:

- ``simulate`` of Interleaved 1F1B: plain (its default), ``--compute-only``, ``--transport batch``
  (the lists ``run()`` executes on NCCL/HCCL by default) and, with ``--slow``, ``--transport batch
  --no-overlap-p2p`` (the lists of ``overlap_p2p=False``, half a minute here);
- ``tune`` with the costs of docs/tools.md's tune example and a limit every candidate fits
  (``1000GB``), global batch m, micro-batch count m: the chunk count v alone (``--chunks V``) and
  every schedule with chunks 1-4, each with ``--jobs 1`` and with the CLI's default workers.

    .venv/bin/python benchmarks/tools_scale.py [--p 64] [--v 4] [--m 1024] [--rounds 1] [--slow] [--out PATH]

Writes benchmarks/results/tools_scale.md and prints it (exit status 1 when a command failed or
ran past ``--timeout``). Run it on a quiet machine: the tune rows with workers use every core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from bench_common import write_result  # noqa: E402

RESULTS = os.path.join(HERE, "results", "tools_scale.md")
LAYER = {"F": 1.0, "B": 2.0, "activation_bytes": 100e6, "output_bytes": 8e6, "param_bytes": 200e6,
         "overhead_ms": 0.25}
COSTS = {"format": "hyper-parallel-costs/1", "micro_batch_size": 2,
         "p2p": {"latency_ms": 0.05, "bandwidth_gb_per_s": 10}, "layers": [LAYER] * 8}


def commands(p: int, v: int, m: int, costs: str, slow: bool) -> list[tuple[str, list[str]]]:
    """(label, arguments of ``hyper-parallel``) of every row."""
    sim = ["simulate", "--schedule", "interleaved-1f1b", "-p", str(p), "-v", str(v), "-m", str(m), "--chart", "compact"]
    tune = ["tune", "--costs", costs, "--memory-limit", "1000GB", "--global-batch", str(m), "-p", str(p),
            "--micro-batches", str(m)]
    rows = [("simulate (plain)", sim), ("simulate --compute-only", [*sim, "--compute-only"]),
            ("simulate --transport batch", [*sim, "--transport", "batch"])]
    if slow:
        rows.append(("simulate --transport batch --no-overlap-p2p", [*sim, "--transport", "batch", "--no-overlap-p2p"]))
    rows += [(f"tune --chunks {v} --jobs 1", [*tune, "--chunks", str(v), "--jobs", "1"]),
             (f"tune --chunks {v} (default workers)", [*tune, "--chunks", str(v)]),
             ("tune, every schedule, --jobs 1", [*tune, "--jobs", "1"]),
             ("tune, every schedule (default workers)", tune)]
    return rows


def timed(arguments: list[str], timeout: float) -> float | str:
    """Seconds of one command in a fresh process, or why it gave none."""
    code = "import sys; from hyper_parallel.cli import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), COLUMNS="120")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", code, *arguments], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return f"over {timeout:.0f} s"
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:160]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=64)
    parser.add_argument("--v", type=int, default=4)
    parser.add_argument("--m", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=1, help="runs per command, the fastest kept")
    parser.add_argument("--slow", action="store_true", help="also simulate the lists of overlap_p2p=False on batch")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one command may take")
    parser.add_argument("--out", default=RESULTS, help="where the table goes (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        costs = os.path.join(folder, "costs.json")
        with open(costs, "w") as fh:
            json.dump(COSTS, fh)
        rows, failed = [], 0
        for label, arguments in commands(args.p, args.v, args.m, costs, args.slow):
            runs = [timed(arguments, args.timeout) for _ in range(max(1, args.rounds))]
            times = [r for r in runs if isinstance(r, float)]
            cell = f"{min(times):.2f}" if times else runs[0]
            failed += not times
            print(f"{label}: {cell}", flush=True)
            rows.append(f"| `{label}` | {cell} |")
    head = [f"# The planning tools at p = {args.p}, v = {args.v}, m = {args.m}", "",
            f"Written by `benchmarks/tools_scale.py`: wall-clock seconds of the whole command in a fresh process "
            f"(import, planning, simulation, output), best of {max(1, args.rounds)}, on {os.cpu_count()} CPU(s). "
            "`simulate`: Interleaved 1F1B; `tune`: the costs of docs/tools.md's tune example, every candidate "
            "fitting, one micro-batch count.", "", "| command | seconds |", "|---|---|"]
    write_result(args.out, head + rows)
    if failed:
        sys.exit(f"{failed} command(s) gave no time")


if __name__ == "__main__":
    main()
