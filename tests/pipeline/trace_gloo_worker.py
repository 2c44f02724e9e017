"""Traced 1F1B run on gloo: rank 0 writes the merged trace and every rank's lowered list."""

import json
import os
import sys

import torch
from mlp_harness import MatrixJob, batch, build_stages, mse

from hyper_parallel import Schedule1F1B
from hyper_parallel.core.pipeline_parallel.tools.trace import chrome_trace
from hyper_parallel.platform import get_platform
from gloo_exit import run_and_leave


def main(out_dir: str) -> None:
    p = get_platform()
    job = MatrixJob(Schedule1F1B, 1, 6)
    stages = build_stages(job, p.world_size, {s: s for s in range(p.world_size)})
    schedule = Schedule1F1B(stages[0], 6, loss_fn=mse, overlap_p2p=True)
    schedule.tracer.enabled = True
    x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
    schedule.run(x, target=y if stages[0].is_last else None)
    records = schedule.gather_trace()
    if p.rank == 0:
        order = {r: [str(s) for s in steps] for r, steps in schedule.exec_order.items()}
        with open(os.path.join(out_dir, "trace.json"), "w") as f:
            json.dump({"records": records, "order": order, "chrome": chrome_trace(records),
                       "clock_error": schedule.tracer.clock_error}, f)


if __name__ == "__main__":
    run_and_leave(main, sys.argv[1])
