"""One rank of the PP x DP / FSDP gloo jobs (torchrun, 4 ranks, mesh pp=2 x dp=2, torch's FSDP2).

``train OUT``: for FSDP and DP, 1F1B and interleaved: 3 Adam steps (losses, whole parameters after the
last step, collective counts of the first run from the torch profiler); then, with a tied weight (FSDP
and DP): a failed run followed by a good one (gradients), ``clip_grad_norm_`` (norm and clipped
gradients), and a non-finite gradient on one rank; ``clip_grad_norm_`` without ``mesh=`` for every norm
type with a nan and an inf on one rank (FSDP and DP); 3 AdamW steps with parameters that no replica or
only the first one uses (DP; FSDP2: only parameters no replica uses).
``save OUT CKPT``: 4 steps uninterrupted, with a checkpoint written after step 2.
``resume OUT CKPT``: load the checkpoint on the same split and run steps 3-4; then load it on pp=4 x dp=1.
Rank 0 pickles every rank's results into OUT.
"""

from __future__ import annotations

import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HYPER_PARALLEL_COMM_TIMEOUT", "90")  # a broken job fails in minutes, not hours

import torch  # noqa: E402
from dp_harness import Config, Trainer, arm_failure, clip_checks  # noqa: E402
from torch.profiler import profile  # noqa: E402

import hyper_parallel as hp  # noqa: E402

COUNTED = ("c10d::_reduce_scatter_base_", "c10d::_allgather_base_", "c10d::allreduce_")


def _counted_run(trainer: Trainer, step: int) -> tuple[list[float], dict[str, int]]:
    with profile() as prof:
        losses = trainer.run(step)
    counts = dict.fromkeys(COUNTED, 0)
    for event in prof.events():
        if event.name in counts:
            counts[event.name] += 1
    trainer.update()
    return losses, counts


def _tied_checks(mode: str, mesh) -> dict:
    p = hp.get_platform()
    trainer = Trainer(Config(mode=mode, tie=True), mesh)
    armed = arm_failure(trainer)
    failed = None
    try:
        trainer.run(0)
    except Exception as exc:  # noqa: BLE001 - the message is checked by the test
        failed = str(exc)
    armed["on"] = False
    no_grads_after_failure = all(p.get_grad(q) is None for q in trainer.params)
    losses = trainer.run(0)
    grads = trainer.full_grads()
    norm = hp.clip_grad_norm_(trainer.schedule, 0.05, mesh=mesh)
    clipped = trainer.full_grads()
    if p.rank == 3:  # one rank's gradient goes non-finite
        grads_here = [p.local_tensor(p.get_grad(q)) for q in trainer.params]
        next(g for g in grads_here if g.numel()).view(-1)[0] = float("inf")
    finite = hp.grads_are_finite(trainer.schedule, mesh=mesh)
    inf_norm = hp.clip_grad_norm_(trainer.schedule, 0.05, mesh=mesh)
    return {"failed": failed, "no_grads_after_failure": no_grads_after_failure, "losses": [losses],
            "grads": grads, "norm": norm, "clipped": clipped, "finite": finite, "inf_norm": inf_norm,
            "dp": trainer.dp_index, "pp": trainer.pp}


def train() -> dict:
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out = {}
    for mode in ("fsdp", "dp"):
        for schedule in ("1f1b", "interleaved"):
            trainer = Trainer(Config(mode=mode, schedule=schedule), mesh)
            first, counts = _counted_run(trainer, 0)
            losses = [first] + trainer.train(range(1, trainer.cfg.steps))
            out[(mode, schedule)] = {"losses": losses, "params": trainer.full_params(), "counts": counts,
                                     "dp": trainer.dp_index, "pp": trainer.pp}
    for mode in ("fsdp", "dp"):
        out[(mode, "tied")] = _tied_checks(mode, mesh)
        trainer = Trainer(Config(mode=mode), mesh)
        trainer.run(0)
        out[(mode, "clip")] = clip_checks(trainer)
    out[("dp", "unused")] = _unused("dp", True, mesh)
    out[("fsdp", "unused")] = _unused("fsdp", "never", mesh)  # FSDP2 aborts on a gradient some replicas lack
    return out


def _unused(mode: str, unused: bool | str, mesh) -> dict:
    trainer = Trainer(Config(mode=mode, extra={"unused": unused, "adamw": 0.1}), mesh)
    losses = trainer.train(range(trainer.cfg.steps))
    return {"losses": losses, "params": trainer.full_params(), "grads": sorted(trainer.full_grads()),
            "dp": trainer.dp_index, "pp": trainer.pp}


def save(ckpt: str) -> dict:
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    trainer = Trainer(Config(mode="fsdp", steps=4), mesh)
    losses = trainer.train(range(2))
    at_save = trainer.full_params()
    hp.save_checkpoint(ckpt, trainer.schedule, trainer.optimizer, extra={"step": 2})
    losses += trainer.train(range(2, 4))
    return {"losses": losses, "at_save": at_save, "params": trainer.full_params(), "dp": trainer.dp_index,
            "pp": trainer.pp}


def resume(ckpt: str) -> dict:
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    trainer = Trainer(Config(mode="fsdp", steps=4), mesh)
    extra = hp.load_checkpoint(ckpt, trainer.schedule, trainer.optimizer)
    losses = [[] for _ in range(2)] + trainer.train(range(2, 4))
    other_cfg = Config(mode="fsdp", pp=4, dp=1, micro=8, steps=4)  # the same 2-row micro-batches
    other_mesh = hp.init_device_mesh("cpu", (4, 1), mesh_dim_names=("pp", "dp"))
    other = Trainer(other_cfg, other_mesh)
    hp.load_checkpoint(ckpt, other.schedule, other.optimizer)
    resharded = other.full_params()
    other_losses = [[] for _ in range(2)] + other.train(range(2, 4))
    return {"extra": extra, "losses": losses, "params": trainer.full_params(), "dp": trainer.dp_index,
            "pp": trainer.pp, "resharded": resharded, "other_losses": other_losses, "other_pp": other.pp}


def main() -> None:
    torch.manual_seed(0)
    what, out_file = sys.argv[1], sys.argv[2]
    result = {"train": train, "save": lambda: save(sys.argv[3]), "resume": lambda: resume(sys.argv[3])}[what]()
    everyone = hp.get_platform().all_gather_object(result)
    if hp.get_platform().rank == 0:
        with open(out_file, "wb") as f:
            pickle.dump(everyone, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # a clean exit: gloo's threads may abort the process otherwise
    # Even after destroy_process_group, gloo work objects freed during interpreter finalization can
    # abort the process ("terminate called without an active exception", seen once in CI after the
    # results were written); the results are on disk, so leave without finalizing.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
