"""One rank of the 4-process gloo job of test_dtensor_gloo.py; writes its findings as JSON.

Runs every DTensor check twice — through torch's own DTensor (the default in a torch job) and
through the library's collectives (``use_torch_dtensor = False``) — plus the torch interop checks.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dtensor_checks import (  # noqa: E402
    all_pairs,
    check_distribute,
    check_errors,
    check_layouts,
    check_mixed_partials,
    check_redistribute,
    global_array,
    mesh_1d,
    mesh_2x2,
    mesh_reversed,
)
from dtensor_grad_checks import check_full_tensor_grad, check_grads  # noqa: E402

from hyper_parallel.core.device_mesh import DeviceMesh  # noqa: E402
from hyper_parallel.core.dtensor import DTensor, distribute_tensor  # noqa: E402
from hyper_parallel.core.placement_types import Replicate, Shard  # noqa: E402
from hyper_parallel.platform import get_platform  # noqa: E402


def dtensor_checks() -> list[str]:
    mesh, line = mesh_2x2(), mesh_1d(4)
    return (
        check_redistribute(mesh, all_pairs(2))
        + check_redistribute(line, all_pairs(1, ("sum", "avg", "max", "min")))
        + check_redistribute(mesh_reversed(), all_pairs(2))
        + check_grads(mesh_reversed(), all_pairs(2)[::7])
        + check_mixed_partials(mesh)
        + check_layouts(mesh)
        + check_errors(mesh)
        + check_distribute(mesh)
        + check_grads(mesh, all_pairs(2))
        + check_grads(line, all_pairs(1))
        + check_full_tensor_grad(mesh)
    )


def interop_checks() -> dict:
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

    r = dist.get_rank()
    out: dict = {}
    mesh = mesh_2x2()
    dp = mesh.get_group("dp")
    out["dp_native_is_pg"] = isinstance(dp.native, dist.ProcessGroup)
    out["torch_group_is_native"] = mesh.get_torch_group("dp") is dp.native
    out["group_cached"] = mesh.get_group("dp") is dp and mesh["dp"].get_group() is dp
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mesh.get_torch_group("dp"))
    out["dp_sum"] = t.item()
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mesh_1d(4).get_torch_group())  # a group spanning the world
    out["world_sum"] = t.item()

    tm = mesh.to_torch()
    out["torch_mesh"] = (tm.mesh.tolist(), list(tm.mesh_dim_names))
    out["torch_mesh_groups_shared"] = tm.get_group("dp") is dp.native and tm.get_group("tp") is mesh.get_torch_group("tp")
    x = torch.from_numpy(global_array(3))
    theirs = torch_distribute_tensor(x, tm, [TShard(0), TShard(1)]).to_local()
    ours = distribute_tensor(x, mesh, [Shard(0), Shard(1)]).to_local()
    out["same_pieces_as_torch"] = torch.equal(theirs, ours)

    # ours -> torch DTensor -> ours, and torch's autograd through the conversion
    leaf = ours.clone().requires_grad_()
    tdt = DTensor.from_local(leaf, mesh, [Shard(0), Shard(1)]).to_torch()
    out["to_torch"] = (isinstance(tdt, TorchDTensor), list(map(repr, tdt.placements)), list(tdt.shape),
                       torch.equal(tdt.full_tensor(), x))
    tdt.redistribute(tm, [TReplicate(), TReplicate()]).to_local().sum().backward()
    out["to_torch_grad_ones"] = leaf.grad is not None and torch.equal(leaf.grad, torch.ones_like(leaf))
    back = DTensor.from_torch(tdt)
    out["from_torch"] = (back.placements == (Shard(0), Shard(1)), back.shape == tuple(x.shape),
                         torch.equal(back.to_local(), ours), back.device_mesh == mesh)
    partial = TorchDTensor.from_local(torch.full((2, 2), float(r)), tm, [TPartial(), TReplicate()])
    out["from_torch_partial"] = DTensor.from_torch(partial).full_tensor().tolist()

    # a mesh built by torch, wrapped: same groups, and our moves run on it
    theirs_mesh = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    wrapped = DeviceMesh.from_torch(theirs_mesh)
    out["from_torch_mesh"] = (wrapped.mesh, wrapped.mesh_dim_names, wrapped.get_torch_group("b") is theirs_mesh.get_group("b"),
                              wrapped.to_torch() is theirs_mesh)
    dt = distribute_tensor(x, wrapped, [Shard(1), Replicate()])
    out["wrapped_mesh_full"] = torch.equal(dt.full_tensor(), x)

    # FSDP2 on the dp sub-mesh of our mesh: gradients are the dp-mean of every rank's dense gradient
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4, bias=False)
    ref = torch.nn.Linear(4, 4, bias=False)
    ref.load_state_dict(model.state_dict())
    fully_shard(model, mesh=mesh["dp"].to_torch())
    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    model(inputs[mesh.get_local_rank("dp")]).pow(2).sum().backward()
    for inp in inputs:
        ref(inp).pow(2).sum().backward()
    grad = model.weight.grad.full_tensor()
    out["fsdp2"] = (list(map(repr, model.weight.placements)), float((grad - ref.weight.grad / 2).abs().max()))

    # flatten: the merged group works in torch.distributed too
    flat = mesh.flatten()
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=flat.get_torch_group())
    out["flat"] = (flat.mesh_dim_names, list(flat.ranks), t.item())
    return out


def main(out_dir: str) -> None:
    p = get_platform()
    result = {"rank": p.rank, "platform": p.name, "native_available": p.native_dtensor_available()}
    calls = [0]
    native_redistribute = p.native_redistribute

    def counted(*args, **kwargs):  # counts the moves torch's DTensor made (the library's own method)
        calls[0] += 1
        return native_redistribute(*args, **kwargs)

    p.native_redistribute = counted
    result["native"] = dtensor_checks()
    result["native_calls"] = calls[0]
    p.use_torch_dtensor = False
    result["generic"] = dtensor_checks()
    result["native_calls_when_off"] = calls[0] - result["native_calls"]
    p.use_torch_dtensor = True
    result["interop"] = interop_checks()
    with open(os.path.join(out_dir, f"rank{p.rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pipeline"))
    from gloo_exit import run_and_leave  # gloo may abort a finished process at interpreter exit

    run_and_leave(main, sys.argv[1])
