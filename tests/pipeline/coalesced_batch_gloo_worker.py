"""A batched exchange on gloo with batch_isend_irecv answering as NCCL does: one request for the
whole batch (gloo itself gives one per operation; the engine underneath is real gloo, only the
shape of the answer changes). Each rank sends two tensors to the other and receives two."""

import json
import os
import sys

import torch
import torch.distributed as dist
from gloo_exit import run_and_leave


class OneRequest:
    """What NCCL's coalescing manager returns: one request that stands for every operation."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


def main(out_dir: str) -> None:
    real = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [OneRequest(real(ops))]
    from hyper_parallel.platform import get_platform
    from hyper_parallel.platform.base import P2POp

    p = get_platform()
    peer = 1 - p.rank
    sent = [torch.full((3,), 10.0 * p.rank + k) for k in range(2)]
    got = [torch.empty(3) for _ in range(2)]
    ops = [P2POp("isend", t, peer) for t in sent] + [P2POp("irecv", t, peer) for t in got]
    handles = p.batch_isend_irecv(ops)
    for h in handles:
        h.wait()
    result = {"handles": len(handles), "coalesced": [h.coalesced for h in handles],
              "completed": [h.is_completed() for h in handles], "got": [t.tolist() for t in got]}
    with open(os.path.join(out_dir, f"rank{p.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    run_and_leave(main, sys.argv[1])
