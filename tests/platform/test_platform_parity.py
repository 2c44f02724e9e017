"""The same checks on both frameworks: tensor helpers and stage autograd in any order.

The model is a small three-layer stage (matmul, LayerNorm-like normalisation, tanh, two
outputs). The oracle is one full-batch forward + backward with each framework's own public
autograd API; the platform must reproduce it when the batch is split into 4 micro-batches
whose backward runs in 1F1B order, in F-F-B-B order, and split into dx then dW.
"""

from __future__ import annotations

import numpy as np
import pytest

MICRO = 4
BATCH = 8
D_IN, D_HID, D_OUT = 6, 10, 5


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.standard_normal((D_IN, D_HID)).astype(np.float32) * 0.5,
        "b1": rng.standard_normal((D_HID,)).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((D_HID, D_HID)).astype(np.float32) * 0.5,
        "w3": rng.standard_normal((D_HID, D_OUT)).astype(np.float32) * 0.5,
    }


class TorchCase:
    name = "torch"
    abs_tol, rel_tol = 1e-6, 0.0

    def __init__(self) -> None:
        import torch

        from hyper_parallel.platform.torch import TorchPlatform

        self.torch = torch
        self.platform = TorchPlatform()

    def build(self, weights):
        torch = self.torch

        class Stage(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                for k, v in weights.items():
                    self.register_parameter(k, torch.nn.Parameter(torch.from_numpy(v.copy())))

            def forward(self, x, scale=1.0):
                h = torch.tanh(x @ self.w1 + self.b1)
                h = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, keepdim=True, unbiased=False) + 1e-5)
                h = torch.tanh(h @ self.w2) * scale
                return h @ self.w3, h.sum(-1)

        return Stage()

    def reference(self, weights, x, dy1, dy2, scale):
        torch = self.torch
        model = self.build(weights)
        xt = torch.from_numpy(x).requires_grad_(True)
        y1, y2 = model(xt, scale=scale)
        torch.autograd.backward((y1, y2), (torch.from_numpy(dy1), torch.from_numpy(dy2)))
        return xt.grad.numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}


class MindSporeCase:
    name = "mindspore"
    abs_tol, rel_tol = 1e-6, 1e-5

    def __init__(self) -> None:
        import mindspore as ms

        from hyper_parallel.platform.mindspore import MindSporePlatform

        self.ms = ms
        self.platform = MindSporePlatform()

    def build(self, weights):
        ms = self.ms
        from mindspore import nn, ops

        class Stage(nn.Cell):
            def __init__(self) -> None:
                super().__init__()
                for k, v in weights.items():
                    setattr(self, k, ms.Parameter(ms.Tensor(v.copy()), name=k))

            def construct(self, x, scale=1.0):
                h = ops.tanh(ops.matmul(x, self.w1) + self.b1)
                mean = h.mean(-1, keep_dims=True)
                var = ((h - mean) ** 2).mean(-1, keep_dims=True)
                h = (h - mean) / ops.sqrt(var + 1e-5)
                h = ops.tanh(ops.matmul(h, self.w2)) * scale
                return ops.matmul(h, self.w3), h.sum(-1)

        return Stage()

    def reference(self, weights, x, dy1, dy2, scale):
        ms = self.ms
        model = self.build(weights)
        params = model.trainable_params()

        def fn(inp):
            return model(inp, scale=scale)

        _, vjp_fn = ms.vjp(fn, ms.Tensor(x), weights=params)
        dx, dws = vjp_fn((ms.Tensor(dy1), ms.Tensor(dy2)))
        dx = dx[0] if isinstance(dx, tuple) else dx
        names = [p.name.split(".")[-1] for p in params]
        return dx.asnumpy(), {n: g.asnumpy() for n, g in zip(names, dws)}


CASES = {"torch": TorchCase, "mindspore": MindSporeCase}


@pytest.fixture(params=list(CASES), scope="module")
def case(request):
    return CASES[request.param]()


def _close(actual, expected, case, what):
    np.testing.assert_allclose(actual, expected, rtol=case.rel_tol, atol=case.abs_tol, err_msg=what)


def test_tensor_helpers(case):
    p = case.platform
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = p.from_numpy(a)
    assert p.is_tensor(t) and not p.is_tensor(a)
    assert p.shape(t) == (4, 6) and p.dtype_name(t) == "float32" and p.is_floating(t)
    assert p.numel(t) == 24
    parts = p.chunk(t, 2, dim=1)
    assert [p.shape(x) for x in parts] == [(4, 3), (4, 3)]
    np.testing.assert_array_equal(p.to_numpy(p.cat(parts, dim=1)), a)
    with pytest.raises(ValueError, match="3 equal chunks"):
        p.chunk(t, 3, dim=0)
    ints = p.tensor([1, 2, 3], dtype="int64")
    assert p.dtype_name(ints) == "int64" and not p.is_floating(ints)
    assert p.to_numpy(p.zeros((2, 3), "float32")).sum() == 0
    assert p.to_numpy(p.ones((2,), "int32")).tolist() == [1, 1]
    assert p.shape(p.empty((3, 1), "float16")) == (3, 1)
    c = p.clone(t)
    p.copy_(c, p.zeros_like(t))
    assert p.to_numpy(c).sum() == 0 and p.to_numpy(t).sum() == a.sum()
    assert p.storage_nbytes(t) >= 24 * 4
    bf = p.from_numpy(np.array([1.5, -2.0], np.float32), dtype="bfloat16")
    assert p.dtype_name(bf) == "bfloat16"
    np.testing.assert_array_equal(p.to_numpy(bf), [1.5, -2.0])
    with pytest.raises(ValueError, match="dtype"):
        p.zeros((1,), "float99")
    host = p.to_host(t)
    np.testing.assert_array_equal(p.to_numpy(p.to_device(host)), a)
    assert p.device_type == "cpu"


def test_streams_and_events_order_work(case):
    p = case.platform
    stream, event = p.new_stream(), p.new_event()
    with p.stream_context(stream):
        t = p.from_numpy(np.ones((3,), np.float32))
        doubled = t + t
        event.record(stream)
    event.wait()
    event.synchronize()
    p.synchronize()
    assert event.query()
    np.testing.assert_array_equal(p.to_numpy(doubled), [2.0, 2.0, 2.0])


def _micro_data(seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, D_IN)).astype(np.float32)
    dy1 = rng.standard_normal((BATCH, D_OUT)).astype(np.float32)
    dy2 = rng.standard_normal((BATCH,)).astype(np.float32)
    return x, dy1, dy2


ORDERS = {
    # (kind, micro) events; "F" forward, "B" full backward, "I" input grads, "W" weight grads
    "1f1b": [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
    "ffbb": [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)],
    "split": [("F", 0), ("F", 1), ("I", 0), ("F", 2), ("I", 1), ("W", 0), ("F", 3), ("I", 3),
              ("I", 2), ("W", 3), ("W", 1), ("W", 2)],
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_stage_autograd_matches_full_batch(case, order):
    p = case.platform
    weights = _weights()
    x, dy1, dy2 = _micro_data()
    scale = 0.7
    ref_dx, ref_dw = case.reference(weights, x, dy1, dy2, scale)

    model = case.build(weights)
    named = p.named_parameters(model)
    params = [param for _, param in named]
    xs = np.split(x, MICRO)
    dys = list(zip(np.split(dy1, MICRO), np.split(dy2, MICRO)))
    records, dx = {}, {}
    for kind, i in ORDERS[order]:
        if kind == "F":
            records[i] = p.stage_forward(
                lambda inp, label, scale: model(inp, scale=scale),
                (p.from_numpy(xs[i]), "not-a-tensor"),
                {"scale": scale},
                params,
                (True, False),
            )
            assert len(records[i].outputs) == 2
        elif kind == "W":
            p.stage_backward_weight(records[i])
        else:
            grads = (p.from_numpy(dys[i][0]), p.from_numpy(dys[i][1]))
            step = p.stage_backward if kind == "B" else p.stage_backward_input
            got = step(records[i], grads)
            assert got[1] is None, "a non-differentiable argument has no gradient"
            dx[i] = p.to_numpy(got[0])
    _close(np.concatenate([dx[i] for i in range(MICRO)]), ref_dx, case, "input gradients")
    got_dw = {name.split(".")[-1]: p.to_numpy(p.get_grad(param)) for name, param in named}
    assert set(got_dw) == set(ref_dw)
    for name in ref_dw:
        _close(got_dw[name], ref_dw[name], case, f"gradient of {name}")

    # scaling once and zeroing
    p.scale_grads(params, 1.0 / MICRO)
    _close(p.to_numpy(p.get_grad(params[0])), ref_dw[named[0][0].split(".")[-1]] / MICRO, case, "scaled")
    p.zero_grads(params)
    assert all(p.get_grad(param) is None for param in params)


def test_output_without_gradient_and_unused_input(case):
    p = case.platform
    model = case.build(_weights())
    params = [param for _, param in p.named_parameters(model)]
    x, dy1, _ = _micro_data()
    unused = p.from_numpy(np.ones((2, 2), np.float32))
    rec = p.stage_forward(lambda inp, extra: model(inp), (p.from_numpy(x), unused), {}, params, (True, True))
    dx, dunused = p.stage_backward(rec, (p.from_numpy(dy1), None))
    assert p.shape(dx) == x.shape
    assert dunused is None or float(np.abs(p.to_numpy(dunused)).sum()) == 0.0
    assert p.get_grad(params[0]) is not None
