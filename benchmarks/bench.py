"""``make bench``: ours against ``torch.distributed.pipelining``, side by side, in one invocation.

Sections (``--only`` picks some): ``efficiency`` (sleep-cost stages, every schedule), ``overhead``
(runtime cost per lowered step), ``p2p`` (exposed transfer time of 4 MiB activations),
``memory`` (counted peak live activations per rank), ``gpt`` (the demo model, tokens/s),
``ms`` (MindSpore PyNative vs ms.jit stages on LocalCluster, turn-taking cost), ``profile``
(where one step's time goes), ``planning`` (what one rank pays to build a schedule at p <= 64, v <= 4,
m <= 1024: ``planning_scale.py``). The gloo sections of one process count share one job.
Writes ``results.md`` and ``results.json`` into ``--out`` (default: this folder).

    .venv/bin/python benchmarks/bench.py [--smoke] [--only efficiency,gpt] [--out DIR]

``--smoke`` runs every section reduced to seconds (tiny sleeps, few rounds): it checks that the
suite runs and writes every table; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import bench_report  # noqa: E402
from bench_common import run_job  # noqa: E402

SECTIONS = ("efficiency", "overhead", "p2p", "memory", "gpt", "ms", "profile", "planning")
FULL = {
    "efficiency": dict(m=16, rounds=7, scale=1.0),
    "overhead": dict(m=64, rounds=9),
    "p2p": dict(m=16, rounds=4, big_width=1 << 20, scale=1.0),
    "memory": dict(m=8),
    "gpt": dict(m=8, rounds=21),
    "ms": dict(rounds=2, steps=1, small=False),
    "profile": dict(m=64, steps=3),
    "planning": dict(rounds=1, smoke=False),
}
SMOKE = {
    "efficiency": dict(m=8, rounds=1, scale=0.1),
    "overhead": dict(m=8, rounds=1),
    "p2p": dict(m=8, rounds=1, big_width=1 << 12, scale=0.1),
    "memory": dict(m=8),
    "gpt": dict(m=4, rounds=1),
    "ms": dict(rounds=1, steps=1, small=True),
    "profile": dict(m=8, steps=1),
    "planning": dict(rounds=1, smoke=True),
}


def suite_job(sections: list[str], params: dict[str, dict[str, Any]]) -> dict:
    """One rank of the gloo sections in ``sections``, one after another in one process group."""
    import bench_gpt
    import bench_memory
    import bench_profile
    import bench_schedules

    from bench_schedules import SCHEDULES

    out: dict[str, Any] = {}
    for section in sections:
        start = time.perf_counter()
        kw = params[section]
        if section == "efficiency":
            out[section] = bench_schedules.efficiency_job(kw["m"], kw["rounds"], list(SCHEDULES), kw["scale"])
        elif section == "overhead":
            out[section] = bench_schedules.overhead_job(kw["m"], kw["rounds"],
                                                        ["Schedule1F1B", "ScheduleInterleaved1F1B"])
        elif section == "p2p":
            out[section] = bench_schedules.p2p_job(kw["m"], kw["rounds"], kw["big_width"], kw["scale"])
        elif section == "memory":
            out[section] = bench_memory.memory_job(kw["m"])
        elif section == "gpt":
            out[section] = bench_gpt.gpt_job(kw["m"], kw["rounds"])
        elif section == "profile":
            out[section] = bench_profile.profile_job(kw["m"], kw["steps"])
        out.setdefault("seconds", {})[section] = time.perf_counter() - start
    return out


def run(sections: list[str], smoke: bool) -> dict[str, Any]:
    import bench_gpt
    import bench_memory
    import bench_ms
    import bench_profile
    import bench_schedules

    params = SMOKE if smoke else FULL
    results: dict[str, Any] = {"smoke": smoke, "params": {s: params[s] for s in sections}, "seconds": {}}
    gloo4 = [s for s in sections if s not in ("ms", "planning")]
    if gloo4:
        print(f"gloo, 4 processes: {', '.join(gloo4)}", flush=True)
        per_rank = run_job("bench", "suite_job", 4, dict(sections=gloo4, params=params), timeout=900)
        results["seconds"].update(per_rank[0]["seconds"])
        for section in gloo4:
            ranks = [r[section] for r in per_rank]
            kw = params[section]
            if section == "efficiency":
                results[section] = bench_schedules.summarize_efficiency(ranks, kw["m"], kw["scale"])
            elif section == "overhead":
                results[section] = bench_schedules.summarize_overhead(ranks, kw["m"])
            elif section == "p2p":
                results[section] = bench_schedules.summarize_p2p(ranks, kw["m"], kw["big_width"])
            elif section == "memory":
                results[section] = bench_memory.summarize(ranks, kw["m"])
            elif section == "gpt":
                results[section] = bench_gpt.summarize(ranks, 4, kw["m"])
            elif section == "profile":
                results[section] = bench_profile.summarize(ranks)
    if "gpt" in sections:
        print("gloo, 2 processes: gpt", flush=True)
        start = time.perf_counter()
        per_rank = run_job("bench", "suite_job", 2, dict(sections=["gpt"], params=params), timeout=600)
        results["gpt"] = bench_gpt.summarize([r["gpt"] for r in per_rank], 2, params["gpt"]["m"]) + results["gpt"]
        results["seconds"]["gpt (2 processes)"] = time.perf_counter() - start
    if "ms" in sections:
        print("MindSpore, LocalCluster", flush=True)
        start = time.perf_counter()
        kw = params["ms"]
        results["ms"] = bench_ms.summarize(bench_ms.measure(kw["rounds"], kw["steps"], kw["small"]))
        results["seconds"]["ms"] = time.perf_counter() - start
    if "planning" in sections:
        import planning_scale

        print("planning at scale, one process per build", flush=True)
        start = time.perf_counter()
        kw = params["planning"]
        rows, growth = ((planning_scale.SMOKE_ROWS, planning_scale.SMOKE_GROWTH) if kw["smoke"]
                        else (planning_scale.FULL_ROWS, planning_scale.FULL_GROWTH))
        results["planning"] = planning_scale.measure(rows, growth, kw["rounds"], 60 if kw["smoke"] else 600)
        results["seconds"]["planning"] = time.perf_counter() - start
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="every section reduced to seconds")
    parser.add_argument("--only", default="", help=f"comma-separated sections of: {', '.join(SECTIONS)}")
    parser.add_argument("--out", default=HERE, help="folder for results.md and results.json")
    args = parser.parse_args()
    sections = [s.strip() for s in args.only.split(",") if s.strip()] or list(SECTIONS)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    start = time.perf_counter()
    results = run(sections, args.smoke)
    results["total_seconds"] = time.perf_counter() - start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = bench_report.markdown(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
