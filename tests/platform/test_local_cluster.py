"""LocalCluster on both frameworks: P2P, batched duplex exchange, collectives, objects, errors."""

from __future__ import annotations

import numpy as np
import pytest

from hyper_parallel.platform import P2POp, get_platform
from hyper_parallel.platform.local import DeadlockError, LocalCluster, RankFailedError

FRAMEWORKS = ["torch", "mindspore"]


def _arr(p, values):
    return p.from_numpy(np.asarray(values, dtype=np.float32))


def _ring_p2p():
    p = get_platform()
    r, n = p.rank, p.world_size
    right, left = (r + 1) % n, (r - 1) % n
    # plain: post the receive first, then send, then wait
    buf = p.zeros((3,), "float32")
    h = p.irecv(buf, left)
    payload = _arr(p, [r, r * 10, r * 100])
    p.isend(payload, right).wait()
    p.copy_(payload, p.zeros_like(payload))  # the send copied its data when issued
    h.wait()
    assert h.is_completed()
    # batched duplex: exchange with both neighbours in one call
    from_left, from_right = p.zeros((2,), "float32"), p.zeros((2,), "float32")
    handles = p.batch_isend_irecv(
        [
            P2POp("isend", _arr(p, [r, -r]), right),
            P2POp("isend", _arr(p, [r + 0.5, 1]), left),
            P2POp("irecv", from_left, left),
            P2POp("irecv", from_right, right),
        ]
    )
    for handle in handles:
        handle.wait()
    return p.rank, p.world_size, p.to_numpy(buf).tolist(), p.to_numpy(from_left).tolist(), p.to_numpy(from_right).tolist()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_p2p_plain_and_batched(framework):
    n = 4
    results = LocalCluster(n, platform=framework).run(_ring_p2p)
    for r, (rank, world, buf, from_left, from_right) in enumerate(results):
        left, right = (r - 1) % n, (r + 1) % n
        assert (rank, world) == (r, n)
        assert buf == [left, left * 10, left * 100]
        assert from_left == [left, -left]
        assert from_right == [right + 0.5, 1]


def _fifo_order():
    p = get_platform()
    if p.rank == 0:
        for k in range(3):
            p.isend(_arr(p, [k]), 1)
        return None
    bufs = [p.zeros((1,), "float32") for _ in range(3)]
    handles = [p.irecv(b, 0) for b in bufs]
    for h in reversed(handles):  # waiting out of order must not change the matching
        h.wait()
    return [float(p.to_numpy(b)[0]) for b in bufs]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_receives_match_sends_in_posting_order(framework):
    assert LocalCluster(2, platform=framework).run(_fifo_order)[1] == [0.0, 1.0, 2.0]


def _collectives():
    p = get_platform()
    r, n = p.rank, p.world_size
    out = {}
    t = _arr(p, [r + 1, 2 * r])
    p.all_reduce(t, "sum")
    out["sum"] = p.to_numpy(t).tolist()
    out["max"] = p.to_numpy(p.all_reduce(_arr(p, [r, -r]), "max")).tolist()
    out["avg"] = p.to_numpy(p.all_reduce(_arr(p, [r]), "avg")).tolist()
    out["gather"] = [p.to_numpy(x).tolist() for x in p.all_gather(_arr(p, [r, r]))]
    b = _arr(p, [r, r, r])
    p.broadcast(b, src=2)
    out["bcast"] = p.to_numpy(b).tolist()
    out["rs"] = p.to_numpy(p.reduce_scatter([_arr(p, [r * 10 + i]) for i in range(n)], "sum")).tolist()
    out["a2a"] = [p.to_numpy(x).tolist() for x in p.all_to_all([_arr(p, [r * 10 + i]) for i in range(n)])]
    sub = p.new_group([1, 3])
    if r in (1, 3):
        out["sub"] = p.to_numpy(p.all_reduce(_arr(p, [r]), "sum", group=sub)).tolist()
    p.barrier()
    if r == 0:
        p.send_object({"shape": (2, 3), "rank": r}, dst=1)
    if r == 1:
        out["obj"] = p.recv_object(src=0)
    out["bobj"] = p.broadcast_object({"from": r} if r == 3 else None, src=3)
    out["gobj"] = p.all_gather_object(("rank", r))
    return out


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_collectives_and_objects(framework):
    n = 4
    results = LocalCluster(n, platform=framework).run(_collectives)
    for r, out in enumerate(results):
        assert out["sum"] == [sum(range(1, n + 1)), 2 * sum(range(n))]
        assert out["max"] == [n - 1, 0]
        assert out["avg"] == [pytest.approx(sum(range(n)) / n)]
        assert out["gather"] == [[k, k] for k in range(n)]
        assert out["bcast"] == [2, 2, 2]
        assert out["rs"] == [sum(k * 10 + r for k in range(n))]
        assert out["a2a"] == [[k * 10 + r] for k in range(n)]
        assert out["bobj"] == {"from": 3}
        assert out["gobj"] == [("rank", k) for k in range(n)]
    assert results[1]["sub"] == results[3]["sub"] == [4]
    assert results[1]["obj"] == {"shape": (2, 3), "rank": 0}


def _fails_on_rank_2():
    p = get_platform()
    if p.rank == 2:
        raise KeyError("boom on purpose")
    buf = p.zeros((1,), "float32")
    p.irecv(buf, (p.rank + 1) % p.world_size).wait()  # never sent: must be stopped by the failure


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_failure_in_one_rank_stops_all_and_names_it(framework):
    with pytest.raises(RankFailedError, match="rank 2 failed: KeyError") as info:
        LocalCluster(4, platform=framework, timeout=60).run(_fails_on_rank_2)
    assert info.value.rank == 2 and isinstance(info.value.__cause__, KeyError)


def _missing_send():
    p = get_platform()
    if p.rank == 0:
        p.irecv(p.zeros((1,), "float32"), 1).wait()
    else:
        p.barrier(p.new_group([1]))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_missing_send_times_out(framework):
    with pytest.raises(RankFailedError, match="rank 0 timed out after 0.3s receiving message #0 from rank 1"):
        LocalCluster(2, platform=framework, timeout=0.3, detect_deadlock=False).run(_missing_send)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_missing_send_is_reported_as_deadlock_at_once(framework):
    with pytest.raises(RankFailedError) as info:
        LocalCluster(2, platform=framework, timeout=120).run(_missing_send)
    assert isinstance(info.value.error, DeadlockError)
    assert "rank 0: receiving message #0 from rank 1" in str(info.value.error)


def _shape_mismatch():
    p = get_platform()
    if p.rank == 0:
        p.isend(p.zeros((2, 3), "float32"), 1)
    else:
        p.irecv(p.zeros((3, 2), "float32"), 0).wait()


def test_receive_shape_mismatch_names_both_ranks():
    with pytest.raises(RankFailedError, match=r"rank 0 sent float32\[2, 3\] but rank 1 posted a receive for"):
        LocalCluster(2, platform="torch").run(_shape_mismatch)


def _collective_mismatch():
    p = get_platform()
    if p.rank == 0:
        p.barrier()
    else:
        p.all_reduce(p.zeros((1,), "float32"))


def test_mismatched_collectives_name_both_ranks():
    with pytest.raises(RankFailedError, match="rank 0 called barrier but rank 1 called all_reduce"):
        LocalCluster(2, platform="torch").run(_collective_mismatch)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        LocalCluster(0)
    with pytest.raises(ValueError, match="unknown platform 'jax'"):
        LocalCluster(2, platform="jax")
    assert LocalCluster(3).run(lambda: get_platform().rank) == [0, 1, 2]


def _helper_threads():
    import threading

    from hyper_parallel.platform import bind_thread_platform

    p = get_platform()
    seen = {}

    def unbound():
        try:
            get_platform()
        except RuntimeError as exc:
            seen["unbound"] = str(exc)

    def bound():
        bind_thread_platform(p)
        seen["bound"] = get_platform().rank
        try:
            p.all_reduce(p.zeros((1,), "float32"))
        except RuntimeError as exc:
            seen["comm"] = str(exc)

    for target in (unbound, bound):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    return seen


def test_helper_threads_get_clear_errors_instead_of_a_wrong_platform_or_a_hang():
    results = LocalCluster(2, platform="torch", timeout=30).run(_helper_threads)
    for r, seen in enumerate(results):
        assert "bind_thread_platform" in seen["unbound"]
        assert seen["bound"] == r
        assert f"rank {r}: LocalCluster communication must run on the rank's own thread" in seen["comm"]


def _poll_until_complete():
    p = get_platform()
    if p.rank == 1:
        p.isend(_arr(p, [7.0]), 0)
        return None
    buf = p.zeros((1,), "float32")
    handle = p.irecv(buf, 1)
    while not handle.is_completed():  # rank 1 must get its turn while rank 0 polls (else: a hang)
        pass
    return float(p.to_numpy(buf)[0])


@pytest.mark.timeout(120)
def test_polling_a_receive_lets_the_sender_run():
    assert LocalCluster(2, platform="torch", timeout=30).run(_poll_until_complete)[0] == 7.0


def _groups_in_rank_order():
    p = get_platform()
    group = p.new_group([1, 0] if p.rank == 0 else [0, 1])  # the same group, listed differently
    gathered = [float(p.to_numpy(t)[0]) for t in p.all_gather(_arr(p, [p.rank]), group=group)]
    return group.ranks, gathered


def test_group_ranks_are_in_global_rank_order_like_the_engines():
    assert LocalCluster(2, platform="torch").run(_groups_in_rank_order) == [((0, 1), [0.0, 1.0])] * 2


def _mismatched_all_reduce():
    p = get_platform()
    p.all_reduce(p.zeros((2 + p.rank,), "float32"))


def _broadcast_object_outside_group():
    p = get_platform()
    p.broadcast_object("x", src=1, group=p.new_group([0]))


def test_collective_argument_errors_name_ranks():
    with pytest.raises(RankFailedError, match=r"all_reduce: rank 0 brought float32\[2\] but rank 1 brought float32\[3\]"):
        LocalCluster(2, platform="torch", timeout=30).run(_mismatched_all_reduce)
    with pytest.raises(RankFailedError, match=r"broadcast source rank 1 is not in group \[0\]"):
        LocalCluster(2, platform="torch", timeout=30).run(_broadcast_object_outside_group)
