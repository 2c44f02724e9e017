"""One rank of the 4-process gloo job of test_pp_activation_gloo.py: swap and recompute policies
with uneven layer splits, each rank pickles its results into ``<out_dir>/rank<r>.pkl``.

Usage (under torchrun, HYPER_PARALLEL_PLATFORM=torch): gloo_activation_worker.py OUT_DIR
"""

from __future__ import annotations

import sys
import traceback

import torch
from activation_harness import ActJob, run_act_job
from pp_harness import batch, small_config

from hyper_parallel.platform import get_platform
from gloo_exit import run_and_leave, write_rank_result

P = 4
SWAP = {"swap": True, "swap_threshold": 2}
CASES = {  # name -> (schedule, blocks per stage, policy, options)
    "1f1b-mixed-swap": ("1f1b", (3, 0, 1, 2), "mixed", SWAP),
    "zb_h1-checkpoint-swap": ("zb_h1", (1, 2, 2, 1), "checkpoint", SWAP),
    "interleaved-selective-swap": ("interleaved", (2, 0, 1, 1, 0, 2, 1, 1), "selective", SWAP),
    # V placement over 8 stages, DualPipeV needs m >= 2p; its OVERLAP_B_F pairs join chunks of
    # different block counts (stages r and 7-r: 2 and 1, 0 and 1, 1 and 2, 1 and 0 blocks)
    "dualpipe_v-mixed-swap": ("dualpipe_v", (2, 0, 1, 1, 0, 2, 1, 1), "mixed", SWAP),
}
MICRO = 4
MICRO_OF = {"dualpipe_v-mixed-swap": 2 * P}


def job_for(name: str) -> ActJob:
    schedule, layers, policy, options = CASES[name]
    config = small_config(n_layers=sum(layers))
    micro = MICRO_OF.get(name, MICRO)
    tokens, targets = batch(config, 2 * micro)
    return ActJob(schedule, micro, config, tokens, targets, layers=layers, policy=policy, options=dict(options))


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    p = get_platform()
    assert p.name == "torch" and p.world_size == P, (p.name, p.world_size)
    results = {}
    for name in CASES:
        try:
            results[name] = run_act_job(job_for(name))
        except BaseException:
            print(f"rank {p.rank}: case {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
    p.barrier()
    write_rank_result(out_dir, p.rank, {"rank": p.rank, "results": results})


if __name__ == "__main__":
    run_and_leave(main, sys.argv[1])
