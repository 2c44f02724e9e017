"""HookCoordinator: turn-taking of two threads at sync points (no framework involved)."""

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.core.pipeline_parallel.features.overlap import (
    HookCoordinator,
    HookRole,
    OverlapAborted,
    is_recomputing,
    recomputing,
)

COMM, COMPUTE = HookRole.COMM, HookRole.COMPUTE
TIMEOUT = 60.0


class Segments:
    """Logs the segments two sides run and checks that no two of them ever run at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.overlaps = 0
        self.log: list[str] = []

    def run(self, label: str) -> None:
        with self.lock:
            self.active += 1
            self.overlaps += self.active > 1
            self.log.append(label)
        # give the other thread every chance to run now if the coordinator let it
        for _ in range(200):
            threading.Event().wait(0)
        with self.lock:
            self.active -= 1


def run_sides(coordinator, scripts, first="b", second="f"):
    """Run each side's script -- a list of ("seg", label) / ("sync", role) / ("depart",) --
    on its own thread; return the failures per side."""
    errors = {}

    def body(name, script, segments):
        try:
            with coordinator.side(name):
                for item in script:
                    if item[0] == "seg":
                        segments.run(f"{name}:{item[1]}")
                    elif item[0] == "sync":
                        coordinator.sync(item[1])
                    else:
                        coordinator.depart()
        except BaseException as exc:  # noqa: BLE001
            errors[name] = exc
            coordinator.abort(name, exc)

    segments = Segments()
    coordinator.enable(first, second)
    threads = [threading.Thread(target=body, args=(n, s, segments)) for n, s in scripts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    coordinator.disable()
    return segments, errors


def layer_script(name, roles):
    """A segment before the first sync point and after every one of them."""
    script = [("seg", "c0")]
    for k, role in enumerate(roles, 1):
        script += [("sync", role), ("seg", f"{'m' if role is COMM else 'c'}{k}")]
    return script


def test_comm_goes_first_then_the_other_side_computes():
    # Worked out by hand: b holds the turn; at a COMM point it keeps it while f waits to
    # compute; at a COMPUTE point the turn goes to f, and so on.
    scripts = {
        "b": layer_script("b", [COMM, COMPUTE, COMM]),
        "f": layer_script("f", [COMM, COMPUTE]),
    }
    segments, errors = run_sides(HookCoordinator(TIMEOUT), scripts)
    assert not errors
    assert segments.log == ["b:c0", "b:m1", "f:c0", "f:m1", "b:c2", "b:m3", "f:c2"]
    assert segments.overlaps == 0


def test_compute_points_hand_over_and_comm_points_keep_the_turn():
    scripts = {
        "b": [("seg", "c0"), ("sync", COMPUTE), ("seg", "c1"), ("sync", COMPUTE), ("seg", "c2")],
        "f": [("seg", "c0"), ("sync", COMM), ("seg", "m1"), ("sync", COMPUTE), ("seg", "c2")],
    }
    segments, errors = run_sides(HookCoordinator(TIMEOUT), scripts)
    assert not errors
    # b hands over at COMPUTE; f keeps for its COMM, hands back at COMPUTE; b hands over
    # again; f finishes and leaves; b runs alone
    assert segments.log == ["b:c0", "f:c0", "f:m1", "b:c1", "f:c2", "b:c2"]


def test_a_side_whose_partner_left_runs_alone():
    scripts = {
        "b": [("seg", "c0")],
        "f": [("seg", "c0"), ("sync", COMPUTE), ("seg", "c1"), ("sync", COMPUTE), ("seg", "c2")],
    }
    segments, errors = run_sides(HookCoordinator(TIMEOUT), scripts)
    assert not errors
    assert segments.log == ["b:c0", "f:c0", "f:c1", "f:c2"]


def model(first, second):
    """Independent model of the rule (the turn holder runs one segment per step; at a sync
    point it keeps the turn for a COMM segment or when the other side left, else hands over)."""
    roles = {first[0]: list(first[1]), second[0]: list(second[1])}
    segment = dict.fromkeys(roles, 0)
    waiting = {second[0]}
    turn = first[0]
    log = []
    while turn is not None:
        log.append(f"{turn}:{segment[turn]}")
        segment[turn] += 1
        other = second[0] if turn == first[0] else first[0]
        if not roles[turn]:  # no sync point left: the side ends and leaves
            turn = other if other in waiting else None
            waiting.discard(other)
            continue
        role = roles[turn].pop(0)
        if role is COMPUTE and other in waiting:
            waiting = {turn}
            turn = other
    return log


roles = st.lists(st.sampled_from([COMM, COMPUTE]), max_size=8)


@settings(max_examples=40, deadline=None)
@given(b=roles, f=roles)
def test_random_role_sequences_follow_the_rule_and_never_overlap(b, f):
    scripts = {}
    for name, seq in (("b", b), ("f", f)):
        script = [("seg", "0")]
        for k, role in enumerate(seq, 1):
            script += [("sync", role), ("seg", str(k))]
        scripts[name] = script
    segments, errors = run_sides(HookCoordinator(TIMEOUT), scripts)
    assert not errors
    assert segments.overlaps == 0
    assert segments.log == model(("b", b), ("f", f))


def test_model_matches_the_hand_derived_case():
    assert model(("b", [COMM, COMPUTE, COMM]), ("f", [COMM, COMPUTE])) == [
        "b:0", "b:1", "f:0", "f:1", "b:2", "b:3", "f:2"
    ]


def test_depart_finishes_the_side_without_handing_over():
    scripts = {
        "b": [("seg", "c0"), ("sync", COMPUTE), ("seg", "c1"), ("depart",), ("sync", COMPUTE), ("seg", "c2"),
              ("sync", COMPUTE), ("seg", "c3")],
        "f": [("seg", "c0"), ("sync", COMPUTE), ("seg", "c1")],
    }
    segments, errors = run_sides(HookCoordinator(TIMEOUT), scripts)
    assert not errors
    # after departing, b's sync points do nothing: c1..c3 run in one go, then f finishes
    assert segments.log == ["b:c0", "f:c0", "b:c1", "b:c2", "b:c3", "f:c1"]


def test_disable_releases_a_waiting_side():
    waiting = threading.Event()
    release_first = threading.Event()
    events = []

    def trace(event, side, role):
        events.append((event, side))
        if event == "wait" and side == "f":
            waiting.set()

    coordinator = HookCoordinator(TIMEOUT, trace=trace)
    coordinator.enable("b", "f")
    finished = []

    def holder():
        with coordinator.side("b"):
            release_first.wait(TIMEOUT)
            finished.append("b")

    def waiter():
        with coordinator.side("f"):
            finished.append("f")

    threads = [threading.Thread(target=holder), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    assert waiting.wait(TIMEOUT)
    assert finished == []
    coordinator.disable()
    threads[1].join(TIMEOUT)
    assert finished == ["f"]  # released while b still holds the turn
    release_first.set()
    threads[0].join(TIMEOUT)
    assert finished == ["f", "b"]
    assert not coordinator.enabled
    coordinator.sync(COMM)  # outside a session: nothing happens


def test_a_failing_side_stops_the_other_at_its_next_wait():
    class Boom(Exception):
        pass

    coordinator = HookCoordinator(TIMEOUT)
    reached = []

    def failing():
        raise Boom("expert shapes differ")

    scripts = {
        "b": [("seg", "c0"), ("sync", COMPUTE), ("fail",)],
        "f": [("seg", "c0"), ("sync", COMPUTE), ("seg", "never")],
    }
    errors = {}

    def body(name, script):
        try:
            with coordinator.side(name):
                for item in script:
                    if item[0] == "seg":
                        reached.append(f"{name}:{item[1]}")
                    elif item[0] == "sync":
                        coordinator.sync(item[1])
                    else:
                        failing()
        except BaseException as exc:  # noqa: BLE001
            errors[name] = exc
            coordinator.abort(name, exc)

    coordinator.enable("b", "f")
    threads = [threading.Thread(target=body, args=item) for item in scripts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    assert reached == ["b:c0", "f:c0"]
    assert isinstance(errors["b"], Boom)
    assert isinstance(errors["f"], OverlapAborted)
    assert str(errors["f"]) == "the f side stopped: the b side failed"
    assert coordinator.failure == ("b", errors["b"])
    coordinator.disable()


def test_a_side_waits_at_most_the_timeout():
    coordinator = HookCoordinator(timeout=0.2)
    coordinator.enable("b", "f")
    hold = threading.Event()
    errors = {}

    def holder():
        with coordinator.side("b"):
            hold.wait(TIMEOUT)

    def waiter():
        try:
            with coordinator.side("f"):
                pass
        except TimeoutError as exc:
            errors["f"] = exc
            hold.set()

    threads = [threading.Thread(target=holder), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert "the f side waited 0.2s for its turn while the b side held it" in str(errors["f"])
    coordinator.disable()


@pytest.mark.parametrize("flag", ["overlap", "checkpoint_wrapper"])
def test_sync_points_do_nothing_while_recomputing(flag):
    """Inside ``overlap.recomputing()``, and inside the re-run of a ``checkpoint_wrapper`` module
    (the activation machinery's own per-thread flag, which the coordinator once ignored: a
    checkpointed MoE layer's re-run then took turns and departed its side)."""
    from hyper_parallel.platform.activations import state

    rerun = recomputing if flag == "overlap" else state.recomputing
    scripts = {
        "b": [("seg", "c0"), ("recompute", COMPUTE), ("seg", "c1"), ("sync", COMPUTE), ("seg", "c2")],
        "f": [("seg", "c0")],
    }
    coordinator = HookCoordinator(TIMEOUT)
    log = []

    def body(name, script):
        with coordinator.side(name):
            for item in script:
                if item[0] == "seg":
                    log.append(f"{name}:{item[1]}")
                elif item[0] == "sync":
                    coordinator.sync(item[1])
                else:
                    with rerun():
                        assert is_recomputing()
                        coordinator.sync(item[1])
                        coordinator.depart()
                    assert not is_recomputing()

    coordinator.enable("b", "f")
    threads = [threading.Thread(target=body, args=item) for item in scripts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    coordinator.disable()
    assert log == ["b:c0", "b:c1", "f:c0", "b:c2"]


def test_misuse_is_reported():
    coordinator = HookCoordinator(TIMEOUT)
    with pytest.raises(TypeError, match="role must be a HookRole, got 'comm'"):
        coordinator.sync("comm")
    with pytest.raises(ValueError, match="two different side names"):
        coordinator.enable("x", "x")
    with pytest.raises(ValueError, match="timeout must be positive, got 0"):
        HookCoordinator(timeout=0)
    coordinator.enable("b", "f")
    with pytest.raises(RuntimeError, match="already running"):
        coordinator.enable("b", "f")
    with pytest.raises(RuntimeError, match="side 'x' is not part of a running session"):
        with coordinator.side("x"):
            pass
    coordinator.disable()
