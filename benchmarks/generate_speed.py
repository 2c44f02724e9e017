"""How long generating a schedule's compute-only lists takes: ``cls.generate(p, v, m)`` per schedule.

For every schedule of the catalog (``tools/catalog.py``) and every v from 1 to ``--max-chunks`` it
accepts, the CPU time of one ``generate`` call with nothing reused (the plan cache is cleared
first), the smallest of ``--rounds``. This is what ``hyper-parallel tune`` pays per candidate before
lowering and simulating it.

    .venv/bin/python benchmarks/generate_speed.py [--p 64] [--m 1024] [--rounds 3] [--out PATH]

Prints a Markdown table (and writes it to ``--out``). ``PYTHONPATH=<other checkout>`` times another
version of the library.
"""

from __future__ import annotations

import argparse
import time

from hyper_parallel.core.pipeline_parallel.lowering import plan_cache
from hyper_parallel.core.pipeline_parallel.tools.catalog import available_schedules, chunk_range


def generate_seconds(cls: type, p: int, v: int, m: int, rounds: int) -> float:
    """The smallest CPU time of ``rounds`` calls of ``cls.generate(p, v, m)``, each from scratch."""
    best = float("inf")
    for _ in range(rounds):
        plan_cache.clear()
        start = time.process_time()
        cls.generate(p, v, m)
        best = min(best, time.process_time() - start)
    plan_cache.clear()
    return best


def table(p: int, m: int, rounds: int, max_chunks: int) -> str:
    """The Markdown table of every catalog schedule at every v it accepts up to ``max_chunks``."""
    lines = [f"generate({p}, v, {m}): CPU seconds, best of {rounds}", "",
             "| schedule | v | seconds |", "| --- | --- | --- |"]
    for name, cls in available_schedules().items():
        low, high = chunk_range(cls)
        for v in range(max(1, low), min(max_chunks, high) + 1):
            lines.append(f"| {name} | {v} | {generate_seconds(cls, p, v, m, rounds):.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=64, help="pipeline ranks")
    parser.add_argument("--m", type=int, default=1024, help="micro-batches")
    parser.add_argument("--rounds", type=int, default=3, help="calls per figure (the smallest is kept)")
    parser.add_argument("--max-chunks", type=int, default=4, help="largest v")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    text = table(args.p, args.m, args.rounds, args.max_chunks)
    print(text, end="")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            out.write(text)


if __name__ == "__main__":
    main()
