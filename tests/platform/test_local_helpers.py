"""Helper threads of a rank (Platform.run_helper_threads): they act for the rank, also on LocalCluster."""

import threading

import pytest

from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

TIMEOUT = 60.0


def test_helper_threads_communicate_as_their_rank():
    def body():
        p = get_platform()
        seen = {}

        def helper(name, value):
            def run():
                q = get_platform()  # the rank's platform, bound in the helper
                total = q.all_reduce(q.tensor([value + 10 * q.rank], "float32"))
                if q.rank == 0:
                    q.isend(q.tensor([value], "float32"), 1).wait()
                else:
                    buffer = q.zeros([1])
                    q.irecv(buffer, 0).wait()
                    seen[f"{name} received"] = float(q.to_numpy(buffer)[0])
                seen[name] = (q is p, threading.current_thread() is not threading.main_thread(),
                              float(q.to_numpy(total)[0]))

            return run

        # one helper at a time: the collectives of a rank's helpers must come in the same order
        p.run_helper_threads([helper("first", 1.0)])
        p.run_helper_threads([helper("second", 2.0)])
        return seen

    first, second = LocalCluster(2, "torch", timeout=TIMEOUT).run(body)
    assert first == {"first": (True, True, 12.0), "second": (True, True, 14.0)}
    assert second == {"first": (True, True, 12.0), "second": (True, True, 14.0),
                      "first received": 1.0, "second received": 2.0}


def test_two_helpers_of_a_rank_take_their_calls_in_order():
    def body():
        p = get_platform()
        order = []
        gate = threading.Event()

        def early():
            order.append(("early", float(p.to_numpy(p.all_reduce(p.tensor([1.0 + p.rank], "float32")))[0])))
            gate.set()

        def late():
            gate.wait(TIMEOUT)
            order.append(("late", float(p.to_numpy(p.all_reduce(p.tensor([5.0], "float32")))[0])))

        p.run_helper_threads([late, early])
        return order

    for order in LocalCluster(2, "torch", timeout=TIMEOUT).run(body):
        assert order == [("early", 3.0), ("late", 10.0)]


def test_other_threads_still_cannot_communicate():
    def body():
        p = get_platform()
        errors = []

        def stray():
            try:
                p.all_reduce(p.tensor([1.0], "float32"))
            except RuntimeError as exc:
                errors.append(str(exc))

        thread = threading.Thread(target=stray, name="stray")
        thread.start()
        thread.join(TIMEOUT)
        return errors

    (errors,) = LocalCluster(1, "torch", timeout=TIMEOUT).run(body)
    assert errors == ["rank 0: LocalCluster communication must run on the rank's own thread, not on 'stray'"]


def test_a_failing_communication_is_raised_in_the_helper():
    def body():
        p = get_platform()
        caught = []

        def helper():
            try:
                p.all_to_all([p.zeros([1])] * 3)
            except ValueError as exc:
                caught.append(str(exc))

        p.run_helper_threads([helper])
        return caught

    (caught,) = LocalCluster(1, "torch", timeout=TIMEOUT).run(body)
    assert caught == ["all_to_all needs one tensor per group rank (1), got 3"]


def test_helpers_share_the_callers_grad_mode_torch():
    torch = pytest.importorskip("torch")

    def body():
        p = get_platform()
        modes = []
        with torch.no_grad():
            p.run_helper_threads([lambda: modes.append(torch.is_grad_enabled())])
        p.run_helper_threads([lambda: modes.append(torch.is_grad_enabled())])
        return modes

    assert LocalCluster(1, "torch", timeout=TIMEOUT).run(body) == [[False, True]]

