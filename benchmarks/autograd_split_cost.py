"""Cost of the stage-autograd paths on both frameworks, for one middle stage of the test GPT.

Measures, per micro-batch, forward + full backward against forward + backward-for-inputs +
backward-for-weights (the dx/dW split that zero-bubble schedules use), and on MindSpore the
public recompute fallback. Writes a Markdown table to benchmarks/results/autograd_split_cost.md.

    .venv/bin/python benchmarks/autograd_split_cost.py [--repeats 30]

Timings on a shared 2-core machine are noisy: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyper_parallel.platform.model_spec import GPTConfig, init_gpt_weights  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, max_seq_len=32, d_model=64, n_heads=4, n_layers=6)
BATCH = 8
STAGE, NUM_STAGES = 1, 3  # a middle stage: 2 transformer blocks, hidden in and hidden out


def _platform(framework: str, mode: str | None):
    if framework == "torch":
        from hyper_parallel.platform.torch import TorchPlatform

        return TorchPlatform()
    import mindspore as ms

    from hyper_parallel.platform.mindspore import MindSporePlatform

    ms.runtime.launch_blocking()  # synchronous kernels: stable timings on a shared machine
    return MindSporePlatform(autograd=mode)


def measure(framework: str, mode: str | None, repeats: int) -> dict[str, float]:
    import importlib

    p = _platform(framework, mode)
    models = importlib.import_module(f"hyper_parallel.platform.{framework}.models")
    stage = models.GPTStage(CONFIG, STAGE, NUM_STAGES, init_gpt_weights(CONFIG, 0))
    params = [prm for _, prm in p.named_parameters(stage)]
    rng = np.random.default_rng(0)
    x = p.from_numpy(rng.standard_normal((BATCH, CONFIG.max_seq_len, CONFIG.d_model)).astype(np.float32))
    dy = p.from_numpy(rng.standard_normal((BATCH, CONFIG.max_seq_len, CONFIG.d_model)).astype(np.float32))
    timings: dict[str, list[float]] = {"forward": [], "full backward": [], "dx": [], "dW": []}
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        rec = p.stage_forward(stage, (x,), {}, params, (True,))
        t1 = time.perf_counter()
        p.stage_backward(rec, (dy,))
        t2 = time.perf_counter()
        rec = p.stage_forward(stage, (x,), {}, params, (True,))
        t3 = time.perf_counter()
        p.stage_backward_input(rec, (dy,))
        t4 = time.perf_counter()
        p.stage_backward_weight(rec)
        t5 = time.perf_counter()
        if i >= 3:  # warm-up
            for key, value in zip(timings, (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
                timings[key].append(value)
    return {k: statistics.median(v) * 1e3 for k, v in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    rows = []
    for framework, mode in (("torch", None), ("mindspore", "engine"), ("mindspore", "recompute")):
        t = measure(framework, mode, args.repeats)
        split = t["dx"] + t["dW"]
        label = framework if mode is None else f"{framework} ({mode})"
        rows.append(f"| {label} | {t['forward']:.2f} | {t['full backward']:.2f} | {t['dx']:.2f} | {t['dW']:.2f} "
                    f"| {split / t['full backward']:.2f}x |")
        print(rows[-1], flush=True)
    table = "\n".join([
        f"Stage autograd cost per micro-batch: GPT stage {STAGE} of {NUM_STAGES} (2 blocks, d_model "
        f"{CONFIG.d_model}, seq {CONFIG.max_seq_len}, batch {BATCH}), median of {args.repeats}, milliseconds.",
        "",
        "| backend | forward | full backward | dx only | dW only | (dx + dW) / full |",
        "|---|---|---|---|---|---|",
        *rows,
    ])
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "autograd_split_cost.md"), "w") as f:
        f.write(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    main()
