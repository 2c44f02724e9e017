"""Peak memory growth of gradient accumulation over 4 runs, in a fresh process.

Usage: python grad_memory_worker.py native|ours|ours-keep -> prints the growth in bytes.
A single 64 MiB parameter (Linear(4096, 4096) in float32) dominates everything else.
"""

from __future__ import annotations

import re
import sys

import torch

RUNS, MICRO = 4, 2


def peak_bytes() -> int:
    """The peak resident size since the last ``reset_peak()`` (Linux VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_peak() -> None:
    """Start a new peak at the current resident size, so earlier transients (imports) do not hide growth."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(mode: str) -> None:
    torch.set_num_threads(1)
    model = torch.nn.Linear(4096, 4096, bias=False)
    x, target = torch.randn(8, 4096), torch.randn(8, 4096)
    with torch.no_grad():
        model(x)  # kernels and activation buffers once, before the baseline
    if mode == "native":
        reset_peak()
        base = peak_bytes()
        for _ in range(RUNS):
            for xs, ts in zip(x.chunk(MICRO), target.chunk(MICRO)):
                (torch.nn.functional.mse_loss(model(xs), ts) / MICRO).backward()
        print(peak_bytes() - base)
        return
    from hyper_parallel import PipelineStage, ScheduleGPipe
    from hyper_parallel.platform.local import LocalCluster

    def body():
        stage = PipelineStage(model, 0, 1)
        schedule = ScheduleGPipe(stage, MICRO, loss_fn=torch.nn.functional.mse_loss,
                                 keep_grads_on_error=mode == "ours-keep")
        schedule.eval(x)  # the schedule's own first-call costs, before the baseline
        reset_peak()
        base = peak_bytes()
        for _ in range(RUNS):
            schedule.run(x, target=target)
        return peak_bytes() - base

    print(LocalCluster(1).run(body)[0])


if __name__ == "__main__":
    from gloo_exit import run_and_leave  # gloo may abort a finished process at interpreter exit

    run_and_leave(main, sys.argv[1])
