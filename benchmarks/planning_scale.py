"""What one rank pays to plan a schedule at cluster scale: ours against torch.distributed.pipelining.

Planning is what a schedule's constructor does before any communication: ours generates the
compute lists of every rank and plans that rank's list with the defaults (``overlap_p2p=True``,
metadata for the first micro-batch): for ``plain`` (gloo's eager engine) and ``batch`` (the
stream engine of NCCL/HCCL) a pass linear in the job plans and checks the rank's own list
(``lowering/rank_plan.py``); ``ScheduleMPipeTranspose`` (``plain`` only: it runs on the eager
engines) plans its rank's list with its preprocess steps (``features/mpipe/rank_plan.py``); torch
has no MPipe, so its row shows torch's build of the body schedule (1F1B, or interleaved 1F1B for
v > 1). Torch's constructor computes every rank's actions and adds its communication steps. Each
figure is the CPU time of one build for a middle rank in a fresh process (nothing reused from an
earlier build), the smallest of ``--rounds``; for MPipe, whose ranks plan different amounts, the
generation plus the most that rank 0 (stage 0's), rank 1 or a middle rank takes; ``peak MiB``
is how much the process's peak resident memory grew while planning. The growth columns divide
the time at 2m by the time at m (near-linear: about 2).

    .venv/bin/python benchmarks/planning_scale.py [--smoke] [--rounds 1] [--out PATH] [--timeout 600]

Writes benchmarks/results/planning_scale.md (and ``--json``) and prints it; ``bench.py --only
planning`` runs it as a section of ``make bench``. ``--lib DIR`` plans with another checkout's
library (one from before the per-rank planning lowers and validates the whole job).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import types
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.environ.get("PLANNING_SCALE_LIB", ROOT), HERE]

from bench_common import write_result  # noqa: E402

RESULTS = os.path.join(HERE, "results", "planning_scale.md")
# (our class, torch's class or None, p, v, m); growth rows add the same with 2m
FULL_ROWS = [  # the sizes issue 22 was filed with, then the largest of every schedule (p = 64, v <= 4, m = 1024)
    ("Schedule1F1B", "Schedule1F1B", 32, 1, 256),
    ("ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B", 16, 4, 128),
    ("ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B", 32, 4, 512),
    ("ScheduleZBVZeroBubble", "ScheduleZBVZeroBubble", 16, 2, 128),
    ("ScheduleGPipe", "ScheduleGPipe", 64, 1, 1024),
    ("Schedule1F1B", "Schedule1F1B", 64, 1, 1024),
    ("ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B", 64, 4, 1024),
    ("ScheduleLoopedBFS", "ScheduleLoopedBFS", 64, 4, 1024),
    ("ScheduleInterleavedZeroBubble", "ScheduleInterleavedZeroBubble", 64, 4, 1024),
    ("ScheduleZBVZeroBubble", "ScheduleZBVZeroBubble", 64, 2, 1024),
    ("ScheduleDualPipeV", "ScheduleDualPipeV", 64, 2, 1024),
    ("ScheduleMPipeTranspose", "Schedule1F1B", 64, 1, 1024),
    ("ScheduleMPipeTranspose", "ScheduleInterleaved1F1B", 64, 4, 1024),
]
FULL_GROWTH = [("Schedule1F1B", 64, 1, 512), ("ScheduleInterleaved1F1B", 64, 4, 512), ("ScheduleZBVZeroBubble", 64, 2, 512),
               ("ScheduleDualPipeV", 64, 2, 512), ("ScheduleMPipeTranspose", 64, 1, 512)]
SMOKE_ROWS = [("Schedule1F1B", "Schedule1F1B", 2, 1, 4), ("ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B", 2, 2, 4),
              ("ScheduleDualPipeV", None, 2, 2, 8), ("ScheduleMPipeTranspose", None, 2, 1, 4)]
SMOKE_GROWTH = [("Schedule1F1B", 2, 1, 4)]
TRANSPORTS = ("plain", "batch")
ENGINES = {"plain": "eager", "batch": "stream"}  # gloo / LocalCluster vs NCCL / HCCL


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def plan_ours(name: str, p: int, v: int, m: int, transport: str) -> dict[str, Any]:
    """One build of our plan in this process, for a middle rank, as a schedule's constructor does it."""
    import contextlib

    import hyper_parallel.core.pipeline_parallel as pp

    try:
        from hyper_parallel.core.pipeline_parallel.lowering.gc_pause import paused_gc
    except ImportError:  # --lib: a version from before the pause
        paused_gc = contextlib.nullcontext
    cls = getattr(pp, name)
    mpipe = name == "ScheduleMPipeTranspose"
    if mpipe and transport != "plain":
        return {"seconds": None, "peak_mib": None, "error": "plain only"}
    before = _peak_kib()
    start = time.process_time()
    with paused_gc():
        compute = cls.generate(p, v, m)
        placement = cls.stage_placement(p, v)
        if mpipe:  # ranks plan different amounts: stage 0's, its neighbour's, a middle one's; the most counts
            generated = time.process_time() - start
            plans = []
            for rank in sorted({0, 1 % p, p // 2}):
                begin = time.process_time()
                own = _plan_mpipe_rank(compute, placement, rank, p, m)
                if own is None:
                    _plan_job(compute, placement, p, m, transport, mpipe)
                plans.append(time.process_time() - begin)
            seconds = generated + max(plans)
        else:
            own = _plan_rank(compute, placement, p // 2, m, transport)
            if own is None:
                _plan_job(compute, placement, p, m, transport, mpipe)
            seconds = time.process_time() - start
    return {"seconds": seconds, "peak_mib": (_peak_kib() - before) / 1024, "whole_job": own is None}


def _plan_rank(compute: Any, placement: dict[int, int], rank: int, m: int, transport: str) -> Any:
    try:
        from hyper_parallel.core.pipeline_parallel.lowering.rank_plan import plan_rank
    except ImportError:  # --lib: a version that plans the whole job
        return None
    return plan_rank(compute, placement, rank, m, transport, metadata="first", prefetch=True)


def _plan_mpipe_rank(compute: Any, placement: dict[int, int], rank: int, p: int, m: int) -> Any:
    """``rank``'s list with its MPipe steps, as ``ScheduleMPipeTranspose`` plans it on gloo."""
    try:
        from hyper_parallel.core.pipeline_parallel.features.mpipe.rank_plan import plan_mpipe_rank
    except ImportError:  # --lib: a version that plans the whole job
        return None
    from hyper_parallel.core.pipeline_parallel.features.mpipe.plan import MPipePlan
    from hyper_parallel.core.pipeline_parallel.simulation.costs import CostModel, StageCost

    v = len(placement) // p
    return plan_mpipe_rank(compute, placement, rank, MPipePlan(p, m, "full", True, True, "recompute"), metadata="first",
                           prefetch=True, costs=CostModel.per_rank_share(p, v), preprocess=StageCost(F=1.0, B=2.0))


def _plan_job(compute: Any, placement: dict[int, int], p: int, m: int, transport: str, mpipe: bool) -> None:
    """Lower, (MPipe: place its steps the way its lowering pass does,) validate the whole job."""
    from hyper_parallel.core.pipeline_parallel.lowering.p2p import lower
    from hyper_parallel.core.pipeline_parallel.lowering.validate import validate_lowered

    lowered = lower(compute, placement, transport, metadata="first", prefetch=True)
    if mpipe:
        from hyper_parallel.core.pipeline_parallel.features.mpipe.model import check_mpipe, place_mpipe_steps
        from hyper_parallel.core.pipeline_parallel.features.mpipe.plan import MPipePlan

        plan = MPipePlan(p, m, "full", True, True, "recompute")
        lowered = place_mpipe_steps(lowered, placement, plan)
        check_mpipe(lowered, placement, plan)
    validate_lowered(lowered, placement, m, transport, False, engine=ENGINES[transport])


def _torch_stage(p: int, v: int, rank: int, chunk: int, v_shape: bool) -> Any:
    """What torch's schedule constructors read of a stage (no module, no process group)."""
    index = (rank if chunk == 0 else 2 * p - 1 - rank) if v_shape else chunk * p + rank
    return types.SimpleNamespace(group_size=p, group_rank=rank, num_stages=p * v, stage_index=index,
                                 is_first=index == 0, is_last=index == p * v - 1,
                                 stage_index_to_group_rank=None, submod=types.SimpleNamespace())


def plan_torch(name: str, p: int, v: int, m: int) -> dict[str, Any]:
    """One construction of torch's schedule for rank 0 (it computes every rank's actions)."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, name)
    v_shape = name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    before = _peak_kib()
    start = time.process_time()
    if issubclass(cls, schedules.PipelineScheduleSingle):
        cls(_torch_stage(p, 1, 0, 0, v_shape), m)
    else:
        cls([_torch_stage(p, v, 0, c, v_shape) for c in range(v)], m)
    seconds = time.process_time() - start
    return {"seconds": seconds, "peak_mib": (_peak_kib() - before) / 1024}


LIB = [ROOT]  # where the children import hyper_parallel from (--lib)


def _in_child(args: list[str], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*LIB, os.environ.get("PYTHONPATH", "")]),
               PLANNING_SCALE_LIB=LIB[0])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"seconds": None, "peak_mib": None, "error": f"over {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"seconds": None, "peak_mib": None, "error": proc.stderr.strip().splitlines()[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _best(args: list[str], rounds: int, timeout: float) -> dict[str, Any]:
    runs = [_in_child(args, timeout) for _ in range(rounds)]
    done = [r for r in runs if r.get("seconds") is not None]
    return min(done, key=lambda r: r["seconds"]) if done else runs[0]


def measure(rows: list[tuple], growth: list[tuple], rounds: int = 1, timeout: float = 600) -> dict[str, Any]:
    """Every row ours (both transports) and torch's; every growth row at m and 2m, ours only."""
    table = []
    for ours, theirs, p, v, m in rows:
        row: dict[str, Any] = {"schedule": ours, "p": p, "v": v, "m": m}
        for transport in TRANSPORTS:
            row[transport] = _best(["ours", ours, str(p), str(v), str(m), transport], rounds, timeout)
        row["torch"] = _best(["torch", theirs, str(p), str(v), str(m)], rounds, timeout) if theirs else None
        print(json.dumps(row), flush=True)
        table.append(row)
    grown = []
    growth_rounds = max(3, rounds)  # a ratio of two single builds moves by +-15 % on this machine
    for name, p, v, m in growth:
        row = {"schedule": name, "p": p, "v": v, "m": m}
        for transport in TRANSPORTS:
            for mm in (m, 2 * m):
                row[f"{transport}_{mm}"] = _best(["ours", name, str(p), str(v), str(mm), transport], growth_rounds,
                                                 timeout)
        print(json.dumps(row), flush=True)
        grown.append(row)
    return {"rows": table, "growth": grown, "rounds": rounds, "growth_rounds": growth_rounds}


def _s(result: dict[str, Any] | None, key: str = "seconds") -> str:
    if result is None:
        return "-"
    if result.get(key) is None:
        return result.get("error", "failed")
    value = result[key]
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _target(row: dict[str, Any]) -> str:
    limit = max(1.0, row["torch"]["seconds"] if row["torch"] and row["torch"].get("seconds") else 0.0)
    times = [row[t]["seconds"] for t in TRANSPORTS if row[t].get("error") != "plain only"]
    if any(t is None for t in times):
        return "**no**"
    return "yes" if max(times) <= limit else "**no**"


def lines(results: dict[str, Any], smoke: bool) -> list[str]:
    """The markdown tables of ``measure``'s results."""
    out = ["# Planning at scale: one rank's schedule construction, ours vs torch.distributed.pipelining", "",
           f"Written by `benchmarks/planning_scale.py`{' --smoke (figures mean nothing)' if smoke else ''}; CPU "
           f"seconds of one build (a middle rank's; MPipe: stage 0's rank, which plans the most) in a fresh process, "
           f"best of {results['rounds']}; ours with the defaults (prefetch, metadata for the first micro-batch), "
           "`plain` checked for gloo's eager engine, `batch` for the stream engine of NCCL/HCCL; `planned`: the rank's "
           "own list, or every rank's. Torch has no MPipe: its column there is torch's build of the body schedule "
           "(1F1B, or interleaved 1F1B for v > 1). Target: ours <= max(torch, 1 s).", "",
           "| schedule | p | v | m | torch (s) | ours plain (s) | ours batch (s) | plain peak MiB | batch peak MiB "
           "| planned | target met |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        whole = any(row[t].get("whole_job") for t in TRANSPORTS)
        out.append(f"| {row['schedule']} | {row['p']} | {row['v']} | {row['m']} | {_s(row['torch'])} | "
                   f"{_s(row['plain'])} | {_s(row['batch'])} | {_s(row['plain'], 'peak_mib')} | "
                   f"{_s(row['batch'], 'peak_mib')} | {'whole job' if whole else 'its rank'} | {_target(row)} |")
    out += ["", f"Growth with m (ours): time at 2m / time at m, each the best of {results.get('growth_rounds', 1)} builds.", "",
            "| schedule | p | v | m -> 2m | plain (s) | plain growth | batch (s) | batch growth |",
            "|---|---|---|---|---|---|---|---|"]
    for row in results["growth"]:
        m = row["m"]
        cells = []
        for transport in TRANSPORTS:
            a, b = row[f"{transport}_{m}"], row[f"{transport}_{2 * m}"]
            ratio = f"{b['seconds'] / a['seconds']:.2f}" if a.get("seconds") and b.get("seconds") else "-"
            cells += [f"{_s(a)} -> {_s(b)}", ratio]
        out.append(f"| {row['schedule']} | {row['p']} | {row['v']} | {m} -> {2 * m} | " + " | ".join(cells) + " |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument("--rounds", type=int, default=1, help="builds per figure, the best kept")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one build may take")
    parser.add_argument("--out", default=RESULTS, help="where the table goes (default: %(default)s)")
    parser.add_argument("--json", default="", help="also write the raw results here")
    parser.add_argument("--lib", default=ROOT, help="import hyper_parallel from this folder (another version)")
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)  # a child: one build, JSON on stdout
    args = parser.parse_args()
    LIB[0] = os.path.abspath(args.lib)
    if args.one:
        kind, name, *sizes = args.one
        if kind == "ours":
            p, v, m, transport = int(sizes[0]), int(sizes[1]), int(sizes[2]), sizes[3]
            print(json.dumps(plan_ours(name, p, v, m, transport)))
        else:
            print(json.dumps(plan_torch(name, *(int(s) for s in sizes[:3]))))
        return
    rows, growth = (SMOKE_ROWS, SMOKE_GROWTH) if args.smoke else (FULL_ROWS, FULL_GROWTH)
    results = measure(rows, growth, args.rounds, 60 if args.smoke else args.timeout)
    write_result(args.out, lines(results, args.smoke))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
