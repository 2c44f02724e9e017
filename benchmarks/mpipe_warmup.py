"""MPipe transpose: the warm-up with and without it, simulated and (``--measure``) measured.

Simulated: ``mpipe_model.compare_warmup`` for p ranks, m micro-batches, one or two body stages per
rank, a preprocess of ``--layers`` body layers where one rank's share of the body is
``--layers-per-stage`` layers (default: 2 and 1, a preprocess costing twice a body stage), each
backward mode and both overflow modes; times in the simulator's unit (one rank's share of the body
forward = 1, backward = 2). Measured: ``examples/mpipe_multimodal.py`` on 4 gloo processes with
torch's launcher, MPipe and the plain pipeline alternating step by step in one run (the machine's
load hits both alike; the first steps are left out): the encoder trainable with the recompute,
trainable with ``--owner-backward``, and frozen (or only the given example arguments). Writes benchmarks/results/mpipe_warmup.md.

    .venv/bin/python benchmarks/mpipe_warmup.py [--measure] [--steps 24] [-- example arguments]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hyper_parallel.core.pipeline_parallel.features.mpipe.model import compare_warmup  # noqa: E402

MODES = {  # name -> options of the simulation
    "frozen": dict(trainable=False),
    "trainable, recompute": dict(),
    "trainable, owner_backward": dict(owner_backward=True),
}


def simulated(p: int, m: int, layers: int, layers_per_stage: float) -> list[str]:
    lines = [f"### Simulated: p = {p}, m = {m}, preprocess = {layers / layers_per_stage:g} x a body stage", "",
             "| chunks | preprocess | overflow | makespan plain | makespan MPipe | warm-up end plain | warm-up end "
             "MPipe | warm-up bubble plain | warm-up bubble MPipe |",
             "|---|---|---|---|---|---|---|---|---|"]
    for chunks in (1, 2):
        for name, options in MODES.items():
            for overflow in ("full", "min"):
                sims = compare_warmup(p, chunks, m, layers, layers_per_stage=layers_per_stage,
                                      overflow_mode=overflow, **options)
                a, b = sims["plain"], sims["mpipe"]
                lines.append(f"| {chunks} | {name} | {overflow} | {a.result.makespan:g} | {b.result.makespan:g} | "
                             f"{a.warmup_end:g} | {b.warmup_end:g} | {a.warmup_bubble:g} | {b.warmup_bubble:g} |")
    lines += ["", "Warm-up: until stage 0's rank starts its first backward; warm-up bubble: idle time of all "
              "ranks during it.", ""]
    return lines


def measured(steps: int, extra: list[str]) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "summary.json")
        env = dict(os.environ, PYTHONPATH=ROOT, HYPER_PARALLEL_PLATFORM="torch", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4",
               "--master-addr=127.0.0.1", "--master-port=29911", os.path.join(ROOT, "examples", "mpipe_multimodal.py"),
               "--steps", str(steps), "--out", out, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"the example failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out, encoding="utf-8") as f:
            summary = json.load(f)
    med, warm = summary["median_ms"], summary["warmup_ms"]
    return [f"### Measured: examples/mpipe_multimodal.py, 4 gloo processes, {steps} steps alternating "
            f"(arguments: {' '.join(extra) or 'defaults'})", "",
            "| | plain | MPipe | MPipe / plain |", "|---|---|---|---|",
            f"| median step time (ms) | {med['plain']:.1f} | {med['mpipe']:.1f} | {med['mpipe'] / med['plain']:.3f} |",
            f"| median warm-up (ms) | {warm['plain']:.1f} | {warm['mpipe']:.1f} | {warm['mpipe'] / warm['plain']:.3f} |",
            "", f"machine: {os.cpu_count()} CPU cores shared by the 4 processes (and other jobs)", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("-m", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--layers-per-stage", type=float, default=1.0)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("extra", nargs="*", help="arguments for the example (after --)")
    args = parser.parse_args()
    lines = ["# MPipe transpose: warm-up with and without it", ""]
    lines += simulated(args.p, args.m, args.layers, args.layers_per_stage)
    if args.measure:
        for extra in ([args.extra] if args.extra else [[], ["--owner-backward"], ["--freeze-encoder"]]):
            lines += measured(args.steps, extra)
    text = "\n".join(lines)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "mpipe_warmup.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
