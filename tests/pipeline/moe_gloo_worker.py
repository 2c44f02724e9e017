"""One torchrun rank (4 gloo processes, pp=2 x ep=2) of test_pp_overlap_b_f_gloo: the MoE model of
examples/moe_overlap.py trained one step by ScheduleInterleaved1F1B with overlap_b_f off, with it on
(pairs run on a CommComputeOverlap), and by a non-pipelined oracle (the same stages chained on this
rank, micro-batch after micro-batch, all-to-alls over the same ``ep`` group). Writes
``<out>/rank<r>.pkl`` with the per-micro-batch losses and the raw gradients of this rank's stages."""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys

import torch
import torch.distributed as dist
from gloo_exit import run_and_leave

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "examples", "moe_overlap.py")


def load_example():
    spec = importlib.util.spec_from_file_location("moe_overlap_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grads(modules, indices):
    return {f"stage{s}.{n}": q.grad.detach().numpy().copy()
            for m, s in zip(modules, indices, strict=True) for n, q in m.named_parameters() if q.grad is not None}


def pipelined(ex, args, overlap):
    job = ex.setup(args, overlap)
    x, y = ex.batch(job["ep"], args.tokens * args.micro_batches, args.width, 0)
    losses = job["schedule"].run(x, target=y if job["stages"][-1].is_last else None)
    indices = [st.stage_index for st in job["stages"]]
    exec_order = {r: [str(s) for s in steps] for r, steps in job["schedule"].exec_order.items()}
    return {"losses": [float(v) for v in losses], "grads": grads(job["modules"], indices), "exec_order": exec_order}


def oracle(ex, args, job_indices):
    """Every stage on this rank, chained; the all-to-alls of each ``ep`` line run the same order."""
    mesh = ex.hp.init_device_mesh("cpu", (ex.PP, ex.EP), mesh_dim_names=("pp", "ep"))
    ep = mesh.get_local_rank("ep")
    a2a = ex.AllToAll(mesh.get_torch_group("ep"), tuple(mesh["ep"].ranks), dist.get_rank())
    num = ex.PP * ex.CHUNKS
    modules = [ex.build_stage(s, ep, args.width, args.hidden, args.layers, a2a, None) for s in range(num)]
    x, y = ex.batch(ep, args.tokens * args.micro_batches, args.width, 0)
    losses = []
    for xs, ys in zip(x.chunk(args.micro_batches), y.chunk(args.micro_batches), strict=True):
        out = xs
        for module in modules:
            out = module(out)
        loss = ex.loss_fn(out, ys)
        losses.append(float(loss.detach()))
        (loss / args.micro_batches).backward()
    return {"losses": losses, "grads": grads([modules[s] for s in job_indices], job_indices)}


def main() -> None:
    out_dir = sys.argv[1]
    ex = load_example()
    args = ex.parse(["--width", "16", "--hidden", "24", "--tokens", "4", "--layers", "2", "--micro-batches",
                     sys.argv[2] if len(sys.argv) > 2 else "4"])
    torch.manual_seed(0)
    results = {"off": pipelined(ex, args, None), "on": pipelined(ex, args, ex.CommComputeOverlap())}
    pp = dist.get_rank() // ex.EP
    results["oracle"] = oracle(ex, args, [c * ex.PP + pp for c in range(ex.CHUNKS)])
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.pkl"), "wb") as f:
        pickle.dump({"rank": dist.get_rank(), "results": results}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_leave(main)
