"""One rank of the 4-process gloo job of test_pp_equivalence_gloo.py.

Inside one process group, every schedule of ``pp_harness.SCHEDULES`` x every micro-batch count
of ``MICRO`` is run in the four P2P variants of ``VARIANTS``; each rank pickles what it got
(losses and gradients per case) into ``<out_dir>/rank<r>.pkl``.

Usage (under torchrun, HYPER_PARALLEL_PLATFORM=torch): gloo_pipeline_worker.py OUT_DIR
"""

from __future__ import annotations

import sys
import time
import traceback

import torch
from pp_harness import SCHEDULES, Job, batch, run_job, small_config

from hyper_parallel.platform import get_platform
from gloo_exit import run_and_leave, write_rank_result

P = 4
MICRO = (1, P - 1, P, 2 * P + 1)
VARIANTS = {  # name -> schedule options; "plain" is the reference variant
    "plain": dict(overlap_p2p=False, p2p_transport="plain"),
    "batch": dict(overlap_p2p=False, p2p_transport="batch"),
    "plain+overlap": dict(overlap_p2p=True, p2p_transport="plain"),
    "batch+overlap": dict(overlap_p2p=True, p2p_transport="batch"),
}


def config_for(schedule: str):
    return small_config(n_layers=5 if SCHEDULES[schedule][1] > 1 else 3)


def cases():
    """(schedule, micro, variant) in the order every rank runs them."""
    for schedule in SCHEDULES:
        for micro in MICRO:
            for variant in VARIANTS:
                yield schedule, micro, variant


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    p = get_platform()
    assert p.name == "torch" and p.world_size == P, (p.name, p.world_size)
    results, timings = {}, {}
    for schedule, micro, variant in cases():
        config = config_for(schedule)
        tokens, targets = batch(config, 2 * micro)
        start = time.perf_counter()
        try:
            out = run_job(Job(schedule, micro, config, tokens, targets, options=dict(VARIANTS[variant])))
        except BaseException:
            # Name the case: the launcher only shows the tail of the logs.
            print(f"rank {p.rank}: case schedule={schedule} micro={micro} variant={variant} failed:\n"
                  f"{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
        timings[(schedule, micro, variant)] = time.perf_counter() - start
        results[(schedule, micro, variant)] = {"losses": out["losses"], "grads": out["grads"]}
    p.barrier()
    write_rank_result(out_dir, p.rank, {"rank": p.rank, "world": p.world_size, "results": results, "timings": timings})


if __name__ == "__main__":
    run_and_leave(main, sys.argv[1])
