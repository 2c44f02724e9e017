"""How exact the simulator is: predicted against measured makespans of sleep-cost pipelines.

    python benchmarks/fidelity.py --schedules all|NAME[,NAME...] --m M --fwd-ms F --bwd-ms B
                                  [--p 4] [--rounds K] --json OUT

1. ``hyper-parallel calibrate`` once on ``p`` processes (its own workload: ``calibration.py``).
2. For each schedule (its default chunks; names as ``simulate --schedule``): ``p`` gloo processes
   train sleep-cost stages (a rank's share sleeps F ms forward, B ms backward, I = W = B / 2, split
   over its chunks; ``hyper_parallel.sleep_pipeline``); the makespan of a step is the last rank's
   end minus the first rank's start after a barrier; the median of K steps after a warm-up step is
   compared with the simulator's prediction from F, B and the machine file alone. The cases run
   in turns (one step of each per round), so that a busy phase of the shared machine hits them alike.
3. ``tune`` over every schedule, chunk count 1-4 and micro-batch count dividing M, on the same
   costs as a costs file would state them (global batch M, measured at micro-batch size 1, so a
   candidate with m micro-batches sleeps M / m times longer per micro-batch; 1 MiB of activations
   per sample and per quarter of a rank's share; memory limit ``6 p`` MiB per rank, 1.5 times what
   1F1B holds at m = M), with the machine file; the pick and the five next-best fitting candidates
   are measured the same way.

OUT: ``{"cases": [{schedule, v, m, predicted_ms, measured_ms, error}], "tune": {picked,
picked_measured_ms, best_measured_ms, candidates}, "machine": ..., "settings": ..., "load": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

MIB = 1 << 20
LAYERS_PER_RANK = 4


def cases_job(cases: list[dict[str, Any]], rounds: int) -> list[list[list[float]]]:
    """On every rank: each case's timed steps as ``[start, end]`` pairs (perf_counter seconds)."""
    from hyper_parallel import sleep_pipeline

    steps = [sleep_pipeline.build(c["schedule"], c["v"], c["m"], c["fwd_ms"], c["bwd_ms"])[1] for c in cases]
    timed = sleep_pipeline.alternating_steps(steps, rounds, warmup=1)
    return [[[a, b] for a, b, _ in case] for case in timed]


def measure(cases: list[dict[str, Any]], p: int, rounds: int) -> list[float]:
    """The median makespan (ms) of each case."""
    from bench_common import run_job

    from hyper_parallel.sleep_pipeline import makespans_ms

    per_rank = run_job("fidelity", "cases_job", p, {"cases": cases, "rounds": rounds}, timeout=3600.0)
    return [statistics.median(makespans_ms([r[k] for r in per_rank])) for k in range(len(cases))]


def tune_costs(p: int, m: int, fwd_ms: float, bwd_ms: float, machine: Any) -> Any:
    """The workload as a costs file would state it: ``p * 4`` equal layers at micro-batch size 1."""
    from hyper_parallel.core.pipeline_parallel.costs import CostModel, StageCost

    n = LAYERS_PER_RANK
    layer = StageCost(F=fwd_ms / n, B=bwd_ms / n, activation_bytes=MIB)
    costs = CostModel(stages=(layer,), layers=(layer,) * (p * n), micro_batch_size=1)
    return machine.apply(costs)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hyper_parallel.calibration import calibrate
    from hyper_parallel.core.pipeline_parallel.calibrate import predict_ms, sleep_costs
    from hyper_parallel.core.pipeline_parallel.catalog import available_schedules, default_chunks, resolve_schedule
    from hyper_parallel.core.pipeline_parallel.machine import Machine
    from hyper_parallel.core.pipeline_parallel.tune import tune

    names = list(available_schedules()) if args.schedules == "all" else [n.strip() for n in args.schedules.split(",")]
    classes = dict(resolve_schedule(n) for n in names if n)
    load = [os.getloadavg()[0]]
    machine_json = calibrate(args.p)
    machine = Machine.from_json(machine_json)
    cases = [{"schedule": n, "v": default_chunks(c), "m": args.m, "fwd_ms": args.fwd_ms, "bwd_ms": args.bwd_ms}
             for n, c in classes.items()]
    measured = measure(cases, args.p, args.rounds)
    load.append(os.getloadavg()[0])
    rows = []
    for case, value in zip(cases, measured):
        cls = classes[case["schedule"]]
        predicted = predict_ms(cls, args.p, case["v"], args.m,
                               sleep_costs(args.p, case["v"], args.fwd_ms, args.bwd_ms, machine))
        rows.append({"schedule": case["schedule"], "v": case["v"], "m": args.m, "predicted_ms": predicted,
                     "measured_ms": value, "error": (predicted - value) / value})
    limit = 6 * args.p * MIB
    result = tune(tune_costs(args.p, args.m, args.fwd_ms, args.bwd_ms, machine), limit, args.m, args.p,
                  lowered=True)
    fitting = [c for c in result.candidates if c.fits]
    chosen = fitting[:6]
    if result.best is not None and result.best not in chosen:
        chosen = [result.best, *chosen[:5]]
    tune_cases = [{"schedule": c.schedule, "v": c.num_chunks, "m": c.num_microbatches,
                   "fwd_ms": args.fwd_ms * c.micro_batch_size, "bwd_ms": args.bwd_ms * c.micro_batch_size}
                  for c in chosen]
    tune_measured = measure(tune_cases, args.p, args.rounds) if tune_cases else []
    load.append(os.getloadavg()[0])
    candidates = []
    for cand, value in zip(chosen, tune_measured):
        candidates.append({"schedule": cand.schedule, "v": cand.num_chunks, "m": cand.num_microbatches,
                           "micro_batch_size": cand.micro_batch_size, "predicted_ms": cand.makespan_ms,
                           "measured_ms": value, "picked": cand is result.best})
    picked = next((c for c in candidates if c["picked"]), None)
    best = min((c["measured_ms"] for c in candidates), default=None)
    return {
        "cases": rows,
        "tune": {"picked": picked, "picked_measured_ms": picked["measured_ms"] if picked else None,
                 "best_measured_ms": best, "memory_limit_bytes": limit, "global_batch": args.m,
                 "candidates": candidates},
        "machine": machine_json,
        "settings": {"p": args.p, "m": args.m, "fwd_ms": args.fwd_ms, "bwd_ms": args.bwd_ms, "rounds": args.rounds},
        "load": {"loadavg_1min": load, "cpus": os.cpu_count()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", required=True, help="all, or comma-separated names as simulate --schedule")
    parser.add_argument("--m", type=int, required=True, help="micro-batches of every case (>= 2 p)")
    parser.add_argument("--fwd-ms", type=float, required=True, help="forward sleep of a rank's share (ms)")
    parser.add_argument("--bwd-ms", type=float, required=True, help="backward sleep of a rank's share (ms)")
    parser.add_argument("--p", type=int, default=4, help="pipeline ranks (gloo processes)")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per case, after one warm-up step")
    parser.add_argument("--json", required=True, help="where the results go")
    args = parser.parse_args(argv)
    if args.p < 2 or args.m < 1 or args.rounds < 1 or args.fwd_ms <= 0 or args.bwd_ms <= 0:
        parser.error("need --p >= 2, --m >= 1, --rounds >= 1 and positive --fwd-ms / --bwd-ms")
    out = run(args)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"{'schedule':<18} {'v':>2} {'m':>3} {'predicted ms':>13} {'measured ms':>12} {'error':>7}")
    for row in out["cases"]:
        print(f"{row['schedule']:<18} {row['v']:>2} {row['m']:>3} {row['predicted_ms']:>13.1f} "
              f"{row['measured_ms']:>12.1f} {row['error']:>+7.1%}")
    t = out["tune"]
    for c in t["candidates"]:
        mark = "*" if c["picked"] else " "
        print(f"{mark} tune {c['schedule']:<16} v={c['v']} m={c['m']:<3} predicted {c['predicted_ms']:8.1f} "
              f"measured {c['measured_ms']:8.1f}")
    if t["picked_measured_ms"] is not None:
        print(f"pick measured {t['picked_measured_ms']:.1f} ms, best measured {t['best_measured_ms']:.1f} ms "
              f"({t['picked_measured_ms'] / t['best_measured_ms'] - 1:+.1%}); load {out['load']['loadavg_1min']}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
