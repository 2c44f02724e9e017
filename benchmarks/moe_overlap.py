"""How much all-to-all time ``overlap_b_f`` hides: examples/moe_overlap.py on 4 gloo processes.

Method. Each round launches the example with torch's launcher (pp=2 x ep=2, interleaved 1F1B, two
chunks per rank): ``2 * --steps`` training steps alternating between plain interleaved 1F1B and the
same schedule with overlap_b_f, on the same stages (the machine's load hits both alike). Each rank
times every call into its all-to-alls (start and wait, dispatch and combine, forward and backward),
per step. Without the overlap every all-to-all is waited for right after it started, so that sum is
the all-to-all time ``A`` of a step; with the overlap it is the exposed time ``E`` (what the rank
still waits after the other side of its pair computed meanwhile). Hidden = ``A - E``. The first step
of each mode in each round is left out (warm-up); the table gives per rank the median over the remaining steps
of all rounds, and the median step time of each mode. Both include any time a rank waits for its
``ep`` peer to reach the same all-to-all. The machine is shared: read the ratios, not the absolute
times. Writes benchmarks/results/moe_overlap.md.

    .venv/bin/python benchmarks/moe_overlap.py [--rounds 2] [--steps 4] [-- example arguments]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "moe_overlap.py")
DEFAULT = ["--width", "64", "--hidden", "128", "--tokens", "2048", "--layers", "2", "--micro-batches", "8"]
WORLD = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(steps: int, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report")
        env = dict(os.environ, PYTHONPATH=ROOT, HYPER_PARALLEL_PLATFORM="torch", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={WORLD}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", EXAMPLE, *extra,
               "--steps", str(2 * steps), "--out", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"example failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return [json.load(open(f"{out}.rank{r}.json")) for r in range(WORLD)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="steps per mode and round (the first is left out)")
    parser.add_argument("example_args", nargs="*", help="after --: arguments of the example")
    args = parser.parse_args()
    extra = args.example_args or DEFAULT
    rows: dict[int, dict[str, list[dict]]] = {r: {"no overlap": [], "overlap_b_f": []} for r in range(WORLD)}
    for _ in range(args.rounds):
        for report in one_round(args.steps, extra):
            for label, steps in report["phases"].items():
                rows[report["rank"]][label] += steps[1:]
    lines = ["# All-to-all time hidden by overlap_b_f (examples/moe_overlap.py, 4 gloo processes)", "",
             f"Example arguments: `{' '.join(extra)}`; {args.rounds} round(s) of {args.steps} steps per mode, "
             "alternating, the first step of each mode left out; medians per rank.", "",
             "| rank (pp, ep) | all-to-all without overlap (ms) | exposed with overlap_b_f (ms) | hidden (ms) | "
             "hidden / all-to-all | step without (ms) | step with (ms) | step ratio with / without |",
             "|---|---|---|---|---|---|---|---|"]
    for rank in range(WORLD):
        off, on = rows[rank]["no overlap"], rows[rank]["overlap_b_f"]
        a = statistics.median(r["all_to_all"] for r in off)
        e = statistics.median(r["all_to_all"] for r in on)
        t_off = statistics.median(r["seconds"] for r in off)
        t_on = statistics.median(r["seconds"] for r in on)
        lines.append(f"| {rank} ({rank // 2}, {rank % 2}) | {a * 1e3:.1f} | {e * 1e3:.1f} | {(a - e) * 1e3:.1f} | "
                     f"{(a - e) / a if a else 0.0:.2f} | {t_off * 1e3:.0f} | {t_on * 1e3:.0f} | {t_on / t_off:.2f} |")
    lines += ["", "Method: " + __doc__.split("Method. ")[1].split("\n\n")[0].replace("\n", " "), "",
              "Reading: gloo moves the data on its own threads, so an all-to-all started before the turn passes "
              "is hidden only if a core is free for those threads while the other side computes; on a machine "
              "whose cores are all busy it is not. A fused pair also sends both halves' outputs only after both "
              "ran (the backward's input gradient leaves later than in the plain order), which delays the "
              "neighbouring rank when the two halves cannot overlap in time.", ""]
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    path = os.path.join(ROOT, "benchmarks", "results", "moe_overlap.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
