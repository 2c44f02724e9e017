"""Rank 0 'forgets' its forward sends (mode "silent") or exits (mode "exit") before the step.

The other rank must fail with an error naming the step and the peer, never hang.
"""

import json
import os
import sys

import torch
from pp_harness import batch, models, small_config

from hyper_parallel import MetaStepType, PipelineStage, Schedule1F1B
from hyper_parallel.platform import get_platform
from hyper_parallel.demo.gpt import init_gpt_weights


def main(out_dir: str, mode: str) -> None:
    p = get_platform()
    mod = models("torch")
    config = small_config()
    stage = PipelineStage(mod.GPTStage(config, p.rank, 2, init_gpt_weights(config, 0)), p.rank, 2)
    schedule = Schedule1F1B(stage, 2, loss_fn=mod.cross_entropy_loss)
    tokens, targets = (torch.from_numpy(a) for a in batch(config, 4))
    if p.rank == 0 and mode == "exit":
        return  # the process ends and closes its connections
    if p.rank == 0:
        schedule.register_custom_function(MetaStepType.FWD_SEND, lambda step, ctx: None)
    try:
        schedule.run(tokens, target=targets)
        outcome = {"error": None}
    except Exception as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    with open(os.path.join(out_dir, f"rank{p.rank}.json"), "w") as f:
        json.dump(outcome, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
