"""DTensor activations crossing pipeline stages (torch LocalCluster, mesh pp=2 x tp=2).

Stage 0 is a column-parallel linear layer (its output is sharded over ``tp``), stage 1 a
row-parallel one (a pending sum over ``tp``, all-reduced before the loss); with ``send="partial"``
stage 0 also runs the row-parallel product and sends the pending sum itself. The oracle is the dense
two-layer network on the whole batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyper_parallel import DTensor, Partial, PipelineStage, Replicate, Schedule1F1B, Shard, init_device_mesh
from hyper_parallel.core.pipeline_parallel.runtime.dtensor_boundary import layout_meta
from hyper_parallel.core.pipeline_parallel.runtime.meta import LayoutMeta, TensorMeta, decode_meta, encode_meta
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.local import LocalCluster

D, H, OUT, BATCH, MICRO = 4, 6, 3, 8, 4
TOL = dict(rtol=1e-5, atol=1e-6)


def _weights():
    rng = np.random.default_rng(0)
    return {name: (rng.standard_normal(shape) * 0.5).astype(np.float32)
            for name, shape in (("w1", (H, D)), ("b1", (H,)), ("w2", (OUT, H)), ("b2", (OUT,)))}


def _data():
    rng = np.random.default_rng(1)
    return rng.standard_normal((BATCH, D)).astype(np.float32), rng.standard_normal((BATCH, OUT)).astype(np.float32)


class ColumnParallel(torch.nn.Module):
    """tanh(x W1^T + b1) with W1's rows (outputs) split over tp; optionally the row-parallel W2 too."""

    def __init__(self, mesh, w, with_row: bool) -> None:
        super().__init__()
        self.tp = mesh["tp"]
        r, n = self.tp.get_local_rank(), self.tp.size()
        rows = slice(r * H // n, (r + 1) * H // n)
        self.w1 = torch.nn.Parameter(torch.from_numpy(w["w1"][rows].copy()))
        self.b1 = torch.nn.Parameter(torch.from_numpy(w["b1"][rows].copy()))
        self.w2 = torch.nn.Parameter(torch.from_numpy(w["w2"][:, rows].copy())) if with_row else None

    def forward(self, x: DTensor) -> DTensor:
        assert isinstance(x, DTensor) and x.placements == (Replicate(),)
        h = torch.tanh(x.to_local() @ self.w1.t() + self.b1)
        if self.w2 is None:
            return DTensor.from_local(h, self.tp, [Shard(1)])
        return DTensor.from_local(h @ self.w2.t(), self.tp, [Partial()])


class RowParallel(torch.nn.Module):
    """h W2^T + b2 with W2's columns (inputs) split over tp, all-reduced over tp."""

    def __init__(self, mesh, w, with_row: bool) -> None:
        super().__init__()
        self.tp = mesh["tp"]
        r, n = self.tp.get_local_rank(), self.tp.size()
        cols = slice(r * H // n, (r + 1) * H // n)
        self.with_row = with_row
        self.w2 = None if with_row else torch.nn.Parameter(torch.from_numpy(w["w2"][:, cols].copy()))
        self.b2 = torch.nn.Parameter(torch.from_numpy(w["b2"].copy()))

    def forward(self, h: DTensor) -> torch.Tensor:
        if self.with_row:  # the pending sum came from stage 0
            assert h.placements == (Partial(),) and h.shape == (BATCH // MICRO, OUT), h
            y = h
        else:
            assert h.placements == (Shard(1),) and h.shape == (BATCH // MICRO, H), h
            y = DTensor.from_local(h.to_local() @ self.w2.t(), self.tp, [Partial()])
        return y.redistribute(self.tp, [Replicate()]).to_local() + self.b2


def mse(out, target):
    return ((out - target) ** 2).mean()


def _rank_main(send: str):
    p = get_platform()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = mesh.get_local_rank("pp")
    w, (x, y) = _weights(), _data()
    module = (ColumnParallel if pp == 0 else RowParallel)(mesh, w, send == "partial")
    stage = PipelineStage(module, pp, 2, mesh=mesh)
    schedule = Schedule1F1B(stage, MICRO, loss_fn=mse)
    inputs = DTensor.from_local(torch.from_numpy(x), mesh["tp"], [Replicate()]) if pp == 0 else None
    losses = schedule.run(*(() if inputs is None else (inputs,)), target=torch.from_numpy(y) if pp == 1 else None)
    grads = {n: g.numpy().copy() for n, g in stage.named_gradients().items()}
    return {"pp": pp, "tp": mesh.get_local_rank("tp"), "losses": [float(v) for v in losses], "grads": grads,
            "rank": p.rank}


def _oracle():
    w = {k: torch.from_numpy(v).requires_grad_() for k, v in _weights().items()}
    x, y = (torch.from_numpy(a) for a in _data())
    per = BATCH // MICRO
    losses, total = [], 0.0
    for i in range(MICRO):
        h = torch.tanh(x[i * per:(i + 1) * per] @ w["w1"].t() + w["b1"])
        loss = mse(h @ w["w2"].t() + w["b2"], y[i * per:(i + 1) * per])
        losses.append(float(loss.detach()))
        total = total + loss / MICRO
    total.backward()
    return losses, {k: v.grad.numpy() for k, v in w.items()}


@pytest.mark.parametrize("send", ["shard", "partial"])
def test_tensor_parallel_activations_cross_stages(send):
    results = LocalCluster(4).run(_rank_main, send)
    ref_losses, ref = _oracle()
    for r in results:
        if r["pp"] == 1:  # both tp ranks of the last stage hold the (replicated) loss
            np.testing.assert_allclose(r["losses"], ref_losses, **TOL)
        else:
            assert r["losses"] == []
    by_coord = {(r["pp"], r["tp"]): r["grads"] for r in results}
    w1 = np.concatenate([by_coord[(0, t)]["w1"] for t in (0, 1)])
    b1 = np.concatenate([by_coord[(0, t)]["b1"] for t in (0, 1)])
    owner = 0 if send == "partial" else 1
    w2 = np.concatenate([by_coord[(owner, t)]["w2"] for t in (0, 1)], axis=1)
    np.testing.assert_allclose(w1, ref["w1"], **TOL)
    np.testing.assert_allclose(b1, ref["b1"], **TOL)
    np.testing.assert_allclose(w2, ref["w2"], **TOL)
    for t in (0, 1):  # b2 is replicated over tp: each rank gets the whole gradient
        np.testing.assert_allclose(by_coord[(1, t)]["b2"], ref["b2"], **TOL)


def test_layout_block_round_trips_through_the_metadata_encoding():
    layout = LayoutMeta((2, 3), ("dp", "tp"), ((1, 0), (), (1,)), (None, "avg"))
    with pytest.raises(ValueError, match="pending reduction 'prod'"):
        LayoutMeta((2,), ("tp",), ((0,),), ("prod",))
    metas = [TensorMeta((4, 5, 6), "float32", True, LayoutMeta((2,), ("tp",), ((), (), (0,)), (None,))),
             TensorMeta((3,), "int64", False),
             TensorMeta((2, 2, 2), "bfloat16", False, layout)]
    assert decode_meta(encode_meta(metas)) == metas
    with pytest.raises(ValueError, match="does not describe a 2-D tensor"):
        encode_meta([TensorMeta((2, 2), "float32", True, layout)])


def test_layout_meta_of_a_layout_and_a_missing_mesh_is_named():
    from hyper_parallel import Layout
    from hyper_parallel.core.pipeline_parallel.runtime.dtensor_boundary import resolve_layout

    base = Layout((2, 2), ("dp", "tp"))
    meta = layout_meta(base("tp", "None").with_partial("dp"))
    assert meta == LayoutMeta((2, 2), ("dp", "tp"), ((1,), ()), ("sum", None))

    class _Stage:
        stage_index, mesh = 3, None

    with pytest.raises(ValueError, match=r"stage 3 received a DTensor .* PipelineStage\(\.\.\., mesh=mesh\)"):
        resolve_layout(meta, _Stage())
