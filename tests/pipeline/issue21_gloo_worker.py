"""One rank of the 2-process gloo job of test_pp_issue21_gloo.py.

Runs every case of ``CASES`` (``split_hooks_harness.Job``: a schedule with gradient hooks in its
stages and a loss function with parameters of its own) inside one process group and pickles what
this rank got into ``<out_dir>/rank<r>.pkl``.

Usage (under torchrun, HYPER_PARALLEL_PLATFORM=torch): issue21_gloo_worker.py OUT_DIR
"""

from __future__ import annotations

import sys
import traceback

import torch
from gloo_exit import run_and_leave, write_rank_result
from split_hooks_harness import HOOKS, Job, run_rank

from hyper_parallel.platform import get_platform

P = 2
CASES = {  # the zero-bubble schedules with every hook variant, and a full-backward schedule
    "zb-h1-hooks": Job("zb-h1", 4, HOOKS),
    "zbv-hooks": Job("zbv", 4, HOOKS),
    "1f1b-hooks": Job("1f1b", 3, HOOKS),
}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    p = get_platform()
    assert p.name == "torch" and p.world_size == P, (p.name, p.world_size)
    results = {}
    for name, job in CASES.items():
        try:
            results[name] = run_rank(job)
        except BaseException:
            print(f"rank {p.rank}: case {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
    p.barrier()
    write_rank_result(out_dir, p.rank, {"rank": p.rank, "world": p.world_size, "results": results})


if __name__ == "__main__":
    run_and_leave(main, sys.argv[1])
