"""Cost of giving each LocalCluster rank its own random state at every turn change.

Two measurements per backend:

* one switch between two ranks (save the outgoing rank's states, install the incoming one's),
  when nothing was drawn since the last switch and when numpy's global generator was used
  (numpy's ``get_state``/``set_state`` are the expensive part, so they are skipped when unchanged);
* a two-rank ping-pong of ``send_object``/``recv_object`` (two turn changes per round trip) with the
  per-rank states switched, against the same ping-pong with the switch disabled.

With ``--demo N``, also N paired runs of the MindSpore demo job (2 LocalCluster ranks, 3 steps) with
and without the switch: MindSpore's ``get_rng_state``/``set_rng_state`` wait for the kernels already
queued, so a switch also drains MindSpore's dispatch queue, which only a whole job can price.

Writes a Markdown table to benchmarks/results/local_rng_switch.md.

    .venv/bin/python benchmarks/local_rng_switch.py [--repeats 2000] [--demo 3]

Timings on a shared 2-core machine are noisy: read the orders of magnitude.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyper_parallel.platform import platform_class  # noqa: E402
from hyper_parallel.platform import local  # noqa: E402
from hyper_parallel.platform.local import LocalCluster  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "local_rng_switch.md")


def _switch_us(backend: str, repeats: int, touch_numpy: bool) -> float:
    """Median microseconds of one switch between two ranks."""
    randomness = local._RankRandomness(platform_class(backend)(), 2)
    times = []
    for i in range(repeats):
        if touch_numpy:
            np.random.rand()
        start = time.perf_counter()
        randomness.switch_to(i % 2)
        times.append(time.perf_counter() - start)
    randomness.restore_caller()
    return statistics.median(times[2:]) * 1e6


def _ping_pong(round_trips: int) -> None:
    from hyper_parallel.platform import get_platform

    p = get_platform()
    for k in range(round_trips):
        if p.rank == 0:
            p.send_object(k, 1)
            p.recv_object(1)
        else:
            p.recv_object(0)
            p.send_object(k, 0)


def _timed_runs(backend: str, fn, args: tuple, repeats: int, switch: bool) -> list[float]:
    original = local._RankRandomness.switch_to
    if not switch:
        local._RankRandomness.switch_to = lambda self, rank: None  # type: ignore[method-assign]
    try:
        cluster = LocalCluster(2, platform=backend)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            cluster.run(fn, *args)
            runs.append(time.perf_counter() - start)
        return runs
    finally:
        local._RankRandomness.switch_to = original  # type: ignore[method-assign]


def _round_trip_us(backend: str, round_trips: int, switch: bool) -> float:
    _timed_runs(backend, _ping_pong, (10,), 1, switch)  # warm-up
    return statistics.median(_timed_runs(backend, _ping_pong, (round_trips,), 5, switch)) / round_trips * 1e6


def _demo_seconds(pairs: int) -> tuple[float, float]:
    """Median seconds of the MindSpore demo job, (with switch, without), from alternating runs."""
    from hyper_parallel.demo import DemoOptions, train_worker

    opts = DemoOptions(schedule="1f1b", ranks=2, steps=3, micro_batches=4, batch_size=8)
    args = (opts, False)
    _timed_runs("mindspore", train_worker, args, 1, True)  # warm-up
    on, off = [], []
    for _ in range(pairs):
        on += _timed_runs("mindspore", train_worker, args, 1, True)
        off += _timed_runs("mindspore", train_worker, args, 1, False)
    return statistics.median(on), statistics.median(off)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--round-trips", type=int, default=500)
    parser.add_argument("--demo", type=int, default=0, help="paired runs of the MindSpore demo job (0: skip)")
    args = parser.parse_args()
    rows = []
    for backend in ("torch", "mindspore"):
        rows.append((
            backend,
            _switch_us(backend, args.repeats, touch_numpy=False),
            _switch_us(backend, args.repeats, touch_numpy=True),
            _round_trip_us(backend, args.round_trips, switch=False),
            _round_trip_us(backend, args.round_trips, switch=True),
        ))
    lines = [
        "Per-rank random state in LocalCluster: cost of a turn change, microseconds (median).",
        "",
        "| backend | one switch, numpy untouched | one switch, numpy used | ping-pong round trip, no switch "
        "| ping-pong round trip, with switch (2 switches) |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {b} | {a:.1f} | {n:.1f} | {r0:.0f} | {r1:.0f} |" for b, a, n, r0, r1 in rows]
    if args.demo:
        on, off = _demo_seconds(args.demo)
        lines += [
            "",
            f"MindSpore demo job (2 LocalCluster ranks, 1F1B, 4 micro-batches, 3 steps), median of {args.demo} "
            "alternating runs, seconds:",
            "",
            "| with switch | without switch |",
            "|---|---|",
            f"| {on:.2f} | {off:.2f} |",
        ]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
