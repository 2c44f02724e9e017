"""MindSporePlatform with compiled stages: GRAPH_MODE and ``HYPER_PARALLEL_MS_COMPILE=jit``.

The regression guarded here: under ``GRAPH_MODE`` a stage's outputs were right but no parameter
ever got a gradient, and nothing said so. Every check compares with one public ``ms.grad`` /
``ms.value_and_grad`` call in PyNative over the whole batch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn, ops  # noqa: E402
from test_mindspore_autograd import ATOL, ORDERS, RTOL, Baton, Pipe, _threaded  # noqa: E402

from hyper_parallel.platform.mindspore import MindSporePlatform  # noqa: E402
from hyper_parallel.platform.mindspore import compiled  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def graph_mode() -> Iterator[None]:
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        yield
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.fixture(autouse=True)
def _pynative_after() -> Iterator[None]:
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)


def _pynative(fn: Any, *args: Any) -> Any:
    """Run the reference in PyNative: in GRAPH_MODE ``ms.grad`` compiles and cannot parse lambdas."""
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        return fn(*args)
    finally:
        ms.set_context(mode=mode)


def _dense_case(seed: int) -> tuple[Any, tuple[Any, ...], Any, Any, Any]:
    ms.set_seed(seed)
    cell = nn.SequentialCell(nn.Dense(4, 6), nn.Tanh(), nn.Dense(6, 3))
    params = tuple(cell.trainable_params())
    rng = np.random.default_rng(seed)
    x = ms.Tensor(rng.standard_normal((5, 4)).astype(np.float32))
    dy = ms.Tensor(rng.standard_normal((5, 3)).astype(np.float32))
    dx_ref, dw_ref = _pynative(lambda: ms.grad(lambda a: (cell(a) * dy).sum(), 0, params)(x))
    return cell, params, x, dy, (dx_ref, dw_ref)


def _assert_grads(plat: MindSporePlatform, params: Any, dw_ref: Any) -> None:
    for p, ref in zip(params, dw_ref):
        got = plat.get_grad(p)
        assert got is not None, f"{p.name} got no gradient"
        np.testing.assert_allclose(got.asnumpy(), ref.asnumpy(), rtol=RTOL, atol=ATOL, err_msg=p.name)


# ---------------------------------------------------------------------------- the regression
@pytest.mark.parametrize("autograd", ["engine", "recompute"])
@pytest.mark.parametrize("split", [False, True], ids=["full", "split"])
def test_graph_mode_stage_gets_exact_gradients(graph_mode: None, autograd: str, split: bool) -> None:
    plat = MindSporePlatform(autograd=autograd)
    cell, params, x, dy, (dx_ref, dw_ref) = _dense_case(1)
    rec = plat.stage_forward(cell, (x,), {}, params, (True,))
    assert rec.native.extra.get("jit") or autograd == "recompute"  # the engine saw a compiled node
    if split:
        (dx,) = plat.stage_backward_input(rec, (dy,))
        assert all(plat.get_grad(p) is None for p in params)  # dW waits for the weight step
        plat.stage_backward_weight(rec)
    else:
        (dx,) = plat.stage_backward(rec, (dy,))
    np.testing.assert_allclose(dx.asnumpy(), dx_ref.asnumpy(), rtol=RTOL, atol=ATOL)
    _assert_grads(plat, params, dw_ref)
    assert ms.get_context("mode") == ms.GRAPH_MODE  # the user's mode is back


def test_forward_that_records_nothing_raises_instead_of_losing_gradients() -> None:
    plat = MindSporePlatform(autograd="engine")
    cell, params, x, _, _ = _dense_case(2)
    with pytest.raises(RuntimeError, match="recorded nothing to differentiate"):
        plat.stage_forward(lambda a: ops.stop_gradient(cell(a)), (x,), {}, params, (True,))
    # not raised when the stage has nothing to differentiate, or an output is connected
    plat.stage_forward(lambda a: ops.stop_gradient(cell(a)), (x,), {}, (), (False,))
    plat.stage_forward(lambda a: (ops.stop_gradient(cell(a)), cell(a)), (x,), {}, params, (True,))


def test_compile_eager_in_graph_mode_runs_op_by_op(graph_mode: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compiled.COMPILE_ENV, "eager")
    plat = MindSporePlatform(autograd="engine")
    assert plat.compile_mode == "eager"
    cell, params, x, dy, (dx_ref, dw_ref) = _dense_case(3)
    rec = plat.stage_forward(cell, (x,), {}, params, (True,))
    assert not rec.native.extra.get("jit")
    (dx,) = plat.stage_backward(rec, (dy,))
    np.testing.assert_allclose(dx.asnumpy(), dx_ref.asnumpy(), rtol=RTOL, atol=ATOL)
    _assert_grads(plat, params, dw_ref)


# ---------------------------------------------------------------------------- schedule-like orders
@pytest.mark.parametrize("setting", ["graph", "jit"])
@pytest.mark.parametrize("autograd", ["engine", "recompute"])
@pytest.mark.parametrize("order", ["1f1b", "zb_interleaved"])
def test_orders_with_compiled_stages_match_whole_batch(setting: str, autograd: str, order: str) -> None:
    plat = MindSporePlatform(autograd=autograd, compile="jit" if setting == "jit" else None)
    pipe = Pipe(plat)
    if setting == "graph":
        ms.set_context(mode=ms.GRAPH_MODE)
    pipe.run(ORDERS[order])
    assert ms.get_context("mode") == (ms.GRAPH_MODE if setting == "graph" else ms.PYNATIVE_MODE)
    _pynative(pipe.check)
    for stage in (pipe.first, pipe.last):  # both stages ran as compiled graphs
        assert stage in compiled._COMPILED


def test_loss_closure_is_routed_through_the_compiled_cell(graph_mode: None) -> None:
    plat = MindSporePlatform(autograd="engine")
    cell, params, x, _, _ = _dense_case(4)
    target = ms.Tensor(np.ones((5, 3), np.float32))

    def with_loss(a: Any) -> Any:  # the shape of the pipeline runtime's last-stage function
        out = cell(a)
        return ((out - target) ** 2).mean(), out

    with_loss.__wrapped__ = cell  # type: ignore[attr-defined]
    routed, ok = compiled.route(with_loss)
    assert ok and routed is not with_loss and routed.__wrapped__ is compiled.compiled_call(cell)
    dx_ref, dw_ref = _pynative(lambda: ms.grad(lambda a: with_loss(a)[0], 0, params)(x))
    rec = plat.stage_forward(with_loss, (x,), {}, params, (True,))
    assert rec.native.extra["jit"]
    (dx,) = plat.stage_backward(rec, (ops.ones_like(rec.outputs[0]), None))
    np.testing.assert_allclose(dx.asnumpy(), dx_ref.asnumpy(), rtol=RTOL, atol=ATOL)
    _assert_grads(plat, params, dw_ref)


def test_stage_function_that_cannot_be_compiled_runs_eagerly_with_a_warning(
        graph_mode: None, caplog: pytest.LogCaptureFixture) -> None:
    plat = MindSporePlatform(autograd="engine")
    cell, params, x, dy, (dx_ref, dw_ref) = _dense_case(5)
    fn = functools.partial(cell)  # neither a Cell nor a closure naming its Cell with __wrapped__
    with caplog.at_level(logging.WARNING, logger="hyper_parallel"):
        rec = plat.stage_forward(fn, (x,), {}, params, (True,))
    assert "cannot compile the stage function" in caplog.text
    (dx,) = plat.stage_backward(rec, (dy,))
    np.testing.assert_allclose(dx.asnumpy(), dx_ref.asnumpy(), rtol=RTOL, atol=ATOL)
    _assert_grads(plat, params, dw_ref)


# ---------------------------------------------------------------------------- mode switch
def test_rank_threads_inside_stage_steps_never_see_a_half_restored_mode(graph_mode: None) -> None:
    """Rank A's turn passes in the middle of its step; B runs a whole step; the mode stays
    PyNative until the last step ends, then GRAPH_MODE is back (as LocalCluster ranks do)."""
    baton = Baton("A")
    seen: list[tuple[str, int]] = []

    def rank_a() -> None:
        baton.wait_turn("A")
        with compiled.PyNativeScope() as user_mode:
            assert user_mode == ms.GRAPH_MODE
            seen.append(("A in", ms.get_context("mode")))
            baton.pass_to("A", "B")
            seen.append(("A back", ms.get_context("mode")))
        seen.append(("A out", ms.get_context("mode")))
        baton.release("B")

    def rank_b() -> None:
        baton.wait_turn("B")
        with compiled.PyNativeScope() as user_mode:
            assert user_mode == ms.GRAPH_MODE
        seen.append(("B out", ms.get_context("mode")))
        baton.pass_to("B", "A")

    _threaded({"A": rank_a, "B": rank_b})
    assert seen == [("A in", ms.PYNATIVE_MODE), ("B out", ms.PYNATIVE_MODE), ("A back", ms.PYNATIVE_MODE),
                    ("A out", ms.GRAPH_MODE)]


def test_mode_switches_leave_no_records_behind(graph_mode: None) -> None:
    from mindspore import context as ms_context

    plat = MindSporePlatform(autograd="engine")
    cell, params, x, dy, _ = _dense_case(6)
    stack = ms_context._context()._context_switches.context_stack
    before = len(stack)
    for _ in range(3):
        plat.stage_backward(plat.stage_forward(cell, (x,), {}, params, (True,)), (dy,))
    assert len(stack) == before


def test_compile_mode_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compiled.COMPILE_ENV, raising=False)
    assert MindSporePlatform().compile_mode == "auto"
    assert MindSporePlatform(compile="JIT").compile_mode == "jit"
    monkeypatch.setenv(compiled.COMPILE_ENV, "eager")
    assert MindSporePlatform().compile_mode == "eager"
    monkeypatch.setenv(compiled.COMPILE_ENV, "graph")
    with pytest.raises(ValueError, match="HYPER_PARALLEL_MS_COMPILE: 'graph' is not a compile mode"):
        MindSporePlatform()
    with pytest.raises(ValueError, match="compile='always'"):
        MindSporePlatform(compile="always")


def test_user_jit_construct_is_left_alone_and_its_split_keeps_dw(graph_mode: None) -> None:
    class JitCell(nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Dense(4, 3)

        @ms.jit
        def construct(self, x: Any) -> Any:
            return ops.tanh(self.dense(x))

    ms.set_seed(7)
    cell = JitCell()
    params = tuple(cell.trainable_params())
    x = ms.Tensor(np.random.default_rng(7).standard_normal((2, 4)).astype(np.float32))
    assert compiled.route(cell) == (cell, True)
    dx_ref, dw_ref = _pynative(lambda: ms.grad(lambda a: cell(a).sum(), 0, params)(x))
    plat = MindSporePlatform(autograd="engine")
    rec = plat.stage_forward(cell, (x,), {}, params, (True,))
    (dx,) = plat.stage_backward_input(rec, (ops.ones_like(rec.outputs[0]),))
    plat.stage_backward_weight(rec)
    np.testing.assert_allclose(dx.asnumpy(), dx_ref.asnumpy(), rtol=RTOL, atol=ATOL)
    _assert_grads(plat, params, dw_ref)

