"""swap_wrapper / checkpoint_wrapper on plain (non-pipelined) models of both frameworks: the same
loss and gradients as the unwrapped model, hooks that fire once, and the errors users get."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper, is_recomputing, swap_wrapper
from hyper_parallel.platform import set_platform

KINDS = ("swap", "checkpoint", "selective", "mixed", "outer")


@pytest.fixture
def torch_platform():
    set_platform("torch")
    yield
    set_platform(None)


@pytest.fixture
def ms_platform():
    set_platform("mindspore")
    yield
    set_platform(None)


def _wrap(blocks, kind):
    if kind == "swap":
        for b in blocks:
            swap_wrapper(b)
    elif kind == "checkpoint":
        for b in blocks:
            checkpoint_wrapper(b)
    elif kind == "selective":
        for b in blocks:
            checkpoint_wrapper(b, save=["fc"])
    elif kind == "mixed":
        swap_wrapper(blocks[0])
        checkpoint_wrapper(blocks[1])
        checkpoint_wrapper(blocks[2], save="pro*")
    elif kind == "outer":  # a wrapped module inside a wrapped module: the outer one decides
        swap_wrapper(blocks[1])
        checkpoint_wrapper(blocks)


# ---------------------------------------------------------------- torch
def _torch_model(dropout=0.0):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc, self.proj = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
            self.drop = nn.Dropout(dropout)

        def forward(self, x):
            return x + self.drop(self.proj(torch.tanh(self.fc(self.ln(x)))).softmax(-1))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)])


def _torch_step(model, x, seed=0):
    import torch

    torch.manual_seed(seed)
    model.zero_grad()
    xx = x.clone().requires_grad_()
    loss = model(xx).pow(2).sum()
    loss.backward()
    return [loss.detach(), xx.grad] + [p.grad.clone() for p in model.parameters()]


def _close(got, ref, rtol=1e-6, atol=1e-7):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=rtol, atol=atol)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_wrappers_match_plain(torch_platform, kind):
    import torch

    base = _torch_model()
    x = torch.randn(4, 8)
    ref = _torch_step(base, x)
    model = copy.deepcopy(base)
    _wrap(model if kind == "outer" else list(model), kind)
    _close(_torch_step(model, x), ref)
    _close(_torch_step(model, x), ref)  # a second step on the same wrapped model


def test_torch_checkpoint_replays_dropout_with_the_forward_random_state(torch_platform):
    import torch

    base = _torch_model(dropout=0.5)
    x = torch.randn(4, 8)
    ref = _torch_step(base, x, seed=3)
    model = copy.deepcopy(base)
    for b in model:
        checkpoint_wrapper(b)
    _close(_torch_step(model, x, seed=3), ref)
    other = copy.deepcopy(base)
    for b in other:
        checkpoint_wrapper(b, preserve_rng=False)
    got = _torch_step(other, x, seed=3)
    assert any(not np.allclose(g.numpy(), r.numpy()) for g, r in zip(got[2:], ref[2:])), \
        "without the forward's random state the re-run draws other dropout masks"


def test_torch_hooks_fire_once_per_forward_and_backward(torch_platform):
    import torch

    model = _torch_model()
    for b in model:
        checkpoint_wrapper(b)
    counts = {"all": 0, "once": 0, "backward": 0, "flag_outside": []}

    def fwd(*_):
        counts["all"] += 1
        if not is_recomputing():
            counts["once"] += 1

    for b in model:
        b.fc.register_forward_hook(fwd)
        b.fc.register_full_backward_hook(lambda *_: counts.__setitem__("backward", counts["backward"] + 1))
    x = torch.randn(4, 8)
    _torch_step(model, x)
    counts["flag_outside"].append(is_recomputing())
    assert counts["once"] == 4 and counts["backward"] == 4
    assert counts["all"] == 8, "the re-run calls each checkpointed sub-module again"
    assert counts["flag_outside"] == [False]


def test_torch_forward_that_changes_between_runs_is_refused(torch_platform):
    import torch
    from torch import nn

    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.calls = nn.Linear(4, 4), 0

        def forward(self, x):
            self.calls += 1
            y = torch.tanh(self.lin(x))
            return torch.tanh(y) if self.calls == 1 else y  # the re-run saves one tensor fewer

    model = checkpoint_wrapper(Flaky())
    loss = model(torch.randn(2, 4, requires_grad=True)).sum()
    with pytest.raises(RuntimeError, match="must do the same operations every time"):
        loss.backward()


def test_torch_wrapper_errors(torch_platform):
    model = _torch_model()
    with pytest.raises(ValueError, match=r"save='attn' matches no sub-module of Block \(sub-modules: ln, fc"):
        checkpoint_wrapper(model[0], save=["attn"])
    checkpoint_wrapper(model[1])
    with pytest.raises(ValueError, match="already wrapped by checkpoint_wrapper"):
        swap_wrapper(model[1])
    with pytest.raises(TypeError, match="swap_wrapper needs a torch module, got int"):
        swap_wrapper(3)
    with pytest.raises(TypeError, match="save= takes sub-module names"):
        checkpoint_wrapper(model[2], save=[3])


# ---------------------------------------------------------------- MindSpore
def _ms_model(kind):
    import mindspore as ms
    from mindspore import nn, ops

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.ln, self.fc, self.proj = nn.LayerNorm((8,)), nn.Dense(8, 16), nn.Dense(16, 8)

        def construct(self, x):
            return x + ops.softmax(self.proj(ops.tanh(self.fc(self.ln(x)))), -1)

    ms.set_seed(0)
    model = nn.SequentialCell([Block() for _ in range(4)])
    if kind != "plain":
        _wrap(model if kind == "outer" else list(model), kind)
    return model


def _ms_step(model, x):
    import mindspore as ms

    loss, (gx, gw) = ms.value_and_grad(lambda a: (model(a) ** 2).sum(), 0, weights=model.trainable_params())(x)
    return [loss.asnumpy(), gx.asnumpy()] + [g.asnumpy() for g in gw]


@pytest.mark.parametrize("kind", ["mixed", "outer"])
def test_mindspore_wrappers_match_plain(ms_platform, kind):
    import mindspore as ms

    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    ref = _ms_step(_ms_model("plain"), x)
    _close(_ms_step(_ms_model(kind), x), ref, rtol=1e-5, atol=1e-6)


def test_mindspore_hooks_fire_once(ms_platform):
    import mindspore as ms

    model = _ms_model("checkpoint")
    counts = {"all": 0, "once": 0, "backward": 0}

    def fwd(*_):
        counts["all"] += 1
        if not is_recomputing():
            counts["once"] += 1

    for b in model:
        b.fc.register_forward_hook(fwd)
        b.fc.register_backward_hook(lambda *_: counts.__setitem__("backward", counts["backward"] + 1))
    _ms_step(model, ms.Tensor(np.ones((4, 8), np.float32)))
    assert counts == {"all": 8, "once": 4, "backward": 4}
