"""Activation memory and time of swap and recompute in a pipeline (1F1B, 4 LocalCluster ranks).

For each option, the GPT of ``hyper_parallel.demo`` (2 blocks per stage) is trained for a few steps;
reported per option: the peak bytes of saved activations resident on the compute device on rank 0
and on the busiest rank (``schedule.memory_stats()``: read from the saved-tensor hooks and storage
sizes, not from an allocator), the bytes swapped on rank 0, and the median wall time of one step
in CPU time of the process (all four ranks are threads of one process, one computing at a time, so
this is the sum of their work; CPU time rather than wall time because the machine is shared). Options:

* resident -- nothing done;
* swap (schedule) -- ``swap=True`` (micro-batches whose backward is >= 4 compute slots after
  their forward go to host memory between the two);
* swap_wrapper -- every block wrapped with ``swap_wrapper``;
* checkpoint -- every block wrapped with ``checkpoint_wrapper`` (re-run in backward);
* selective -- ``checkpoint_wrapper(block, save=<the four Linear layers>)``: keeps the linear
  layers' outputs, recomputes layer norms, attention core and GELU;
* checkpoint + swap -- both (the checkpointed blocks' inputs are swapped).

On this CPU machine "host memory" is the same RAM: swap costs real copies but frees no physical
memory; the byte counts say what a device would keep. Timings on a shared 2-core machine are noisy.

    .venv/bin/python benchmarks/activation_memory.py [--framework torch|mindspore|both] [--steps 4]

Writes benchmarks/results/activation_memory_<framework>.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper, swap_wrapper  # noqa: E402
from hyper_parallel.core.pipeline_parallel.features.memory_stats import track_memory  # noqa: E402
from hyper_parallel.core.pipeline_parallel.schedule import Schedule1F1B  # noqa: E402
from hyper_parallel.core.pipeline_parallel.runtime.stage import PipelineStage  # noqa: E402
from hyper_parallel.demo.gpt import GPTConfig, init_gpt_weights  # noqa: E402
from hyper_parallel.platform import get_platform  # noqa: E402
from hyper_parallel.platform.local import LocalCluster  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "activation_memory_{}.md")
P, MICRO = 4, 8
LINEARS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
OPTIONS = {  # name -> (per-block wrapper, schedule swap)
    "resident": (None, False),
    "swap (schedule)": (None, True),
    "swap_wrapper": ("swap", False),
    "checkpoint": ("checkpoint", False),
    "selective": ("selective", False),
    "checkpoint + swap": ("checkpoint", True),
}
CONFIGS = {
    "torch": GPTConfig(vocab_size=64, max_seq_len=64, d_model=128, n_heads=4, n_layers=8),
    "mindspore": GPTConfig(vocab_size=64, max_seq_len=32, d_model=64, n_heads=4, n_layers=4),
}


def _body(config: GPTConfig, option: str, steps: int, batch: tuple[np.ndarray, np.ndarray]) -> dict:
    p = get_platform()
    mod = importlib.import_module(f"hyper_parallel.demo.gpt_{p.name}")
    module = mod.GPTStage(config, p.rank, P, init_gpt_weights(config))
    wrap, swap = OPTIONS[option]
    for block in module.blocks.values():
        if wrap == "swap":
            swap_wrapper(block)
        elif wrap == "checkpoint":
            checkpoint_wrapper(block)
        elif wrap == "selective":
            checkpoint_wrapper(block, save=LINEARS)
    stage = PipelineStage(module, p.rank, P)
    schedule = Schedule1F1B(stage, MICRO, loss_fn=mod.cross_entropy_loss, swap=swap)
    track_memory(schedule)
    tokens = p.from_numpy(batch[0])
    target = p.from_numpy(batch[1]) if stage.is_last else None
    times = []
    for step in range(steps + 1):
        stage.zero_grad()
        start = time.process_time()
        schedule.run(tokens, target=target)
        if step:  # the first step exchanges shapes and warms up
            times.append(time.process_time() - start)
    stats = schedule.memory_stats()
    return {"peak": stats.peak_saved_bytes, "swapped": stats.swapped_bytes, "times": times}


def measure(framework: str, steps: int, rounds: int) -> list[tuple[str, int, int, int, float]]:
    if framework == "torch":
        import torch

        torch.set_num_threads(1)
    config = CONFIGS[framework]
    rng = np.random.default_rng(0)
    batch = (rng.integers(0, config.vocab_size, (16, config.max_seq_len)).astype(np.int64),
             rng.integers(0, config.vocab_size, (16, config.max_seq_len)).astype(np.int64))
    times: dict[str, list[float]] = {name: [] for name in OPTIONS}
    memory: dict[str, tuple[int, int, int]] = {}
    for _ in range(rounds):  # alternate the options, so slow phases of the machine hit all of them
        for name in OPTIONS:
            results = LocalCluster(P, platform=framework).run(_body, config, name, steps, batch)
            times[name] += results[0]["times"]
            memory[name] = (results[0]["peak"], max(r["peak"] for r in results), results[0]["swapped"])
    return [(name, *memory[name], statistics.median(times[name])) for name in OPTIONS]


def table(framework: str, rows: list[tuple[str, int, int, int, float]]) -> str:
    config = CONFIGS[framework]
    base_peak, base_time = rows[0][1], rows[0][4]
    lines = [
        f"### {framework}: 1F1B, p={P}, m={MICRO}, GPT d_model={config.d_model}, seq={config.max_seq_len}, "
        f"{config.n_layers // P} blocks per stage, micro-batch 2",
        "",
        "| option | rank 0 peak saved (KiB) | vs resident | busiest rank peak (KiB) | swapped on rank 0 (KiB) "
        "| step (CPU ms) | vs resident |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, peak0, peak_max, swapped, seconds in rows:
        lines.append(f"| {name} | {peak0 / 1024:.0f} | {peak0 / base_peak:.2f} | {peak_max / 1024:.0f} | "
                     f"{swapped / 1024:.0f} | {seconds * 1e3:.1f} | {seconds / base_time:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=["torch", "mindspore", "both"], default="both")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    frameworks = ["torch", "mindspore"] if args.framework == "both" else [args.framework]
    for framework in frameworks:
        rows = measure(framework, args.steps, args.rounds)
        out = ["# Activation memory and time: swap and recompute", "",
               "Written by `benchmarks/activation_memory.py` (see its docstring for what is measured). Peak "
               "saved bytes come from the saved-tensor hooks and storage sizes; step times are the median CPU "
               f"time of {args.steps} steps x {args.rounds} rounds on a shared 2-core CPU machine, all 4 ranks "
               "in one process (one intra-op thread).", "", table(framework, rows)]
        print(out[-1], flush=True)
        path = RESULTS.format(framework)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(out))


if __name__ == "__main__":
    main()
