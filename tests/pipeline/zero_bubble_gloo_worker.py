"""One rank of the 4-process gloo job of test_pp_zero_bubble_gloo.py.

Runs every case of ``CASES`` (a zero-bubble schedule class, chunks, micro-batches, options) on
the tiny MLP of ``mlp_harness`` inside one process group, and pickles what this rank got
(losses, gradients, peak activations per case) into ``<out_dir>/rank<r>.pkl``.

Usage (under torchrun, HYPER_PARALLEL_PLATFORM=torch): zero_bubble_gloo_worker.py OUT_DIR
"""

from __future__ import annotations

import sys
import traceback

import torch
from mlp_harness import MatrixJob, run_matrix_job

from hyper_parallel import ScheduleDualPipeV, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
from hyper_parallel.platform import get_platform
from gloo_exit import run_and_leave, write_rank_result

P = 4
CASES = {  # name -> job; every schedule at m = its minimum, 2p and 2p+1, overlap_p2p on and off, both transports
    "zb-h1-v1-m1-batch": MatrixJob(ScheduleInterleavedZeroBubble, 1, 1, dict(p2p_transport="batch")),
    "zb-h1-v2-m1-plain-overlap": MatrixJob(ScheduleInterleavedZeroBubble, 2, 1,
                                           dict(p2p_transport="plain", overlap_p2p=True)),
    "zb-h1-v1-m9-plain": MatrixJob(ScheduleInterleavedZeroBubble, 1, 9, dict(p2p_transport="plain")),
    "zb-h1-v2-m8-batch-overlap": MatrixJob(ScheduleInterleavedZeroBubble, 2, 8,
                                           dict(p2p_transport="batch", overlap_p2p=True)),
    "zbv-m1-batch": MatrixJob(ScheduleZBVZeroBubble, 2, 1, dict(p2p_transport="batch")),
    "zbv-m8-batch-overlap": MatrixJob(ScheduleZBVZeroBubble, 2, 8, dict(p2p_transport="batch", overlap_p2p=True)),
    "zbv-m8-plain": MatrixJob(ScheduleZBVZeroBubble, 2, 8, dict(p2p_transport="plain")),
    "zbv-m9-plain-overlap-dyn": MatrixJob(ScheduleZBVZeroBubble, 2, 9, dict(p2p_transport="plain", overlap_p2p=True),
                                          dyn_shape=True),
    "dualpipev-m8-plain": MatrixJob(ScheduleDualPipeV, 2, 8, dict(p2p_transport="plain")),
    "dualpipev-m8-batch-overlap": MatrixJob(ScheduleDualPipeV, 2, 8, dict(p2p_transport="batch", overlap_p2p=True)),
    "dualpipev-m9-batch-overlap": MatrixJob(ScheduleDualPipeV, 2, 9, dict(p2p_transport="batch", overlap_p2p=True)),
    "dualpipev-m9-plain-overlap": MatrixJob(ScheduleDualPipeV, 2, 9, dict(p2p_transport="plain", overlap_p2p=True)),
    "dualpipev-m8-batch": MatrixJob(ScheduleDualPipeV, 2, 8, dict(p2p_transport="batch")),
}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    p = get_platform()
    assert p.name == "torch" and p.world_size == P, (p.name, p.world_size)
    results = {}
    for name, job in CASES.items():
        try:
            results[name] = run_matrix_job(job)
        except BaseException:
            print(f"rank {p.rank}: case {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
    p.barrier()
    write_rank_result(out_dir, p.rank, {"rank": p.rank, "world": p.world_size, "results": results})


if __name__ == "__main__":
    run_and_leave(main, sys.argv[1])
