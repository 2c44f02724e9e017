"""What the other ranks see when one rank stops, on real gloo processes.

- ``silent``: rank 0 'forgets' its forward sends; ``exit``: rank 0 exits before the step. The other
  rank must fail with an error naming the step and the peer, never hang.
- ``raise`` (3 ranks): first a healthy run whose stage boundaries carry 60 tensors each, with
  ``dyn_shape`` and the batch transport (metadata far over 128 ints per message), compared with the
  same stages chained in one process; then a run in which rank 1's stage raises a ValueError in
  its forward of micro-batch 2. Rank 1 reports where it failed and its process ends, as it does
  when the error propagates (that is what closes its connections); ranks 0 and 2 must fail with
  an error naming rank 1 instead of waiting for the communication timeout.
"""

import json
import os
import sys
import time

import torch
from pp_harness import batch, models, small_config

from hyper_parallel import MetaStepType, PipelineStage, Schedule1F1B
from hyper_parallel.core.pipeline_parallel.runtime.meta import TensorMeta, encode_meta
from hyper_parallel.demo.gpt import init_gpt_weights
from hyper_parallel.platform import get_platform

MANY = 60  # tensors crossing each stage boundary


class Fan(torch.nn.Module):
    """Stage 0 fans one input out to MANY tensors; stage 1 mixes them; stage 2 sums them."""

    def __init__(self, index: int) -> None:
        super().__init__()
        torch.manual_seed(10 + index)
        self.index = index
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, *xs: torch.Tensor):
        if self.index == 0:
            base = self.lin(xs[0])
            return tuple(torch.tanh(base * (k + 1) / MANY) for k in range(MANY))
        if self.index == 1:
            return tuple(self.lin(x) + x for x in xs)
        return self.lin(sum(xs))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def many_tensors(rank: int) -> dict:
    """The healthy run: losses and this rank's gradient, and the non-pipelined reference."""
    x, target = torch.randn(4, 1, 2, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 1, 2)
    stage = PipelineStage(Fan(rank), rank, 3, dyn_shape=True)
    schedule = Schedule1F1B(stage, 2, loss_fn=mse, p2p_transport="batch")
    losses = schedule.run(x if rank == 0 else None, target=target if rank == 2 else None)
    chain = [Fan(i) for i in range(3)]
    ref_losses = []
    for i in range(2):
        out = chain[2](*chain[1](*chain[0](x[2 * i:2 * i + 2])))
        loss = mse(out, target[2 * i:2 * i + 2])
        ref_losses.append(float(loss))
        (loss / 2).backward()
    ints = len(encode_meta([TensorMeta((2, 1, 2), "float32", True)] * MANY))  # one message's metadata
    return {"losses": [float(v) for v in losses], "ref_losses": ref_losses if rank == 2 else [],
            "grad": stage.submodule.lin.weight.grad.tolist(), "ref_grad": chain[rank].lin.weight.grad.tolist(),
            "meta_ints": ints}


class FailsOnThirdForward(torch.nn.Module):
    def __init__(self, fails: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.fails, self.calls = fails, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fails and self.calls == 3:  # micro-batch 2
            raise ValueError("this stage cannot take micro-batch 2")
        return torch.tanh(self.lin(x))


def raise_mode(out_dir: str) -> None:
    p = get_platform()
    outcome = {"many": many_tensors(p.rank)}
    stage = PipelineStage(FailsOnThirdForward(p.rank == 1), p.rank, 3)
    schedule = Schedule1F1B(stage, 4, loss_fn=mse)
    x, target = torch.randn(8, 2), torch.zeros(8, 2)
    start = time.monotonic()
    try:
        schedule.run(x if p.rank == 0 else None, target=target if p.rank == 2 else None)
        outcome.update(error=None)
    except Exception as exc:
        outcome.update(error=type(exc).__name__, message=str(exc), cause=type(exc.__cause__).__name__)
    outcome["seconds"] = time.monotonic() - start
    with open(os.path.join(out_dir, f"rank{p.rank}.json"), "w") as f:
        json.dump(outcome, f)
    sys.stdout.flush()
    os._exit(0)  # rank 1: the process ends as it would with the error unhandled; the others: their group is broken


def main(out_dir: str, mode: str) -> None:
    if mode == "raise":
        raise_mode(out_dir)
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
