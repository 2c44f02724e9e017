"""One rank of the checkpoint-safety gloo job (torchrun, 4 ranks, mesh pp=2 x dp=2, torch's FSDP2,
torch.distributed.checkpoint). ``python ckpt_safety_gloo_worker.py OUT BASE``; rank 0 pickles every
rank's results into OUT.

1. a checkpoint of step 2; then saves of step 3 that fail: torch.distributed.checkpoint's own write on
   rank 1 (a folder in the way of its data file), the flush on rank 2 (an ``OSError``);
2. loads of damaged copies (a truncated data file, a missing one) and into a model whose second stage
   lacks a parameter the checkpoint holds: every rank must raise, none may enter the collective read;
3. a stage with BatchNorm and dropout, fully sharded, saved at step 2 and resumed in new objects after
   the random state was disturbed, against the uninterrupted run;
4. an ``extra`` that differs per rank comes back to the rank that saved it.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HYPER_PARALLEL_COMM_TIMEOUT", "60")  # a rank stuck in a collective fails, not hangs

import torch  # noqa: E402
from dp_harness import Config, Trainer  # noqa: E402
from torch import nn  # noqa: E402

import hyper_parallel as hp  # noqa: E402
from hyper_parallel.core.checkpoint import atomic  # noqa: E402
from hyper_parallel.platform.torch import checkpoint as torch_checkpoint  # noqa: E402


def _tree(path: str) -> dict[str, bytes]:
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), path)] = fh.read()
    return out


def _attempt(call) -> dict:
    try:
        call()
    except hp.CheckpointError as exc:
        cause = exc.__cause__
        return {"error": str(exc), "cause": type(cause).__name__ if cause is not None else None}
    return {"error": None, "cause": None}


def _full(trainer: Trainer) -> dict:
    return {k: v.copy() for k, v in trainer.full_params().items()}


def failures(base: str, mesh) -> dict:
    p = hp.get_platform()
    path = os.path.join(base, "ckpt")
    trainer = Trainer(Config(mode="fsdp", steps=4), mesh)
    trainer.train(range(2))
    hp.save_checkpoint(path, trainer.schedule, trainer.optimizer, extra={"step": 2})
    before = _tree(path) if p.rank == 0 else None
    trainer.train(range(2, 3))
    out = {}

    real_save = torch_checkpoint.dcp_save

    def in_the_way(state, folder):
        if p.rank == 1:
            os.makedirs(os.path.join(folder, "__1_0.distcp"))
        real_save(state, folder)

    torch_checkpoint.dcp_save = in_the_way
    out["engine"] = _attempt(lambda: hp.save_checkpoint(path, trainer.schedule, trainer.optimizer, extra={"step": 3}))
    torch_checkpoint.dcp_save = real_save

    real_digest = atomic.file_digest

    def full_disk(file, flush=False):
        if p.rank == 2:
            raise OSError(errno.ENOSPC, "No space left on device (injected)", file)
        return real_digest(file, flush)

    atomic.file_digest = full_disk
    out["flush"] = _attempt(lambda: hp.save_checkpoint(path, trainer.schedule, trainer.optimizer, extra={"step": 3}))
    atomic.file_digest = real_digest
    p.barrier()
    if p.rank == 0:
        out["kept"] = _tree(path) == before
        out["listing"] = sorted(os.listdir(base))
        for name, damage in (("truncated", "truncate"), ("deleted", "remove")):
            shutil.copytree(path, os.path.join(base, name))
            victim = os.path.join(base, name, "__1_0.distcp")
            if damage == "truncate":
                with open(victim, "r+b") as f:
                    f.truncate(os.path.getsize(victim) - 7)
            else:
                os.remove(victim)
    p.barrier()
    for name in ("truncated", "deleted"):
        fresh = Trainer(Config(mode="fsdp", steps=4), mesh)
        fresh.train(range(1))
        params = _full(fresh)
        out[name] = _attempt(lambda fresh=fresh, name=name: hp.load_checkpoint(
            os.path.join(base, name), fresh.schedule, fresh.optimizer))
        after = _full(fresh)
        out[name]["unchanged"] = all((after[k] == params[k]).all() for k in params)
    other = Trainer(Config(mode="fsdp", steps=4), mesh)
    if other.pp == 1:  # the second stage lacks a parameter: the first stage's ranks must raise too
        del other.stages[0].submodule.gain
        other.optimizer = torch.optim.Adam(other.stages[0].submodule.parameters(), lr=other.cfg.lr)
    out["lacks"] = _attempt(lambda: hp.load_checkpoint(path, other.schedule, other.optimizer))
    out["resumed"] = hp.load_checkpoint(path, trainer.schedule, trainer.optimizer)
    return out


class _BNStage(nn.Module):
    def __init__(self, stage: int) -> None:
        super().__init__()
        torch.manual_seed(10 + stage)
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.3)
        self.scale = nn.Parameter(torch.full((6,), 1.0 + stage), requires_grad=False)

    def forward(self, x):
        return self.drop(self.bn(self.lin(x))) * self.scale


def _bn_run(path: str, mesh, phase: str) -> dict:
    p = hp.get_platform()
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    module = _BNStage(pp)
    hp.fully_shard(module, mesh)
    stage = hp.PipelineStage(module, pp, 2, mesh=mesh)
    schedule = hp.Schedule1F1B(stage, 2, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    hp.data_parallel(schedule, mesh)
    optimizer = torch.optim.Adam([q for q in module.parameters() if q.requires_grad], lr=0.05)
    if phase == "save":
        with torch.no_grad():
            module.scale.fill_(2.5 + pp)  # a frozen value only the checkpoint knows
    if phase == "load":
        torch.manual_seed(1234 + p.rank)
        assert hp.load_checkpoint(path, schedule, optimizer) == {"step": 2}
    losses = []
    for step in range(4) if phase == "save" else range(2, 4):
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=data)[dp * 8:(dp + 1) * 8], torch.randn(16, 6, generator=data)[dp * 8:]
        optimizer.zero_grad()
        losses.append([float(v) for v in schedule.run(x, target=y[:8] if stage.is_last else None)])
        optimizer.step()
        if phase == "save" and step == 1:
            hp.save_checkpoint(path, schedule, optimizer, extra={"step": 2})
    state = {}
    for k, v in module.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        state[k] = v.detach().clone()
    return {"losses": losses[-2:], "state": state}


def own_extra(base: str) -> object:
    """Each rank saves an ``extra`` of its own (its data loader's position) and must get it back."""
    rank = hp.get_platform().rank
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    path = os.path.join(base, "own_extra")
    hp.save_checkpoint(path, module, extra={"rank": rank, "position": 100 + rank})
    return hp.load_checkpoint(path, nn.Linear(3, 2))


def main() -> None:
    out_file, base = sys.argv[1], sys.argv[2]
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    result = {"failures": failures(base, mesh)}
    bn_path = os.path.join(base, "bn")
    result["bn_first"] = _bn_run(bn_path, mesh, "save")
    result["bn_second"] = _bn_run(bn_path, mesh, "load")
    result["own_extra"] = own_extra(base)
    everyone = hp.get_platform().all_gather_object(result)
    if hp.get_platform().rank == 0:
        with open(out_file, "wb") as f:
            pickle.dump(everyone, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see fsdp_gloo_worker.py: gloo objects freed at finalization may abort the process


if __name__ == "__main__":
    main()
