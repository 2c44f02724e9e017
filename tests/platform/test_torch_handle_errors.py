"""A failed torch P2P wait names both ranks, even when the process group is gone by then.

The handle formats its description only when the operation fails (hundreds of P2P ops a step);
the ranks it names must be the ones known when the operation was posted: a failure is often the
moment the default process group is being torn down, and asking torch for the rank then raises.
No processes: ``torch.distributed`` is stubbed where the communicator calls it.
"""

import pytest

torch = pytest.importorskip("torch")

from hyper_parallel.platform.torch import comm  # noqa: E402


class _DeadWork:
    def wait(self, timeout=None):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:40123")

    def is_completed(self):
        return False


def _communicator(monkeypatch, rank):
    monkeypatch.setattr(comm.dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(comm.dist, "isend", lambda *a, **k: _DeadWork())
    monkeypatch.setattr(comm.dist, "irecv", lambda *a, **k: _DeadWork())
    c = comm.TorchCommunicator.__new__(comm.TorchCommunicator)
    c._gloo_like = True
    c._world = comm.Group(tuple(range(8)), native=None)  # no process group: the stubbed calls are used
    c._targets = {}
    return c


def _gone(group=None):
    raise ValueError("Default process group has not been initialized")


@pytest.mark.parametrize("op", ["isend", "irecv"])
@pytest.mark.parametrize("stream_wait", [False, True])
def test_failed_p2p_wait_names_both_ranks_after_the_group_is_gone(monkeypatch, op, stream_wait):
    c = _communicator(monkeypatch, rank=3)
    c._gloo_like = not stream_wait
    handle = getattr(c, op)(torch.zeros(2), 5)
    monkeypatch.setattr(comm.dist, "get_rank", _gone)  # torn down before the wait failed
    with pytest.raises(RuntimeError) as info:
        handle.wait(None if stream_wait else 1.0)
    assert "rank 3" in str(info.value) and "rank 5" in str(info.value)
    assert "Connection closed by peer" in str(info.value)


class _CountingWork:
    def __init__(self):
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1

    def is_completed(self):
        return False  # gloo: a send reports completion only once waited


@pytest.mark.parametrize("stream_wait, coalesced, waited", [(False, False, 0), (True, False, 1), (False, True, 1)])
def test_a_send_the_peer_answered_is_settled_without_a_host_wait_on_gloo_only(stream_wait, coalesced, waited):
    work = _CountingWork()
    handle = comm.TorchHandle(work, "send from rank 0 to rank 1", keep=torch.zeros(2), stream_wait=stream_wait)
    handle.coalesced = coalesced
    handle.settle_received()
    assert work.waits == waited
    assert handle.is_completed()
    handle.wait()  # settled: a later wait does not wait again
    assert work.waits == waited
    if not waited:
        assert handle._keep is None  # the data went out: the copy it read from is let go
