"""A torch stage forward without the saved-tensor pool (``saved_pool=False``, what a pipeline of
plain forwards and full backwards runs): the same gradients, and `releasable` read from the graph
never frees what the graph saved (it may keep more than the pool's answer, never less)."""

from __future__ import annotations

import importlib
import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hyper_parallel import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster
from hyper_parallel.platform.torch import autograd as ag


class _SavesOutput(torch.autograd.Function):
    """A custom Function that saves its output with ``save_for_backward``."""

    @staticmethod
    def forward(ctx, x):
        out = torch.exp(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


class _SavesNothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


def _lin(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 4)


LIN = _lin()
W = torch.nn.Parameter(torch.randn(4))

# name -> (stage function, whether the sent output may be freed: per output, pool's answer)
CASES = {
    "linear_times_two": (lambda x: LIN(x) * 2.0, [True]),
    "relu_last": (lambda x: torch.relu(LIN(x)), [False]),
    "sigmoid_last": (lambda x: torch.sigmoid(LIN(x)), [False]),
    "tanh_last": (lambda x: torch.tanh(LIN(x)), [False]),
    "softmax_last": (lambda x: torch.softmax(LIN(x), -1), [False]),
    "inplace_relu_last": (lambda x: LIN(x).relu_(), [False]),
    "layer_norm_last": (lambda x: torch.nn.functional.layer_norm(LIN(x), (4,)), [True]),
    "residual_add": (lambda x: x + LIN(x), [True]),
    "saved_by_a_second_output": (lambda x: (lambda h: (h, h * W))(LIN(x) + 1), [False, True]),
    "two_fresh_outputs": (lambda x: (LIN(x) * 2, LIN(x) * 3), [True, True]),
    "custom_function_saves_output": (lambda x: _SavesOutput.apply(LIN(x)), [False]),
    "custom_function_saves_nothing": (lambda x: _SavesNothing.apply(LIN(x)), [True]),
    "checkpoint_scalar_mul": (lambda x: checkpoint(lambda a: LIN(a) * 2, x, use_reentrant=False), [True]),
    # the result relu saves is packed by checkpoint's hook (recomputed in backward): freeing is safe
    "checkpoint_relu": (lambda x: checkpoint(lambda a: torch.relu(LIN(a)), x, use_reentrant=False), [True]),
    "view_of_fresh": (lambda x: (LIN(x) * 2).view(-1), [True]),
}


def _run(fn, saved_pool):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    params = [*LIN.parameters(), W]
    for p in params:
        p.grad = None
    rec = ag.stage_forward(fn, (x,), {}, params, (True,), saved_pool=saved_pool)
    flags = [ag.releasable(rec, o) for o in rec.outputs]
    for o, free in zip(rec.outputs, flags):
        if free:  # what the runtime does once the output is sent
            o.data = torch.empty((0,), dtype=o.dtype)
    grads = [torch.full(tuple(s), 0.5) for s in _shapes(fn, x)]
    (dx,) = ag.stage_backward(rec, grads)
    return flags, dx, [p.grad.clone() for p in params if p.grad is not None]


def _shapes(fn, x):
    with torch.no_grad():
        out = fn(x)
    return [o.shape for o in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("name", sorted(CASES))
def test_graph_reader_frees_nothing_the_graph_saved_and_gradients_match(name):
    fn, pool_answer = CASES[name]
    pool_flags, dx_pool, g_pool = _run(fn, True)
    lean_flags, dx_lean, g_lean = _run(fn, False)
    assert pool_flags == pool_answer
    # never more permissive than the pool
    assert all(p or not lean for p, lean in zip(pool_flags, lean_flags)), (pool_flags, lean_flags)
    torch.testing.assert_close(dx_lean, dx_pool, rtol=0, atol=0)
    assert len(g_lean) == len(g_pool)
    for a, b in zip(g_lean, g_pool):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_graph_reader_frees_the_common_outputs():
    """Where the graph can be read it agrees with the pool (custom Functions: what they saved with
    ``save_for_backward``); it keeps what it cannot read (what a checkpointed region's hook packed,
    a view)."""
    expect_lean = {
        "linear_times_two": [True], "layer_norm_last": [True], "residual_add": [True],
        "saved_by_a_second_output": [False, True], "two_fresh_outputs": [True, True],
        "custom_function_saves_output": [False],
        "custom_function_saves_nothing": [True], "checkpoint_scalar_mul": [True], "checkpoint_relu": [False],
        "view_of_fresh": [False],
    }
    for name, flags in expect_lean.items():
        assert _run(CASES[name][0], False)[0] == flags, name


class _TwoOut(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.lin = _lin(seed)

    def forward(self, *xs):
        h = self.lin(sum(xs))
        return h, h * 2


class _SumLin(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.lin = _lin(seed)

    def forward(self, *xs):
        return self.lin(sum(xs))


def _pools_seen(cls, stages_per_rank, make=_lin):
    """Per stage index: whether each of its forwards in one step ran with the pool."""
    seen: dict[int, list[bool]] = {}
    original = ag.stage_forward
    lock = threading.Lock()

    def body():
        rank = get_platform().rank
        n = 2 * stages_per_rank
        idx = [rank, n - 1 - rank] if stages_per_rank == 2 else [rank]
        stages = [PipelineStage(make(i) if i < n - 1 else _SumLin(i), i, n) for i in idx]
        sched = cls(stages if len(stages) > 1 else stages[0], 4, loss_fn=lambda o, t: ((o - t) ** 2).mean())
        x = torch.randn(8, 4)
        sched.step(x if 0 in idx else None, target=torch.zeros(8, 4) if n - 1 in idx else None)

    def spy(fn, args, *rest, **kw):
        rec = original(fn, args, *rest, **kw)
        stage = getattr(fn, "__wrapped__", fn)
        with lock:
            seen.setdefault(id(stage), []).append(rec.native.pool is not None)
        return rec

    platform_module = importlib.import_module("hyper_parallel.platform.torch.platform")
    platform_module.stage_forward, saved = spy, platform_module.stage_forward
    try:
        LocalCluster(2).run(body)
    finally:
        platform_module.stage_forward = saved
    return sorted(seen.values())


def test_runtime_packs_only_where_the_pool_is_needed():
    # 1F1B, one tensor sent: only the sending stage's first forward (nothing learned yet) packs
    assert _pools_seen(Schedule1F1B, 1) == [[False] * 4, [True, False, False, False]]
    # a stage sending two tensors packs every forward (the pool tells which one the graph saved)
    assert _pools_seen(Schedule1F1B, 1, _TwoOut) == [[False] * 4, [True] * 4]
    # the dx/dW split needs the pool everywhere
    assert all(all(flags) for flags in _pools_seen(ScheduleZBVZeroBubble, 2))
