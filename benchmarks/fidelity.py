"""How exact the simulator is: predicted against measured makespans of sleep-cost pipelines.

    python benchmarks/fidelity.py --schedules all|NAME[,NAME...] --m M --fwd-ms F --bwd-ms B
                                  [--p 4] [--rounds K] --json OUT

1. ``hyper-parallel calibrate`` once on ``p`` processes (its own workload: ``hyper_parallel/measure/calibration_job.py``).
2. For each schedule (its default chunks; names as ``simulate --schedule``): ``p`` gloo processes
   train sleep-cost stages (a rank's share sleeps F ms forward, B ms backward, I = W = B / 2, split
   over its chunks; ``hyper_parallel.measure.sleep_pipeline``); the makespan of a step is the last rank's
   end minus the first rank's start after a barrier; the median of K steps after a warm-up step is
   compared with the simulator's prediction from F, B and the machine file alone. The cases run
   in turns (one step of each per round), so that a busy phase of the shared machine hits them alike.
3. ``tune`` over every schedule, chunk count 1-4 and micro-batch count dividing M, on the same
   costs as a costs file would state them (global batch M, measured at micro-batch size 1, so a
   candidate with m micro-batches sleeps M / m times longer per micro-batch; 1 MiB of activations
   per sample and per quarter of a rank's share; memory limit ``6 p`` MiB per rank, 1.5 times what
   1F1B holds at m = M), with the machine file; the pick and the five next-best fitting candidates
   are measured the same way.

4. With ``--gpt``: the demo's GPT (``hyper_parallel.demo``, 8 layers, micro-batches of 2
   sequences of 32 tokens) is profiled with ``hyper-parallel profile`` (this file's
   ``build_stages`` is the profile script), trained with 1F1B on ``p`` processes and ``M``
   micro-batches, and predicted from the profile's costs and the machine file.

OUT: ``{"cases": [{schedule, v, m, predicted_ms, measured_ms, error}], "tune": {picked,
picked_measured_ms, best_measured_ms, candidates}, "gpt": {...} (with --gpt), "machine": ...,
"settings": ..., "load": ...}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

MIB = 1 << 20
LAYERS_PER_RANK = 4
GPT_MICRO_BATCH = 2


def _gpt_parts(num_stages: int, m: int) -> tuple[list[Any], Any, Any, Any]:
    """The demo GPT's stage modules, a batch of ``m`` micro-batches, its targets and the loss."""
    import numpy as np
    import torch

    from hyper_parallel.demo.gpt import GPTConfig, init_gpt_weights
    from hyper_parallel.demo.gpt_torch import GPTStage, cross_entropy_loss

    config = GPTConfig(vocab_size=64, max_seq_len=32, d_model=64, n_heads=4, n_layers=8)
    weights = init_gpt_weights(config)
    rng = np.random.default_rng(0)
    shape = (m * GPT_MICRO_BATCH, config.max_seq_len)
    tokens = torch.from_numpy(rng.integers(0, config.vocab_size, shape))
    targets = torch.from_numpy(rng.integers(0, config.vocab_size, shape))
    stages = [GPTStage(config, s, num_stages, weights) for s in range(num_stages)]
    return stages, tokens, targets, cross_entropy_loss


def build_stages(num_stages: int = 4) -> dict[str, Any]:
    """The profile script convention (``hyper-parallel profile benchmarks/fidelity.py --stages P``)."""
    stages, tokens, targets, loss = _gpt_parts(num_stages, 1)
    return {"stages": stages, "inputs": tokens, "loss_fn": loss, "target": targets}


def gpt_job(m: int, rounds: int) -> list[list[float]]:
    """On every rank: the demo GPT trained with 1F1B, ``[start, end]`` of each timed step."""
    import hyper_parallel as hp
    from hyper_parallel.measure import sleep_pipeline
    from hyper_parallel.platform import get_platform

    p = get_platform()
    modules, tokens, targets, loss = _gpt_parts(p.world_size, m)
    stage = hp.PipelineStage(modules[p.rank], p.rank, p.world_size)
    schedule = hp.Schedule1F1B(stage, m, loss_fn=loss)
    params = list(modules[p.rank].parameters())

    def step() -> None:
        for param in params:
            param.grad = None
        first, last = p.rank == 0, p.rank == p.world_size - 1
        schedule.run(*((tokens,) if first else ()), target=targets if last else None)

    return [[a, b] for a, b, _ in sleep_pipeline.timed_steps(step, rounds, warmup=2)]


def gpt_case(p: int, m: int, rounds: int, machine: Any, folder: str) -> dict[str, Any]:
    """Profile the GPT (a separate process, as a user would), measure it, predict it."""
    import subprocess

    from bench_common import run_job

    from hyper_parallel import Schedule1F1B
    from hyper_parallel.core.pipeline_parallel.tools.calibrate import predict_ms
    from hyper_parallel.core.pipeline_parallel.simulation.costs import load_costs
    from hyper_parallel.measure.sleep_pipeline import makespans_ms

    costs_path = os.path.join(folder, "gpt_costs.json")
    cli = [sys.executable, "-m", "hyper_parallel.cli", "profile", os.path.abspath(__file__), "--stages", str(p),
           "--repeats", "9", "-o", costs_path, "--json"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(cli, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"hyper-parallel profile failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    costs = machine.apply(load_costs(costs_path))
    per_rank = run_job("fidelity", "gpt_job", p, {"m": m, "rounds": rounds}, timeout=3600.0)
    measured = statistics.median(makespans_ms(per_rank))
    predicted = predict_ms(Schedule1F1B, p, 1, m, costs)
    return {"schedule": "1f1b", "v": 1, "m": m, "micro_batch_size": GPT_MICRO_BATCH, "predicted_ms": predicted,
            "measured_ms": measured, "error": (predicted - measured) / measured,
            "profile": {"warnings": report["warnings"], "threads": report["threads"], "costs": report["costs"]}}


def cases_job(cases: list[dict[str, Any]], rounds: int) -> list[list[list[float]]]:
    """On every rank: each case's timed steps as ``[start, end]`` pairs (perf_counter seconds)."""
    from hyper_parallel.measure import sleep_pipeline

    steps = [sleep_pipeline.build(c["schedule"], c["v"], c["m"], c["fwd_ms"], c["bwd_ms"])[1] for c in cases]
    timed = sleep_pipeline.alternating_steps(steps, rounds, warmup=1)
    return [[[a, b] for a, b, _ in case] for case in timed]


def measure(cases: list[dict[str, Any]], p: int, rounds: int) -> list[float]:
    """The median makespan (ms) of each case."""
    from bench_common import run_job

    from hyper_parallel.measure.sleep_pipeline import makespans_ms

    per_rank = run_job("fidelity", "cases_job", p, {"cases": cases, "rounds": rounds}, timeout=3600.0)
    return [statistics.median(makespans_ms([r[k] for r in per_rank])) for k in range(len(cases))]


def tune_costs(p: int, m: int, fwd_ms: float, bwd_ms: float, machine: Any) -> Any:
    """The workload as a costs file would state it: ``p * 4`` equal layers at micro-batch size 1."""
    from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost

    n = LAYERS_PER_RANK
    layer = StageCost(F=fwd_ms / n, B=bwd_ms / n, activation_bytes=MIB)
    costs = CostModel(stages=(layer,), layers=(layer,) * (p * n), micro_batch_size=1)
    return machine.apply(costs)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hyper_parallel.measure.calibration_job import calibrate
    from hyper_parallel.core.pipeline_parallel.tools.calibrate import predict_ms, sleep_costs
    from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, default_chunks, resolve_schedule
    from hyper_parallel.core.pipeline_parallel.simulation.machine import Machine
    from hyper_parallel.core.pipeline_parallel.tools.tune import tune

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
    gpt = None
    if args.gpt:
        gpt = gpt_case(args.p, args.m, args.rounds, machine, os.path.dirname(os.path.abspath(args.json)))
        load.append(os.getloadavg()[0])
    return {
        "cases": rows,
        "tune": {"picked": picked, "picked_measured_ms": picked["measured_ms"] if picked else None,
                 "best_measured_ms": best, "memory_limit_bytes": limit, "global_batch": args.m,
                 "candidates": candidates},
        **({"gpt": gpt} if gpt is not None else {}),
        "machine": machine_json,
        "settings": {"p": args.p, "m": args.m, "fwd_ms": args.fwd_ms, "bwd_ms": args.bwd_ms, "rounds": args.rounds},
        "load": {"loadavg_1min": load, "cpus": os.cpu_count()},
    }


def _positive_ms(text: str) -> float:
    """An argparse ``type``: a finite number of milliseconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def check_cases(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Everything that can be checked before a process starts: the schedule names, ``m >= 2 p``
    and that every schedule generates its lists for these counts (a usage error otherwise)."""
    from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, default_chunks, resolve_schedule

    names = list(available_schedules()) if args.schedules == "all" else [n.strip() for n in args.schedules.split(",")]
    if not any(names):
        parser.error("argument --schedules: name at least one schedule, or all")
    classes = {}
    for name in filter(None, names):
        try:
            key, cls = resolve_schedule(name)
        except ValueError as exc:
            parser.error(f"argument --schedules: {exc}")
        classes[key] = cls
    if args.m < 2 * args.p:
        parser.error(f"argument --m: needs at least 2 p = {2 * args.p} micro-batches, got {args.m}")
    for name, cls in classes.items():
        try:
            cls.generate(args.p, default_chunks(cls), args.m)
        except ValueError as exc:
            parser.error(f"argument --m: {name} cannot run {args.m} micro-batches on {args.p} ranks: {exc}")


def main(argv: list[str] | None = None) -> int:
    from hyper_parallel.cli_paths import output_path
    from hyper_parallel.cli_tools import _int_at_least

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", required=True, help="all, or comma-separated names as simulate --schedule")
    parser.add_argument("--m", type=_int_at_least(1), required=True, help="micro-batches of every case (>= 2 p)")
    parser.add_argument("--fwd-ms", type=_positive_ms, required=True, help="forward sleep of a rank's share (ms)")
    parser.add_argument("--bwd-ms", type=_positive_ms, required=True, help="backward sleep of a rank's share (ms)")
    parser.add_argument("--p", type=_int_at_least(2), default=4, help="pipeline ranks (gloo processes)")
    parser.add_argument("--rounds", type=_int_at_least(5), default=5,
                        help="timed steps per case (K >= 5), after one warm-up step")
    parser.add_argument("--json", type=output_path, required=True, help="where the results go")
    parser.add_argument("--gpt", action="store_true", help="also the demo GPT with 'hyper-parallel profile' costs")
    args = parser.parse_args(argv)
    check_cases(parser, args)
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
    if "gpt" in out:
        g = out["gpt"]
        print(f"demo GPT 1f1b m={g['m']}: predicted {g['predicted_ms']:.1f} ms, measured {g['measured_ms']:.1f} ms "
              f"({g['error']:+.1%})" + (f"; profile warnings: {len(g['profile']['warnings'])}"
                                          if g["profile"]["warnings"] else ""))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
