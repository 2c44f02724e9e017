"""Max |pipeline - non-pipelined| of losses and gradients, per schedule, micro-batch count and backend.

Runs every schedule with m in {1, p-1, p, 2p+1} (p = 4) on torch gloo processes, torch
LocalCluster and MindSpore LocalCluster, and writes a Markdown table to
benchmarks/results/gradient_equivalence.md.

    .venv/bin/python benchmarks/gradient_equivalence.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "pipeline"))

from pp_harness import SCHEDULES, Job, batch, full_model_oracle, merged, run_job, small_config  # noqa: E402

P = 4
MICRO = (1, P - 1, P, 2 * P + 1)


def cases() -> list[Job]:
    jobs = []
    for name, (_, chunks) in SCHEDULES.items():
        for m in MICRO:
            config = small_config(n_layers=5 if chunks > 1 else 3)
            tokens, targets = batch(config, 2 * m)
            jobs.append(Job(name, m, config, tokens, targets))
    return jobs


def run_all(jobs: list[Job]) -> list[dict]:
    """Body of one rank: every job in turn."""
    return [run_job(job) for job in jobs]


def differences(framework: str, job: Job, per_rank: list[dict]) -> tuple[float, float]:
    losses, grads = merged(per_rank)
    ref_loss, ref_grads = full_model_oracle(framework, job.config, job.tokens, job.targets)
    loss_diff = abs(float(np.mean(losses[0])) - ref_loss)
    return loss_diff, max(float(np.abs(g - ref_grads[n]).max()) for n, g in grads.items())


def main() -> None:
    from hyper_parallel.platform.local import LocalCluster
    from hyper_parallel.platform.torch.launch import launch_local

    jobs = cases()
    results: dict[str, list[list[dict]]] = {
        "torch gloo (4 processes)": launch_local(run_all, P, jobs),
        "torch LocalCluster": LocalCluster(P, platform="torch").run(run_all, jobs),
        "MindSpore LocalCluster": LocalCluster(P, platform="mindspore").run(run_all, jobs),
    }
    rows = []
    for backend, per_rank in results.items():
        framework = "mindspore" if backend.startswith("MindSpore") else "torch"
        for k, job in enumerate(jobs):
            loss_diff, grad_diff = differences(framework, job, [r[k] for r in per_rank])
            rows.append(f"| {backend} | {job.schedule} | {job.micro} | {loss_diff:.2e} | {grad_diff:.2e} |")
            print(rows[-1], flush=True)
    table = "\n".join([
        f"Pipeline vs non-pipelined, float32, p={P}, small GPT (embedding, LayerNorm, attention, MLP, head), "
        "cross-entropy loss.",
        "",
        "| backend | schedule | m | max loss diff | max gradient diff |",
        "|---|---|---|---|---|",
        *rows,
    ])
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "gradient_equivalence.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
