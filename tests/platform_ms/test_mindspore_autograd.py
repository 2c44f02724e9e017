"""MindSporePlatform stage autograd (engine and recompute paths) in one process.

Every schedule-like order of forwards and backwards over micro-batches must give the parameter
and input gradients of one public ``ms.grad`` call over the whole batch.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn, ops  # noqa: E402

from hyper_parallel.platform.mindspore import MindSporePlatform  # noqa: E402
from hyper_parallel.platform.mindspore import autograd as ms_autograd  # noqa: E402

MODES = ("engine", "recompute")
MICRO = 4
RTOL, ATOL = 1e-5, 1e-6
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=MODES)
def plat(request: pytest.FixtureRequest) -> MindSporePlatform:
    platform = MindSporePlatform(autograd=request.param)
    try:
        assert platform.autograd_mode == request.param
    except RuntimeError as exc:  # engine forced but unavailable in this MindSpore
        pytest.skip(str(exc))
    return platform


class First(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(6, 8)

    def construct(self, x: Any) -> Any:
        return ops.tanh(self.dense(x))


class Last(nn.Cell):
    """Sum-of-squares loss: micro-batch losses add up to the whole-batch loss."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(8, 3)

    def construct(self, h: Any, target: Any, scale: float = 1.0) -> Any:
        return ((self.dense(h) - target) ** 2).sum() * scale


def _tensor(rng: np.random.Generator, *shape: int) -> Any:
    return ms.Tensor(rng.standard_normal(shape).astype(np.float32))


class Pipe:
    """Two stages on one platform, driven by a step list such as ``[("F", 0), ("B", 0)]``."""

    def __init__(self, plat: MindSporePlatform, seed: int = 0) -> None:
        ms.set_seed(seed)
        self.plat = plat
        self.first, self.last = First(), Last()
        self.p0 = tuple(p for _, p in plat.named_parameters(self.first))
        self.p1 = tuple(p for _, p in plat.named_parameters(self.last))
        rng = np.random.default_rng(seed)
        self.xs = [_tensor(rng, 2, 6) for _ in range(MICRO)]
        self.ts = [_tensor(rng, 2, 3) for _ in range(MICRO)]
        self.recs: dict[int, Any] = {}
        self.dx: dict[int, Any] = {}
        self.losses: dict[int, float] = {}

    @property
    def params(self) -> tuple[Any, ...]:
        return self.p0 + self.p1

    def run(self, steps: Sequence[tuple[str, int]]) -> None:
        plat = self.plat
        for kind, m in steps:
            if kind == "F":
                r0 = plat.stage_forward(self.first, (self.xs[m],), {}, self.p0, (True,))
                r1 = plat.stage_forward(self.last, (r0.outputs[0], self.ts[m]), {"scale": 1.0}, self.p1,
                                        (True, False))
                self.losses[m] = float(r1.outputs[0].asnumpy())
                self.recs[m] = (r0, r1)
            elif kind in ("B", "I"):
                r0, r1 = self.recs[m]
                back = plat.stage_backward if kind == "B" else plat.stage_backward_input
                g1 = back(r1, (ops.ones_like(r1.outputs[0]),))
                assert len(g1) == 2 and g1[1] is None
                (self.dx[m],) = back(r0, (g1[0],))
            elif kind == "W":
                r0, r1 = self.recs[m]
                plat.stage_backward_weight(r1)
                plat.stage_backward_weight(r0)
            else:
                raise ValueError(kind)

    def check(self) -> None:
        x, t = ops.cat(self.xs, 0), ops.cat(self.ts, 0)
        loss, (dx, dw) = ms.value_and_grad(lambda a: self.last(self.first(a), t), 0, self.params)(x)
        np.testing.assert_allclose(sum(self.losses.values()), float(loss.asnumpy()), rtol=RTOL)
        got_dx = ops.cat([self.dx[m] for m in range(MICRO)], 0)
        np.testing.assert_allclose(got_dx.asnumpy(), dx.asnumpy(), rtol=RTOL, atol=ATOL)
        for p, ref in zip(self.params, dw):
            got = self.plat.get_grad(p)
            assert got is not None, p.name
            np.testing.assert_allclose(got.asnumpy(), ref.asnumpy(), rtol=RTOL, atol=ATOL, err_msg=p.name)


def _fwd(*ms_: int) -> list[tuple[str, int]]:
    return [("F", m) for m in ms_]


ORDERS = {
    "1f1b": [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
    "ffbb": _fwd(0, 1, 2, 3) + [("B", m) for m in range(MICRO)],
    "gpipe_lifo": _fwd(0, 1, 2, 3) + [("B", m) for m in reversed(range(MICRO))],
    "zb_interleaved": [("F", 0), ("F", 1), ("I", 0), ("F", 2), ("I", 1), ("W", 0), ("F", 3), ("I", 2),
                       ("W", 1), ("I", 3), ("W", 3), ("W", 2)],
    "mixed_full_and_split": [("F", 0), ("F", 1), ("I", 1), ("B", 0), ("F", 2), ("F", 3), ("B", 3),
                             ("W", 1), ("I", 2), ("W", 2)],
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_orders_match_whole_batch(plat: MindSporePlatform, order: str) -> None:
    pipe = Pipe(plat)
    pipe.run(ORDERS[order])
    pipe.check()


@pytest.mark.parametrize("seed", [1, 2])
def test_split_dx_all_then_dw_all_shuffled(plat: MindSporePlatform, seed: int) -> None:
    pipe = Pipe(plat, seed)
    rnd = random.Random(seed)
    inputs, weights = list(range(MICRO)), list(range(MICRO))
    rnd.shuffle(inputs)
    rnd.shuffle(weights)
    pipe.run(_fwd(*range(MICRO)) + [("I", m) for m in inputs] + [("W", m) for m in weights])
    pipe.check()


def test_gradients_accumulate_until_cleared(plat: MindSporePlatform) -> None:
    pipe = Pipe(plat)
    pipe.run(ORDERS["1f1b"])
    once = [plat.get_grad(p).asnumpy().copy() for p in pipe.params]
    pipe.run(ORDERS["ffbb"])
    for p, g in zip(pipe.params, once):
        np.testing.assert_allclose(plat.get_grad(p).asnumpy(), 2 * g, rtol=RTOL, atol=ATOL)
    plat.scale_grads(pipe.params, 0.5)
    for p, g in zip(pipe.params, once):
        np.testing.assert_allclose(plat.get_grad(p).asnumpy(), g, rtol=RTOL, atol=ATOL)
    plat.zero_grads(pipe.params)
    assert all(plat.get_grad(p) is None for p in pipe.params)


def _reference(fn: Callable[..., Any], args: Sequence[Any], params: Sequence[Any]) -> tuple[Any, Any]:
    return ms.grad(fn, grad_position=tuple(range(len(args))), weights=tuple(params))(*args)


def test_multiple_outputs_kwargs_and_non_tensor_args(plat: MindSporePlatform) -> None:
    ms.set_seed(3)
    dense = nn.Dense(4, 5)
    params = tuple(dense.trainable_params())
    rng = np.random.default_rng(3)
    x, y, mask, bias = _tensor(rng, 3, 4), _tensor(rng, 3, 5), _tensor(rng, 3, 5), _tensor(rng, 5)
    g_h, g_aux = _tensor(rng, 3, 5), _tensor(rng, 3)

    def fn(a: Any, b: Any, m: Any, power: int, *, shift: Any, label: str) -> Any:
        assert power == 2 and label == "stage"
        h = dense(a) * m + b + shift
        return h, label, (h ** power).sum(axis=1), ops.tanh(a)

    rec = plat.stage_forward(fn, (x, y, mask, 2), {"shift": bias, "label": "stage"}, params,
                             (True, True, False, False))
    assert len(rec.outputs) == 4 and rec.outputs[1] == "stage"  # a non-tensor output keeps its place
    grads = plat.stage_backward(rec, (g_h, None, g_aux, None))
    assert len(grads) == 4 and grads[2] is None and grads[3] is None

    def ref_fn(a: Any, b: Any) -> Any:
        h, _, aux, _ = fn(a, b, mask, 2, shift=bias, label="stage")
        return (h * g_h).sum() + (aux * g_aux).sum()

    (dx, dy), dw = _reference(ref_fn, (x, y), params)
    np.testing.assert_allclose(grads[0].asnumpy(), dx.asnumpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grads[1].asnumpy(), dy.asnumpy(), rtol=RTOL, atol=ATOL)
    for p, ref in zip(params, dw):
        np.testing.assert_allclose(plat.get_grad(p).asnumpy(), ref.asnumpy(), rtol=RTOL, atol=ATOL)


def test_unreached_input_and_no_output_gradient(plat: MindSporePlatform) -> None:
    ms.set_seed(4)
    dense = nn.Dense(4, 2)
    params = tuple(dense.trainable_params())
    rng = np.random.default_rng(4)
    x, unused = _tensor(rng, 3, 4), _tensor(rng, 3, 7)
    rec = plat.stage_forward(lambda a, b: (dense(a), ops.tanh(a)), (x, unused), {}, params, (True, True))
    dx, du = plat.stage_backward_input(rec, (None, ops.ones_like(rec.outputs[1])))
    np.testing.assert_allclose(dx.asnumpy(), 1 - np.tanh(x.asnumpy()) ** 2, rtol=RTOL, atol=ATOL)
    assert du.shape == (3, 7) and not du.asnumpy().any()  # unreached input: zeros
    plat.stage_backward_weight(rec)
    assert all(plat.get_grad(p) is None or not plat.get_grad(p).asnumpy().any() for p in params)

    rec = plat.stage_forward(lambda a, b: dense(a), (x, unused), {}, params, (True, False))
    dx, du = plat.stage_backward(rec, (None,))
    assert du is None and dx.shape == (3, 4) and not dx.asnumpy().any()


def test_misuse_is_reported(plat: MindSporePlatform) -> None:
    dense = nn.Dense(2, 2)
    params = tuple(dense.trainable_params())
    x = ms.Tensor(np.ones((1, 2), np.float32))
    with pytest.raises(TypeError, match="argument 1"):
        plat.stage_forward(lambda a, n: dense(a), (x, 3), {}, params, (True, True))
    with pytest.raises(ValueError, match="grad_args"):
        plat.stage_forward(dense, (x,), {}, params, (True, False))
    rec = plat.stage_forward(dense, (x,), {}, params, (True,))
    with pytest.raises(RuntimeError, match="input backward"):
        plat.stage_backward_weight(rec)
    with pytest.raises(ValueError, match="gradients for 1 outputs"):
        plat.stage_backward(rec, ())
    plat.stage_backward(rec, (ops.ones_like(rec.outputs[0]),))
    with pytest.raises(RuntimeError, match="already ran its backward"):
        plat.stage_backward(rec, (ops.ones_like(rec.outputs[0]),))
    plat.zero_grads(params)


class JitStage(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Dense(4, 4)

    @ms.jit
    def construct(self, x: Any) -> Any:
        return ops.tanh(self.dense(x))


def test_jit_cell_full_backward_and_split(plat: MindSporePlatform) -> None:
    ms.set_seed(10)
    cell = JitStage()
    params = tuple(cell.trainable_params())
    x = _tensor(np.random.default_rng(10), 2, 4)
    dx_ref, dw_ref = ms.grad(lambda a: cell(a).sum(), 0, params)(x)
    plat.zero_grads(params)
    rec = plat.stage_forward(cell, (x,), {}, params, (True,))
    (dx,) = plat.stage_backward(rec, (ops.ones_like(rec.outputs[0]),))
    np.testing.assert_allclose(dx.asnumpy(), dx_ref.asnumpy(), rtol=RTOL, atol=ATOL)
    for p, ref in zip(params, dw_ref):
        np.testing.assert_allclose(plat.get_grad(p).asnumpy(), ref.asnumpy(), rtol=RTOL, atol=ATOL)
    plat.zero_grads(params)
    rec = plat.stage_forward(cell, (x,), {}, params, (True,))
    (dx,) = plat.stage_backward_input(rec, (ops.ones_like(rec.outputs[0]),))
    assert all(plat.get_grad(p) is None for p in params)
    plat.stage_backward_weight(rec)  # the engine takes a jit Cell's dW in the input step
    np.testing.assert_allclose(dx.asnumpy(), dx_ref.asnumpy(), rtol=RTOL, atol=ATOL)
    for p, ref in zip(params, dw_ref):
        np.testing.assert_allclose(plat.get_grad(p).asnumpy(), ref.asnumpy(), rtol=RTOL, atol=ATOL)
    plat.zero_grads(params)

    def wrapped(a: Any) -> Any:  # as the pipeline wraps its last stage (loss closure)
        return (cell(a),)

    wrapped.__wrapped__ = cell
    rec = plat.stage_forward(wrapped, (x,), {}, params, (True,))
    plat.stage_backward_input(rec, (ops.ones_like(rec.outputs[0]),))
    plat.stage_backward_weight(rec)
    for p, ref in zip(params, dw_ref):
        np.testing.assert_allclose(plat.get_grad(p).asnumpy(), ref.asnumpy(), rtol=RTOL, atol=ATOL)
    plat.zero_grads(params)


# ---------------------------------------------------------------------------- threads (baton)
class Baton:
    """Exactly one thread runs at a time; ``pass_to`` hands over and waits for the turn back."""

    def __init__(self, first: str) -> None:
        self._cond = threading.Condition()
        self._holder = first

    def wait_turn(self, me: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._holder == me, timeout=30)
            assert self._holder == me, "baton never came back"

    def pass_to(self, me: str, other: str) -> None:
        with self._cond:
            self._holder = other
            self._cond.notify_all()
        self.wait_turn(me)

    def release(self, other: str) -> None:
        with self._cond:
            self._holder = other
            self._cond.notify_all()


def _threaded(targets: dict[str, Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(fn), name=name) for name, fn in targets.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise errors[0]


def test_two_threads_interleaved_with_baton(plat: MindSporePlatform) -> None:
    """Rank threads A and B record and run graphs interleaved in time, one at a time."""
    pipes = {"A": Pipe(plat, seed=5), "B": Pipe(plat, seed=6)}
    script = [("A", "F", 0), ("B", "F", 0), ("A", "F", 1), ("B", "B", 0), ("B", "F", 1), ("A", "I", 0),
              ("B", "grad", 0), ("A", "F", 2), ("B", "F", 2), ("A", "B", 1), ("B", "I", 1), ("A", "W", 0),
              ("B", "F", 3), ("A", "F", 3), ("B", "B", 2), ("A", "B", 3), ("B", "B", 3), ("A", "B", 2),
              ("B", "W", 1)]
    baton = Baton(script[0][0])
    for i, (who, _, _) in enumerate(script[:-1]):
        assert who in pipes and script[i + 1][0] in pipes

    def rank(me: str) -> Callable[[], None]:
        def run() -> None:
            pipe = pipes[me]
            for i, (who, kind, m) in enumerate(script):
                if who != me:
                    continue
                baton.wait_turn(me)
                if kind == "grad":  # unrelated public grad call: resets this thread's grad flag
                    ms.grad(lambda a: pipe.first(a).sum())(pipe.xs[0])
                else:
                    pipe.run([(kind, m)])
                nxt = script[i + 1][0] if i + 1 < len(script) else None
                if nxt is not None and nxt != me:
                    baton.release(nxt)
        return run

    _threaded({name: rank(name) for name in pipes})
    for pipe in pipes.values():
        pipe.check()


def test_baton_handed_over_inside_a_forward(plat: MindSporePlatform) -> None:
    """B runs a whole forward and backward while A's forward waits in the middle (a receive)."""
    pipes = {"A": Pipe(plat, seed=7), "B": Pipe(plat, seed=8)}
    baton = Baton("A")
    a, b = pipes["A"], pipes["B"]
    inner = a.first
    handovers = [MICRO]  # the recompute path re-runs construct at backward time: hand over once each

    class Waiting(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def construct(self, x: Any) -> Any:
            h = self.inner(x)
            if handovers[0]:
                handovers[0] -= 1
                baton.pass_to("A", "B")
            return h

    a.first = Waiting()

    def rank_a() -> None:
        baton.wait_turn("A")
        a.run(_fwd(*range(MICRO)) + [("B", m) for m in range(MICRO)])
        baton.release("done")

    def rank_b() -> None:
        for m in range(MICRO):
            baton.wait_turn("B")
            b.run([("F", m), ("B", m)])
            baton.release("A")

    _threaded({"A": rank_a, "B": rank_b})
    a.first = inner
    a.check()
    b.check()


# ---------------------------------------------------------------------------- path selection
def test_mode_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ms_autograd.AUTOGRAD_ENV, "recompute")
    assert MindSporePlatform().autograd_mode == "recompute"
    monkeypatch.setenv(ms_autograd.AUTOGRAD_ENV, "bogus")
    with pytest.raises(ValueError, match="HYPER_PARALLEL_MS_AUTOGRAD"):
        MindSporePlatform().autograd_mode  # noqa: B018
    monkeypatch.delenv(ms_autograd.AUTOGRAD_ENV)
    assert MindSporePlatform().autograd_mode in MODES
    if ms_autograd._engine_problem() is None:
        assert MindSporePlatform().autograd_mode == "engine"


# ---------------------------------------------------------------------------- other helpers
def test_tensor_helpers_and_parameters() -> None:
    plat = MindSporePlatform(autograd="recompute")
    t = plat.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert plat.dtype_name(t) == "float32" and plat.shape(t) == (2, 2) and plat.is_floating(t)
    assert plat.dtype_name(plat.tensor([1, 2])) == "int64"
    b = plat.zeros((2, 3), "bfloat16")
    assert plat.dtype_name(b) == "bfloat16" and plat.to_numpy(b).dtype == np.float32
    assert plat.dtype_name(plat.empty_like(t)) == "float32" and plat.numel(plat.ones((2, 5), "int32")) == 10
    parts = plat.chunk(plat.from_numpy(np.arange(6, dtype=np.int32)), 3)
    assert [p.asnumpy().tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="cannot split size 2 of dim 0 into 3 equal chunks"):
        plat.chunk(t, 3)
    assert plat.to_numpy(plat.cat(parts[:2])).tolist() == [0, 1, 2, 3]
    c = plat.clone(t)
    plat.copy_(c, plat.ones((2, 2)))
    assert plat.to_numpy(t)[0, 0] == 1.0 and plat.to_numpy(c).sum() == 4.0
    assert plat.storage_nbytes(t) == 16
    plat.release_storage(t)  # documented no-op on MindSpore
    assert plat.storage_nbytes(t) == 16 and plat.to_numpy(t)[1, 1] == 4.0

    ms.set_seed(9)
    cell = nn.SequentialCell(nn.Dense(2, 3), nn.Dense(3, 1))
    cell[1].bias.requires_grad = False
    names = [n for n, _ in plat.named_parameters(cell)]
    assert names == ["0.weight", "0.bias", "1.weight"]
    w = dict(plat.named_parameters(cell))["0.weight"]
    plat.assign_param(w, np.full((3, 2), 0.5, np.float32))
    assert np.all(plat.to_numpy(plat.param_data(w)) == 0.5)
    plat.set_grad(w, plat.ones((3, 2)))
    nn.SGD([w], learning_rate=0.1)((plat.get_grad(w),))
    np.testing.assert_allclose(plat.to_numpy(w), 0.4, rtol=1e-6)


def test_device_streams_events_offload_and_single_process_comm() -> None:
    plat = MindSporePlatform(autograd="recompute")
    assert plat.device_type == "cpu"
    plat.synchronize()
    stream, event = plat.new_stream(), plat.new_event()
    with plat.stream_context(stream):
        event.record()
        event.wait()
    event.synchronize()
    t = plat.tensor([1.0, 2.0])
    host = plat.to_host(t)
    back = plat.to_device(host)
    assert back.asnumpy().tolist() == [1.0, 2.0] and host.data_ptr() != t.data_ptr()

    assert (plat.rank, plat.world_size, plat.world_group.ranks) == (0, 1, (0,))
    assert plat.all_reduce(t, "max") is t and plat.all_gather(t)[0].asnumpy().tolist() == [1.0, 2.0]
    assert plat.broadcast_object({"a": 1}, 0) == {"a": 1} and plat.all_gather_object(5) == [5]
    plat.barrier()
    with pytest.raises(RuntimeError, match="LocalCluster"):
        plat.isend(t, 0)
    with pytest.raises(ValueError, match="reduce op"):
        plat.all_reduce(t, "mean")


def test_parameter_frozen_after_the_stage_was_built_gets_no_gradient(plat: MindSporePlatform) -> None:
    ms.set_seed(11)
    cell = nn.Dense(3, 2)
    params = tuple(cell.trainable_params())
    x = _tensor(np.random.default_rng(11), 4, 3)
    _, dw_ref = ms.grad(lambda a: cell(a).sum(), 0, params)(x)
    cell.bias.requires_grad = False  # frozen after the list of parameters was taken
    plat.zero_grads(params)
    rec = plat.stage_forward(cell, (x,), {}, params, (True,))
    plat.stage_backward(rec, (ops.ones_like(rec.outputs[0]),))
    np.testing.assert_allclose(plat.get_grad(cell.weight).asnumpy(), dw_ref[0].asnumpy(), rtol=RTOL, atol=ATOL)
    assert plat.get_grad(cell.bias) is None
    cell.bias.requires_grad = True
    plat.zero_grads(params)
    rec = plat.stage_forward(cell, (x,), {}, params, (True,))  # unfrozen again: both get their gradient
    plat.stage_backward(rec, (ops.ones_like(rec.outputs[0]),))
    np.testing.assert_allclose(plat.get_grad(cell.weight).asnumpy(), dw_ref[0].asnumpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(plat.get_grad(cell.bias).asnumpy(), dw_ref[1].asnumpy(), rtol=RTOL, atol=ATOL)
