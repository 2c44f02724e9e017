"""Review of 5dfb28e (stage forwards without the saved-tensor pool), with what came of it.

1. A custom autograd Function that keeps a tensor on ``ctx`` (not ``save_for_backward``): no hook
   and no graph reader can see it. A stage sending several tensors now always runs with the pool,
   so whether such an output is released no longer depends on the schedule; keeping the data is
   ``free_sent_outputs=False`` (documented on ``PipelineStage`` and in docs/running.md), checked
   here on every kind of schedule against the stages chained without a pipeline.
2. Outputs whose sent storage must still be freed (a memory regression otherwise): a stage of
   several outputs whose graph holds a ``torch.utils.checkpoint`` region or a slice assignment
   (the runtime gives such stages the pool), and the output of the platform's own
   ``custom_function`` (DTensor ``redistribute`` / ``to_local(grad_placements)``), which keeps
   nothing on ``ctx`` but its backward callable, on both paths. Each case also checks that
   freeing it keeps the gradients exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hyper_parallel import PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleZBVZeroBubble
from hyper_parallel.core.pipeline_parallel.features.memory_stats import track_memory
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster
from hyper_parallel.platform.torch import autograd as ag
from hyper_parallel.platform.torch.dtensor import custom_function

MICRO = 4


class _KeepsInput(torch.autograd.Function):
    """y = a * a, keeping ``a`` on ctx as many hand-written Functions do."""

    @staticmethod
    def forward(ctx, a):
        ctx.a = a
        return a * a

    @staticmethod
    def backward(ctx, grad):
        return 2 * ctx.a * grad


class _Block(torch.nn.Module):
    """Sums its inputs, one linear; all but the last stage return (h, _KeepsInput(h))."""

    def __init__(self, index: int, num: int) -> None:
        super().__init__()
        torch.manual_seed(100 + index)
        self.lin = torch.nn.Linear(4, 4)
        self.last = index == num - 1

    def forward(self, *xs):
        h = self.lin(sum(xs)) + 1
        return h if self.last else (h, _KeepsInput.apply(h))


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _data():
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(4))
    return x, y


def _oracle(num: int) -> dict[str, np.ndarray]:
    x, y = _data()
    blocks = [_Block(s, num) for s in range(num)]
    out = (x,)
    for b in blocks:
        res = b(*out)
        out = res if isinstance(res, tuple) else (res,)
    per = x.shape[0] // MICRO
    loss = sum(_mse(out[0][per * i:per * (i + 1)], y[per * i:per * (i + 1)]) for i in range(MICRO)) / MICRO
    loss.backward()
    return {f"{s}.{k}": p.grad.numpy() for s, b in enumerate(blocks) for k, p in b.named_parameters()}


@pytest.mark.parametrize("cls, chunks, tracked", [
    (Schedule1F1B, 1, False),
    (Schedule1F1B, 1, True),  # memory tracking switches the pool on
    (ScheduleZBVZeroBubble, 2, False),
    (ScheduleDualPipeV, 2, False),
])
def test_an_output_a_custom_function_keeps_on_ctx_trains_with_free_sent_outputs_off(cls, chunks, tracked):
    x, y = _data()

    def body():
        p = get_platform()
        placement = cls.stage_placement(p.world_size, chunks)
        num = len(placement)
        mine = [s for s in range(num) if placement[s] == p.rank]
        stages = [PipelineStage(_Block(s, num), s, num, free_sent_outputs=False) for s in mine]
        sched = cls(stages if chunks > 1 else stages[0], MICRO, loss_fn=_mse)
        if tracked:
            track_memory(sched)
        sched.step(x if 0 in mine else None, target=y if num - 1 in mine else None)
        return {f"{st.stage_index}.{k}": prm.grad.numpy().copy()
                for st in stages for k, prm in st.submodule.named_parameters()}

    results = LocalCluster(2, timeout=60).run(body)
    got = {k: v for r in results for k, v in r.items()}
    expected = _oracle(len(got) // 2)
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------- outputs no longer freed

_BLOCK = None


def _block() -> torch.nn.Module:
    global _BLOCK
    if _BLOCK is None:
        torch.manual_seed(0)
        _BLOCK = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    return _BLOCK


def _slice_zeroed(t: torch.Tensor) -> torch.Tensor:
    t[..., :2] = 0  # an in-place slice assignment (a CopySlices node)
    return t


FREE_SAFELY = {
    # (hidden, aux): an activation-checkpointed block and a small second output, as MoE stages return
    "checkpoint_two_outputs": lambda x: (lambda h: (h * 2, (h ** 2).mean().reshape(1)))(
        checkpoint(_block(), x, use_reentrant=False)),
    "slice_assign_two_outputs": lambda x: (lambda h: (h * 2, h.sum(-1)))(_slice_zeroed(_block()(x) + 0)),
    # the platform's own Function (DTensor redistribute, to_local with grad_placements)
    "platform_custom_function": lambda x: custom_function(lambda a: a * 2, lambda g: g * 2, _block()(x) + 1),
}


def _forward_backward(fn, saved_pool: bool, release: bool):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    params = list(_block().parameters())
    for p in params:
        p.grad = None
    rec = ag.stage_forward(fn, (x,), {}, params, (True,), saved_pool=saved_pool)
    flags = [ag.releasable(rec, o) for o in rec.outputs]
    grads = [torch.full(tuple(o.shape), 0.25) for o in rec.outputs]
    if release:
        for o in rec.outputs:  # drop every output's data: the backward must not need it
            o.data = torch.empty((0,), dtype=o.dtype)
    (dx,) = ag.stage_backward(rec, grads)
    return flags, [dx, *(p.grad.clone() for p in params)]


@pytest.mark.parametrize("name, saved_pool", [
    *((name, True) for name in sorted(FREE_SAFELY)),
    ("platform_custom_function", False),  # one output: the runtime runs it without the pool
], ids=lambda v: v if isinstance(v, str) else ("pool" if v else "lean"))
def test_a_sent_output_the_backward_does_not_need_is_freed(name, saved_pool):
    fn = FREE_SAFELY[name]
    _, kept = _forward_backward(fn, saved_pool, release=False)
    _, freed = _forward_backward(fn, saved_pool, release=True)
    for a, b in zip(freed, kept, strict=True):  # freeing every output is safe here
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    flags, _ = _forward_backward(fn, saved_pool, release=False)
    assert flags[0], f"{name}: the first (large) output is kept after it was sent"


class _CheckpointedTwoOutputs(torch.nn.Module):
    """A first stage returning (hidden, aux) with its block under torch.utils.checkpoint; a
    forward hook keeps each output so the test can see whether it was freed once sent."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
        self.kept: list[torch.Tensor] = []
        self.register_forward_hook(lambda mod, inp, out: self.kept.append(out[0]))

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=False)
        return h * 2, (h ** 2).mean().reshape(1)


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, h, aux):
        return self.lin(h) + aux


def test_1f1b_frees_the_sent_hidden_of_a_checkpointed_two_output_stage():
    """A stage sending two tensors runs with the pool under Schedule1F1B too: the hidden is freed."""

    def body():
        rank = get_platform().rank
        module = _CheckpointedTwoOutputs() if rank == 0 else _Head()
        sched = Schedule1F1B(PipelineStage(module, rank, 2), MICRO, loss_fn=_mse)
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
        sched.step(x if rank == 0 else None, target=torch.zeros(8, 8) if rank == 1 else None)
        return [int(t.untyped_storage().nbytes()) for t in module.kept] if rank == 0 else None

    nbytes = LocalCluster(2, timeout=60).run(body)[0]
    assert len(nbytes) == MICRO
    assert nbytes == [0] * MICRO, f"sent hidden outputs still hold {nbytes} bytes after the run"
