"""One rank of the 4-process gloo job of test_torch_distributed.py; writes its results as JSON."""

import json
import os
import sys

import torch

from hyper_parallel.core.device_mesh import init_device_mesh
from hyper_parallel.platform import P2POp, get_platform


def main(out_dir: str) -> None:
    p = get_platform()
    r, n = p.rank, p.world_size
    right, left = (r + 1) % n, (r - 1) % n
    out = {"rank": r, "world": n, "platform": p.name}

    # plain P2P around a ring: even ranks send first, odd ranks receive first
    buf = torch.zeros(3)
    if r % 2 == 0:
        h_send = p.isend(torch.tensor([r, r * 10.0, r * 100.0]), right)
        p.irecv(buf, left).wait()
        h_send.wait()
    else:
        h_recv = p.irecv(buf, left)
        p.isend(torch.tensor([r, r * 10.0, r * 100.0]), right).wait()
        h_recv.wait()
    out["ring"] = buf.tolist()

    # a non-contiguous tensor is sent as its values (the engines need contiguous memory)
    grid = torch.arange(6.0).reshape(2, 3) + 10 * r
    got_t = torch.zeros(3, 2)
    hs = p.batch_isend_irecv([P2POp("isend", grid.t(), right), P2POp("irecv", got_t, left)])
    for h in hs:
        h.wait()
    out["transposed"] = got_t.tolist()
    h_plain = p.isend(grid.t(), right)
    p.irecv(got_t, left).wait()
    h_plain.wait()
    out["transposed_plain"] = got_t.tolist()

    # batched duplex exchange with both neighbours
    from_left, from_right = torch.zeros(2), torch.zeros(2)
    handles = p.batch_isend_irecv([
        P2POp("isend", torch.tensor([float(r), -r]), right),
        P2POp("isend", torch.tensor([r + 0.5, 1.0]), left),
        P2POp("irecv", from_left, left),
        P2POp("irecv", from_right, right),
    ])
    for h in handles:
        h.wait()
    out["batch"] = [from_left.tolist(), from_right.tolist()]

    # collectives on the world
    out["sum"] = p.all_reduce(torch.tensor([r + 1.0, 2.0 * r])).tolist()
    out["max"] = p.all_reduce(torch.tensor([float(r)]), "max").tolist()
    out["avg"] = p.all_reduce(torch.tensor([float(r)]), "avg").tolist()
    out["gather"] = [t.tolist() for t in p.all_gather(torch.tensor([r, r]))]
    out["bcast"] = p.broadcast(torch.full((2,), float(r)), src=2).tolist()
    out["rs"] = p.reduce_scatter([torch.tensor([r * 10.0 + i]) for i in range(n)]).tolist()
    out["a2a"] = [t.tolist() for t in p.all_to_all([torch.tensor([r * 10.0 + i]) for i in range(n)])]
    if r == 0:
        p.send_object({"shapes": [(2, 3)], "from": 0}, 1)
    if r == 1:
        out["obj"] = p.recv_object(0)
    out["gobj"] = p.all_gather_object(("rank", r))
    p.barrier()

    # groups from a 2x2 mesh: dp x pp
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    pp = mesh["pp"]
    out["coord"] = list(mesh.get_coordinate())
    out["pp_ranks"] = list(pp.ranks)
    out["pp_local"] = pp.get_local_rank()
    out["pp_sum"] = p.all_reduce(torch.tensor([float(r)]), group=pp.get_group()).tolist()
    out["dp_gather"] = [t.tolist() for t in p.all_gather(torch.tensor([r]), group=mesh.get_group("dp"))]
    # P2P inside the pp group, using global ranks
    peer = pp.ranks[1 - pp.get_local_rank()]
    got = torch.zeros(1)
    hs = p.batch_isend_irecv([P2POp("isend", torch.tensor([float(r)]), peer, pp.get_group()),
                              P2POp("irecv", got, peer, pp.get_group())])
    for h in hs:
        h.wait()
    out["pp_peer"] = got.tolist()
    with open(os.path.join(out_dir, f"rank{r}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pipeline"))
    from gloo_exit import run_and_leave  # gloo may abort a finished process at interpreter exit

    run_and_leave(main, sys.argv[1])
