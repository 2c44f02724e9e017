"""Cost of the stage-autograd paths on both frameworks, for one middle stage of the test GPT.

Measures, per micro-batch, the forward, the full backward, the backward for inputs only (dx) and
the backward for weights only (dW) -- the split that zero-bubble schedules use -- and reports
(dx + dW) / full:

* torch, this library's split (``TorchPlatform``), and torch pipelining's own split
  (``torch.distributed.pipelining._backward.stage_backward_input`` / ``stage_backward_weight``) on
  the same stage, at d_model 64 (the small config) and d_model 256 (seq 128, batch 8). The two run
  alternately in one loop, with the order flipped every repeat, so that load on the shared machine
  hits both alike;
* MindSpore, the engine path and the public recompute fallback, at the small config.

torch runs twice: with glibc's default malloc settings, then with freed memory kept for reuse
(``mallopt``). With the defaults, large freed blocks go back to the system and are faulted in
again, which charges the split for the memory it holds between dx and dW (a cost the caching
allocators of accelerators do not have) and makes the timings noisy.

Every variant drops its graph before the next one starts. Writes a Markdown table to
benchmarks/results/autograd_split_cost.md.

    .venv/bin/python benchmarks/autograd_split_cost.py [--repeats 30] [--threads 1]

torch is timed in CPU time of the calling thread (with one intra-op thread all its work runs
there), which other jobs on the shared machine disturb far less than wall time; MindSpore may do
its work on other threads and is timed in wall time. Read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyper_parallel.demo.gpt import GPTConfig, init_gpt_weights  # noqa: E402

STAGE, NUM_STAGES = 1, 3  # a middle stage: 2 transformer blocks, hidden in and hidden out
BATCH = 8
CONFIGS = {
    "small": GPTConfig(vocab_size=64, max_seq_len=32, d_model=64, n_heads=4, n_layers=6),
    "d_model 256": GPTConfig(vocab_size=64, max_seq_len=128, d_model=256, n_heads=4, n_layers=6),
}
WARMUP = 3
KEYS = ("forward", "full backward", "dx", "dW")


@dataclass
class Variant:
    """One backend's four steps on one stage; each call returns four durations in seconds."""

    label: str
    config: str
    run: Callable[[], tuple[float, float, float, float]]


def _stage_data(framework: str, config: GPTConfig, p):  # type: ignore[no-untyped-def]
    import importlib

    models = importlib.import_module(f"hyper_parallel.demo.gpt_{framework}")
    stage = models.GPTStage(config, STAGE, NUM_STAGES, init_gpt_weights(config, 0))
    rng = np.random.default_rng(0)
    shape = (BATCH, config.max_seq_len, config.d_model)
    x = p.from_numpy(rng.standard_normal(shape).astype(np.float32))
    dy = p.from_numpy(rng.standard_normal(shape).astype(np.float32))
    return stage, x, dy


def platform_variant(label: str, config_name: str, p) -> Variant:  # type: ignore[no-untyped-def]
    """This library's ``stage_forward`` / ``stage_backward`` / ``stage_backward_input`` / ``_weight``."""
    framework = "torch" if p.name == "torch" else "mindspore"
    clock = time.thread_time if framework == "torch" else time.perf_counter
    stage, x, dy = _stage_data(framework, CONFIGS[config_name], p)
    params = [prm for _, prm in p.named_parameters(stage)]

    def run() -> tuple[float, float, float, float]:
        t0 = clock()
        rec = p.stage_forward(stage, (x,), {}, params, (True,))
        t1 = clock()
        p.stage_backward(rec, (dy,))
        t2 = clock()
        del rec
        rec = p.stage_forward(stage, (x,), {}, params, (True,))
        t3 = clock()
        p.stage_backward_input(rec, (dy,))
        t4 = clock()
        p.stage_backward_weight(rec)
        t5 = clock()
        del rec
        p.zero_grads(params)
        return t1 - t0, t2 - t1, t4 - t3, t5 - t4

    return Variant(label, config_name, run)


def torch_pipelining_variant(config_name: str) -> Variant:
    """torch.distributed.pipelining's full backward and dx/dW split on the same stage."""
    import torch
    from torch.distributed.pipelining import _backward as pipelining

    from hyper_parallel.platform.torch import TorchPlatform

    stage, x, dy = _stage_data("torch", CONFIGS[config_name], TorchPlatform())
    params = list(stage.parameters())

    def forward():  # type: ignore[no-untyped-def]
        leaf = x.detach().requires_grad_(True)
        return leaf, stage(leaf)

    def run() -> tuple[float, float, float, float]:
        clock = time.thread_time
        t0 = clock()
        leaf, out = forward()
        t1 = clock()
        pipelining.stage_backward([out], [dy], [leaf])
        t2 = clock()
        del leaf, out
        leaf, out = forward()
        t3 = clock()
        _, groups = pipelining.stage_backward_input([out], [dy], [leaf], iter(params))
        t4 = clock()
        pipelining.stage_backward_weight(iter(params), groups)
        t5 = clock()
        del leaf, out, groups
        for prm in params:
            prm.grad = None
        return t1 - t0, t2 - t1, t4 - t3, t5 - t4

    torch.manual_seed(0)
    return Variant("torch pipelining split", config_name, run)


def measure(variants: list[Variant], repeats: int) -> dict[tuple[str, str], dict[str, float]]:
    """Median per step of ``repeats`` rounds; in each round every variant runs once, the order
    alternating between forward and reversed. Also the quartiles of the per-round ratio
    (dx + dW) / full, whose spread shows how noisy the machine was."""
    samples: dict[tuple[str, str], dict[str, list[float]]] = {
        (v.label, v.config): {k: [] for k in (*KEYS, "ratio")} for v in variants}
    for i in range(repeats + WARMUP):
        order = variants if i % 2 == 0 else variants[::-1]
        for v in order:
            gc.collect()
            times = v.run()
            if i >= WARMUP:
                got = samples[(v.label, v.config)]
                for key, value in zip(KEYS, times):
                    got[key].append(value)
                got["ratio"].append((times[2] + times[3]) / times[1])
    out = {}
    for name, steps in samples.items():
        out[name] = {k: statistics.median(steps[k]) * 1e3 for k in KEYS}
        q1, _, q3 = statistics.quantiles(steps["ratio"], n=4)
        out[name].update(q1=q1, q3=q3)
    return out


def row(label: str, config_name: str, memory: str, t: dict[str, float]) -> str:
    split = t["dx"] + t["dW"]
    return (f"| {label} | {config_name} | {memory} | {t['forward']:.2f} | {t['full backward']:.2f} | {t['dx']:.2f} "
            f"| {t['dW']:.2f} | {split / t['full backward']:.2f}x | {t['q1']:.2f}-{t['q3']:.2f} |")


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the system
    (what the caching allocators of accelerators do), so that no timing includes page faults."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameter numbers
    return libc.mallopt(m_mmap_threshold, 32 << 20) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    parser.add_argument("--skip-mindspore", action="store_true")
    args = parser.parse_args()
    import torch

    from hyper_parallel.platform.torch import TorchPlatform

    torch.set_num_threads(args.threads)
    rows = []
    for memory in ("glibc default", "kept"):  # in this order: mallopt cannot be undone
        if memory == "kept" and not keep_freed_memory():
            raise SystemExit("mallopt failed: cannot measure with freed memory kept")
        for config_name in CONFIGS:
            variants = [platform_variant("torch (hyper-parallel)", config_name, TorchPlatform()),
                        torch_pipelining_variant(config_name)]
            for (label, cfg), t in measure(variants, args.repeats).items():
                rows.append(row(label, cfg, memory, t))
                print(rows[-1], flush=True)
    if not args.skip_mindspore:
        import mindspore as ms

        from hyper_parallel.platform.mindspore import MindSporePlatform

        ms.runtime.launch_blocking()  # synchronous kernels: stable timings on a shared machine
        variants = [platform_variant(f"mindspore ({mode})", "small", MindSporePlatform(autograd=mode))
                    for mode in ("engine", "recompute")]
        for (label, cfg), t in measure(variants, args.repeats).items():
            rows.append(row(label, cfg, "kept", t))
            print(rows[-1], flush=True)
    lines = [
        f"Stage autograd cost per micro-batch: GPT stage {STAGE} of {NUM_STAGES} (2 transformer blocks, batch "
        f"{BATCH}); small = d_model {CONFIGS['small'].d_model}, seq {CONFIGS['small'].max_seq_len}; "
        f"d_model 256 = seq {CONFIGS['d_model 256'].max_seq_len}. Median of {args.repeats} rounds, milliseconds: "
        f"torch in thread CPU time with {args.threads} intra-op thread(s), MindSpore in wall time; the variants "
        "of one config ran alternately in one process. Full backward is each variant's own (torch pipelining: "
        "its `stage_backward`). (dx + dW) / full is the ratio of the medians; the last column is the spread of "
        "the same ratio taken round by round. Freed memory: torch ran first with glibc's default malloc, which "
        "hands large freed blocks back to the system so that they are faulted in again (this charges the split "
        "for the memory it holds between dx and dW, and is the main source of noise), then with freed memory "
        "kept for reuse (`mallopt`), as the caching allocators of accelerators do; MindSpore ran last.",
        "",
        "| backend | config | freed memory | forward | full backward | dx only | dW only | (dx + dW) / full "
        "| per-round ratio, quartiles |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "autograd_split_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
