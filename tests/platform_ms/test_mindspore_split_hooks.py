"""Tensor hooks inside a MindSpore stage under the engine's dx/dW split (issue 21): the split gives
the gradients of the full backward and of plain ``ms.grad`` on the same function, and each hook
fires exactly once per backward (the gradient captured at a boundary node has its hooks applied
already: the weight pass must not apply them again)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import ops  # noqa: E402

from hyper_parallel.platform.mindspore import MindSporePlatform  # noqa: E402

pytestmark = pytest.mark.timeout(120)
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def plat() -> MindSporePlatform:
    platform = MindSporePlatform(autograd="engine")
    if platform.autograd_mode != "engine":
        pytest.skip("the eager engine is not available")
    return platform


def _params(rng: np.random.Generator) -> list[Any]:
    shapes = {"w1": (4, 5), "b1": (5,), "w2": (5, 3), "b2": (3,)}
    return [ms.Parameter(ms.Tensor(rng.standard_normal(s).astype(np.float32)), name=n) for n, s in shapes.items()]


def _stage(params: list[Any], where: str, hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``h = x @ w1 + b1; y = tanh(h) @ w2 + b2`` with ``hook`` on ``h`` (the boundary output, the
    issue's case), on ``tanh(h)`` (not a boundary), on the stage output ``y`` or on ``w1 * 1``
    (the weight side: it fires in the weight pass)."""
    w1, b1, w2, b2 = params

    def fn(x: Any) -> Any:
        w = w1
        if where == "weight":
            w = w1 * 1.0
            w.register_hook(hook)
        h = ops.matmul(x, w) + b1
        if where == "boundary":
            h.register_hook(hook)
        t = ops.tanh(h)
        if where == "inner":
            t.register_hook(hook)
        y = ops.matmul(t, w2) + b2
        if where == "output":
            y.register_hook(hook)
        return y

    return fn


HOOKS = {
    "scale": lambda calls: (lambda g: (calls.append(1), g * 2)[1]),
    "observe": lambda calls: (lambda g: (calls.append(1), g)[1]),
}


@pytest.mark.parametrize("where", ["boundary", "inner", "output", "weight"])
@pytest.mark.parametrize("kind", sorted(HOOKS))
def test_split_full_and_plain_autograd_agree_and_hooks_fire_once(plat, where, kind):
    rng = np.random.default_rng(3)
    params = _params(rng)
    x = ms.Tensor(rng.standard_normal((2, 4)).astype(np.float32))
    dy = ms.Tensor(rng.standard_normal((2, 3)).astype(np.float32))
    calls: list[int] = []
    fn = _stage(params, where, HOOKS[kind](calls))

    # plain MindSpore autograd of the same function, no split
    def surrogate(xx: Any) -> Any:
        return (fn(xx) * dy).sum()

    ref_dx, ref_dw = ms.grad(surrogate, grad_position=0, weights=params)(x)
    assert len(calls) == 1
    ref = [ref_dx.asnumpy()] + [g.asnumpy() for g in ref_dw]

    results = {}
    for split in (False, True):
        for prm in params:
            prm._grad = None
        calls.clear()
        record = plat.stage_forward(fn, (x,), {}, params, [True])
        if split:
            (dx,) = plat.stage_backward_input(record, [dy])
            plat.stage_backward_weight(record)
        else:
            (dx,) = plat.stage_backward(record, [dy])
        assert len(calls) == 1, f"split={split}: the hook fired {len(calls)} times in one backward"
        results[split] = [dx.asnumpy()] + [plat.get_grad(prm).asnumpy() for prm in params]
    names = ["dx", "w1", "b1", "w2", "b2"]
    for split, got in results.items():
        for name, g, r in zip(names, got, ref):
            np.testing.assert_allclose(g, r, rtol=RTOL, atol=ATOL, err_msg=f"{name}, split={split}")


def test_a_hook_the_user_removes_after_the_split_is_gone_quietly(plat):
    """The weight pass takes the fired hooks off the boundary nodes: the user's own ``remove``
    later must still work (no error, no double removal effect)."""
    rng = np.random.default_rng(4)
    params = _params(rng)
    handles = []
    w1, b1, w2, b2 = params

    def fn(x: Any) -> Any:
        h = ops.matmul(x, w1) + b1
        handles.append(h.register_hook(lambda g: g * 2))
        return ops.matmul(ops.tanh(h), w2) + b2

    x = ms.Tensor(rng.standard_normal((2, 4)).astype(np.float32))
    record = plat.stage_forward(fn, (x,), {}, params, [True])
    plat.stage_backward_input(record, [ops.ones((2, 3), ms.float32)])
    plat.stage_backward_weight(record)
    handles[0].remove()
