"""One rank of the 4-process gloo job of test_mpipe_gloo.py: every case of ``CASES`` in one
process group; each rank pickles its losses and gradients per case into ``<out_dir>/rank<r>.pkl``.

Usage (under torchrun, HYPER_PARALLEL_PLATFORM=torch): mpipe_gloo_worker.py OUT_DIR
"""

from __future__ import annotations

import sys
import traceback

import torch
from mpipe_harness import Case, run_case

from hyper_parallel.platform import get_platform
from gloo_exit import run_and_leave, write_rank_result

P = 4
CASES = [
    Case("dataload-only-owned", 1, 6, 0, inputs="owned"),
    Case("recompute-m<p", 2, 3, 2),
    Case("recompute-full-overflow", 1, 9, 2),
    Case("recompute-min-overflow-owned", 2, 6, 1, overflow_mode="min", inputs="owned"),
    Case("owner-full-overflow", 2, 7, 2, owner_backward=True),
    Case("owner-min-overflow", 1, 6, 2, owner_backward=True, overflow_mode="min", overlap_p2p=True),
    Case("frozen-full-overflow", 1, 8, 2, trainable=False),
    # m <= p (ranks past the NT = m owners own nothing) and the min-overflow modes not hit above
    Case("dataload-only-m<p", 1, 3, 0),
    Case("dataload-only-min-m=p", 2, 4, 0, overflow_mode="min"),
    Case("dataload-only-min-overflow-owned", 1, 10, 0, overflow_mode="min", inputs="owned"),
    Case("recompute-min-m<p-owned", 1, 2, 2, overflow_mode="min", inputs="owned"),
    Case("owner-m=p-prefetch", 1, 4, 2, owner_backward=True, overlap_p2p=True),
    Case("owner-min-m<p-owned", 2, 3, 1, owner_backward=True, overflow_mode="min", inputs="owned"),
    Case("frozen-m=p", 2, 4, 2, trainable=False),
    Case("frozen-min-m=1-owned", 1, 1, 2, trainable=False, overflow_mode="min", inputs="owned"),
    Case("frozen-min-overflow", 2, 9, 1, trainable=False, overflow_mode="min"),
]


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    p = get_platform()
    assert p.name == "torch" and p.world_size == P, (p.name, p.world_size)
    results = {}
    for case in CASES:
        try:
            results[case.name] = run_case(case)
        except BaseException:
            print(f"rank {p.rank}: case {case.name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
    p.barrier()
    write_rank_result(out_dir, p.rank, {"rank": p.rank, "results": results})


if __name__ == "__main__":
    run_and_leave(main, sys.argv[1])
