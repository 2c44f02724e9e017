"""What the saved-tensor pool costs a stage's forward + backward on the CPU.

One stage of the demo GPT (d_model 64, micro-batch 2 x 32 tokens) with 2 and 4 blocks, three
ways, alternating round by round in one process: plain torch (forward, ``torch.autograd.backward``),
hyper-parallel's stage autograd with the pool (``saved_pool=True``: what the dx/dW split, swap and
memory accounting need) and without it (what a run of plain forwards and full backwards uses).

    .venv/bin/python benchmarks/saved_pool_cost.py [--rounds 41] [--out PATH]

Writes benchmarks/results/saved_pool_cost.md. Read the ratios, not the times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import write_result  # noqa: E402

from hyper_parallel.demo.gpt import GPTConfig, init_gpt_weights  # noqa: E402
from hyper_parallel.demo.gpt_torch import GPTStage  # noqa: E402
from hyper_parallel.platform.torch import autograd as stage_autograd  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "saved_pool_cost.md")


def _variants(blocks: int) -> tuple[dict, int]:
    config = GPTConfig(vocab_size=64, max_seq_len=32, d_model=64, n_heads=4, n_layers=4 * blocks)  # 4 stages
    stage = GPTStage(config, 1, 4, init_gpt_weights(config))  # a middle stage: `blocks` blocks
    x = torch.randn(2, 32, 64)
    params = list(stage.parameters())

    def plain() -> None:
        out = stage(x.detach().requires_grad_(True))
        torch.autograd.backward([out], [torch.ones_like(out)])

    def ours(saved_pool: bool) -> None:
        record = stage_autograd.stage_forward(stage, (x,), {}, params, (True,), saved_pool=saved_pool)
        stage_autograd.stage_backward(record, [torch.ones_like(record.outputs[0])])

    saved = [0]

    def count(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        stage(x.detach().requires_grad_(True))
    return {"torch": plain, "pool": lambda: ours(True), "no pool": lambda: ours(False)}, saved[0]


def measure(rounds: int) -> list[dict]:
    rows = []
    for blocks in (2, 4):
        variants, saved = _variants(blocks)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for fn in variants.values():
            fn()
        names = list(variants)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rows.append({"blocks": blocks, "saved": saved, **med})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--out", default=RESULTS, help="where the table goes (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = measure(args.rounds)
    lines = [
        "# Saved-tensor pool cost (one GPT stage, forward + backward, CPU, 1 thread)",
        "",
        f"Median of {args.rounds} alternating rounds; d_model 64, micro-batch 2 x 32 tokens.",
        "",
        "| blocks | saved tensors | torch (ms) | pool (ms) | no pool (ms) | pool / torch | no pool / torch |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['blocks']} | {row['saved']} | {row['torch']:.3f} | {row['pool']:.3f} | {row['no pool']:.3f} "
                     f"| {row['pool'] / row['torch']:.3f} | {row['no pool'] / row['torch']:.3f} |")
    write_result(args.out, lines)


if __name__ == "__main__":
    main()
