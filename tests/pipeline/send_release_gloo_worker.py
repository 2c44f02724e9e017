"""1F1B on gloo ranks (plain transport): after every forward send, count this rank's sent outputs that
still hold their storage; write the peak count, the losses and the gradients for the test."""

import sys

import torch
from mlp_harness import MatrixJob, batch, build_stages, mse

from hyper_parallel import Schedule1F1B
from hyper_parallel.core.pipeline_parallel.ir import MetaStepType
from hyper_parallel.platform import get_platform
from gloo_exit import run_and_leave, write_rank_result

MICRO = 6


def main(out_dir: str) -> None:
    p = get_platform()
    job = MatrixJob(Schedule1F1B, 1, MICRO)
    stages = build_stages(job, p.world_size, {s: s for s in range(p.world_size)})
    schedule = Schedule1F1B(stages[0], MICRO, loss_fn=mse, p2p_transport="plain")
    held: list[int] = []

    def send_then_count(step, ctx):
        ctx.run_default(step)
        ctx.runtime.release_completed_sends()  # what the runtime does after every step
        held.append(sum(1 for pendings in ctx.runtime.forward_sends.values()  # micro-batches, not tensors
                        if any(p.storage_nbytes(t) for pending in pendings for t in pending.release)))

    schedule.register_custom_function(MetaStepType.FWD_SEND, send_then_count)
    x, y = (torch.from_numpy(a) for a in batch(job.size(), job.micro, False))
    losses = schedule.run(x, target=y if stages[0].is_last else None)
    grads = {f"{st.stage_index}.{n}": g.numpy().copy() for st in stages for n, g in st.named_gradients().items()}
    write_rank_result(out_dir, p.rank, {"held": held, "losses": [float(v) for v in losses], "grads": grads})


if __name__ == "__main__":
    run_and_leave(main, sys.argv[1])
