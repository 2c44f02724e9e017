"""LocalCluster ranks draw random numbers as separate processes would.

Each rank seeds its own state and draws with communication in between, so the compute turn
passes to the other rank in the middle of the sequence; every rank's draws must equal the
sequence drawn in the main thread with the same seed and nothing in between.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

DRAWS = 4


def _seed_of(rank: int, same_seed: bool) -> int:
    return 1000 if same_seed else 1000 + 17 * rank


def _interleaved(seed, draw, order, same_seed=False):
    """Seed, then draw ``DRAWS`` times, playing ping-pong so that the turn changes after every draw."""
    p = get_platform()
    seed(_seed_of(p.rank, same_seed))
    out = []
    for k in range(DRAWS):
        if p.rank == 1:
            p.recv_object(0)
        out.append(draw(p.rank, k))
        order.append(p.rank)
        p.send_object(k, 1 - p.rank)
        if p.rank == 0:
            p.recv_object(1)
    return out


def _turns_changed(order: list[int]) -> bool:
    """Whether the ranks' draws alternated (otherwise the test would prove nothing)."""
    return order == [0, 1] * DRAWS


def _reference(seed, draw, rank, same_seed=False):
    seed(_seed_of(rank, same_seed))
    return [draw(rank, k) for k in range(DRAWS)]


def _torch_draw(rank, k):
    # rank 1 draws more per step than rank 0, so a shared state would shift rank 0's sequence
    return torch.randn(3 + 2 * rank).clone()


def test_torch_ranks_draw_their_own_sequences():
    order: list[int] = []
    got = LocalCluster(2, platform="torch", timeout=60).run(_interleaved, torch.manual_seed, _torch_draw, order)
    assert _turns_changed(order), order
    for rank in (0, 1):
        expected = _reference(torch.manual_seed, _torch_draw, rank)
        for k in range(DRAWS):
            assert torch.equal(got[rank][k], expected[k]), (rank, k)


def _numpy_draw(rank, k):
    # one legacy gaussian draws a pair and caches the second; the next one returns the cached value
    # without moving the generator: the turn that only consumed it must still be saved
    if rank == 0:
        return np.random.randn(1)
    return np.concatenate([np.random.randn(3), np.random.rand(2)])


def test_numpy_global_state_is_per_rank():
    order: list[int] = []
    got = LocalCluster(2, platform="torch", timeout=60).run(_interleaved, np.random.seed, _numpy_draw, order)
    assert _turns_changed(order), order
    for rank in (0, 1):
        expected = _reference(np.random.seed, _numpy_draw, rank)
        for k in range(DRAWS):
            np.testing.assert_array_equal(got[rank][k], expected[k], err_msg=f"rank {rank} draw {k}")


def _numpy_gauss_parity(rank, k):
    # same seed on both ranks: after the first draws their generators are at the same words but
    # only rank 1 holds a cached gaussian, so installing rank 0's state must still replace it
    return np.random.randn(2 if rank == 0 and k == 0 else 1)


def test_numpy_ranks_with_the_same_words_but_different_cached_gaussians():
    order: list[int] = []
    got = LocalCluster(2, platform="torch", timeout=60).run(
        _interleaved, np.random.seed, _numpy_gauss_parity, order, same_seed=True)
    assert _turns_changed(order), order
    for rank in (0, 1):
        expected = _reference(np.random.seed, _numpy_gauss_parity, rank, same_seed=True)
        for k in range(DRAWS):
            np.testing.assert_array_equal(got[rank][k], expected[k], err_msg=f"rank {rank} draw {k}")


def _unseeded_draws():
    return torch.randn(4), np.random.rand(4)


def test_ranks_start_from_the_callers_state_and_leave_it_unchanged():
    torch.manual_seed(5)
    np.random.seed(6)
    got = LocalCluster(3, platform="torch", timeout=60).run(_unseeded_draws)
    after = _unseeded_draws()  # the caller continues as if the ranks had drawn nothing
    torch.manual_seed(5)
    np.random.seed(6)
    expected = _unseeded_draws()
    for t, a in [after, *got]:
        assert torch.equal(t, expected[0])
        np.testing.assert_array_equal(a, expected[1])


def _draw_and_poll():
    """Draw, exchange a tensor, poll the receive with is_completed (the turn passes inside), draw again."""
    p = get_platform()
    torch.manual_seed(1000 + 17 * p.rank)
    peer = 1 - p.rank
    out = []
    for k in range(DRAWS):
        value = torch.randn(2 + p.rank)
        buf = torch.zeros(1)
        handle = p.irecv(buf, peer, tag=k)
        p.isend(torch.full((1,), float(k)), peer, tag=k)
        while not handle.is_completed():
            pass
        out.append(torch.cat([value, torch.randn(1)]))
    return out


def test_turn_changes_inside_is_completed_keep_the_states_apart():
    got = LocalCluster(2, platform="torch", timeout=60).run(_draw_and_poll)
    for rank in (0, 1):
        torch.manual_seed(1000 + 17 * rank)
        expected = [torch.cat([torch.randn(2 + rank), torch.randn(1)]) for _ in range(DRAWS)]
        for k in range(DRAWS):
            assert torch.equal(got[rank][k], expected[k]), (rank, k)


def _ms_draw(rank, k):
    from mindspore import ops

    return ops.randn((2 + rank,)).asnumpy()


def test_mindspore_ranks_draw_their_own_sequences():
    ms = pytest.importorskip("mindspore")
    order: list[int] = []
    got = LocalCluster(2, platform="mindspore", timeout=120).run(_interleaved, ms.set_seed, _ms_draw, order)
    assert _turns_changed(order), order
    for rank in (0, 1):
        expected = _reference(ms.set_seed, _ms_draw, rank)
        for k in range(DRAWS):
            np.testing.assert_array_equal(got[rank][k], expected[k], err_msg=f"rank {rank} draw {k}")
