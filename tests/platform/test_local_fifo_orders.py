"""LocalCluster matches the receives from one peer to its sends in posting order (FIFO, as gloo,
NCCL and HCCL do), whatever order the receiving rank then waits in: posting order, reversed and
seeded random orders, for plain receives and for several receives from one peer in one batch."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hyper_parallel.platform import P2POp, get_platform
from hyper_parallel.platform.local import LocalCluster

N = 7


def _wait_order(name: str) -> list[int]:
    if name == "posting":
        return list(range(N))
    if name == "reversed":
        return list(reversed(range(N)))
    order = list(range(N))
    random.Random(int(name.split("-")[1])).shuffle(order)
    return order


def _fifo(order_name: str, batched: bool):
    p = get_platform()
    if p.rank == 0:  # N sends to rank 1, values 0..N-1, then one batch of N more, values 100..
        for k in range(N):
            p.isend(p.from_numpy(np.full(2, k, dtype=np.float32)), 1)
        ops = [P2POp("isend", p.from_numpy(np.full(2, 100 + k, dtype=np.float32)), 1) for k in range(N)]
        for h in p.batch_isend_irecv(ops):
            h.wait()
        return None
    bufs = [p.zeros((2,), "float32") for _ in range(2 * N)]
    if batched:
        handles = p.batch_isend_irecv([P2POp("irecv", b, 0) for b in bufs[:N]])
        handles += p.batch_isend_irecv([P2POp("irecv", b, 0) for b in bufs[N:]])
    else:
        handles = [p.irecv(b, 0) for b in bufs]
    order = _wait_order(order_name)
    for k in order + [N + k for k in order]:
        handles[k].wait()
    return [float(p.to_numpy(b)[0]) for b in bufs]


ORDERS = ["posting", "reversed", "random-0", "random-1", "random-2"]
EXPECTED = [float(k) for k in range(N)] + [100.0 + k for k in range(N)]


def test_the_random_orders_are_not_trivial():
    orders = {tuple(_wait_order(name)) for name in ORDERS}
    assert len(orders) == len(ORDERS)


@pytest.mark.parametrize("batched", [False, True], ids=["plain", "batch"])
@pytest.mark.parametrize("order", ORDERS)
def test_receives_from_one_peer_match_in_posting_order_whatever_the_wait_order(order, batched):
    assert LocalCluster(2).run(_fifo, order, batched)[1] == EXPECTED


def test_random_wait_order_on_mindspore():
    assert LocalCluster(2, platform="mindspore").run(_fifo, "random-1", True)[1] == EXPECTED
