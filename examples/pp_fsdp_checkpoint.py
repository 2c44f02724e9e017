"""Pipeline parallelism x fully sharded data parallelism, with a checkpoint saved and resumed (PyTorch).

Four processes on a (pp=2, dp=2) mesh: two pipeline stages, each fully sharded over its two
data-parallel replicas with torch's FSDP2, trained with AdamW and gradient clipping. A checkpoint is
written after ``--save-at`` steps; ``--resume`` starts from it in new processes::

    torchrun --nproc-per-node 4 examples/pp_fsdp_checkpoint.py --steps 4 --save-at 2 --ckpt /tmp/ckpt
    torchrun --nproc-per-node 4 examples/pp_fsdp_checkpoint.py --steps 4 --resume --ckpt /tmp/ckpt

``--mode dp`` replicates the stages instead (plain data parallelism), ``--gather layer`` lets FSDP2
gather one layer at a time instead of a whole stage. Every rank prints its parameter memory: while
sharded between steps, and the peak during a step (sampled before every layer's forward and backward).
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
from torch import nn

import hyper_parallel as hp

WIDTH = 256
LAYERS = 8


class Stage(nn.Module):
    """Layers ``first .. first + count - 1`` of the model, under the whole model's names (``layers.<i>``)."""

    def __init__(self, first: int, count: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(first, first + count)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def parameter_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the parameter storages these modules hold now (a sharded parameter: its local shard)."""
    seen: dict[int, int] = {}
    for module in modules:
        for param in module.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class PeakTracker:
    """Largest parameter memory seen before any layer's forward or backward (gathered layers are plain
    tensors then, next to the shards FSDP keeps)."""

    def __init__(self, modules: list[nn.Module], at_rest: int, sharded: bool) -> None:
        self.modules, self.at_rest, self.sharded, self.peak = modules, at_rest, sharded, at_rest
        for module in modules:
            for layer in module.modules():
                if isinstance(layer, nn.Linear):
                    layer.register_forward_pre_hook(self.sample)
                    layer.register_forward_hook(self.sample_before_backward)

    def sample_before_backward(self, _layer: nn.Module, _inputs: object, output: torch.Tensor) -> None:
        # The output's gradient hook runs just before the layer's backward. (A full backward pre-hook
        # would too, but PyTorch warns about it on the first layer, whose input needs no gradient.)
        if output.requires_grad:
            output.register_hook(self.sample)

    def sample(self, *_: object) -> None:
        if not self.sharded:
            return
        gathered: dict[int, int] = {}
        for module in self.modules:
            for param in module.parameters():
                if not hasattr(param, "to_local") and param.untyped_storage().nbytes():
                    gathered[param.untyped_storage().data_ptr()] = param.untyped_storage().nbytes()
        self.peak = max(self.peak, self.at_rest + sum(gathered.values()))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--ckpt", default="/tmp/hyper_parallel_ckpt")
    parser.add_argument("--mode", choices=("fsdp", "dp"), default="fsdp")
    parser.add_argument("--gather", choices=("stage", "layer"), default="stage")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="rows per data-parallel replica and step")
    parser.add_argument("--report", default=None, help="write this rank's numbers as JSON here")
    args = parser.parse_args(argv)

    platform = hp.get_platform()
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    torch.manual_seed(0)
    whole = [Stage(0, LAYERS // 2), Stage(LAYERS // 2, LAYERS // 2)]  # every rank builds the same weights
    module = whole[pp]
    if args.mode == "fsdp":
        for layer in module.layers.values():  # shard each layer, then the stage (as with FSDP2 anywhere)
            hp.fully_shard(layer, mesh, reshard_after_forward=args.gather == "layer")
        hp.fully_shard(module, mesh, reshard_after_forward=args.gather == "layer")
    stage = hp.PipelineStage(module, pp, 2, mesh=mesh)
    schedule = hp.Schedule1F1B(stage, args.micro_batches, loss_fn=loss_fn)
    hp.data_parallel(schedule, mesh, gather=args.gather)
    optimizer = torch.optim.AdamW(schedule.parameters(), lr=1e-3)

    start = 0
    if args.resume:
        start = hp.load_checkpoint(args.ckpt, schedule, optimizer)["step"]
    at_rest = parameter_bytes([module])
    tracker = PeakTracker([module], at_rest, args.mode == "fsdp")
    losses, norms = [], []
    for step in range(start, args.steps):
        data = torch.Generator().manual_seed(1000 + step)  # the data of a step does not depend on a resume
        x = torch.randn(2 * args.batch, WIDTH, generator=data)[dp * args.batch:(dp + 1) * args.batch]
        y = torch.randn(2 * args.batch, WIDTH, generator=data)[dp * args.batch:(dp + 1) * args.batch]
        optimizer.zero_grad()
        step_losses = schedule.run(x, target=y if stage.is_last else None)
        norm = hp.clip_grad_norm_(schedule, 1.0, mesh=mesh)
        if hp.grads_are_finite(schedule, mesh=mesh):  # every rank skips the same steps
            optimizer.step()
        norms.append(norm)
        if step_losses:
            losses.append(sum(float(v) for v in step_losses) / len(step_losses))
        if step + 1 == args.save_at and not args.resume:
            hp.save_checkpoint(args.ckpt, schedule, optimizer, extra={"step": step + 1})
    optimizer_bytes = sum(
        (v.to_local() if hasattr(v, "to_local") else v).untyped_storage().nbytes()
        for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    )
    report = {"rank": platform.rank, "pp": pp, "dp": dp, "losses": losses, "norms": norms,
              "param_bytes_at_rest": at_rest, "param_bytes_peak": tracker.peak, "optimizer_bytes": optimizer_bytes}
    print(f"rank {platform.rank} (pp={pp}, dp={dp}) {args.mode}/{args.gather}: losses {[round(v, 5) for v in losses]} "
          f"params {at_rest / 2**20:.2f} MiB at rest, {tracker.peak / 2**20:.2f} MiB peak; "
          f"optimizer state {optimizer_bytes / 2**20:.2f} MiB", flush=True)
    if args.report:
        with open(f"{args.report}.rank{platform.rank}.json", "w") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        gc.collect()  # free gloo work objects left in reference cycles while the group lives
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
